"""Live throughput panel: phase, speeds, tokens, context, bandwidth, memory, device.

The app hands it the latest stats (a copy, from the engine's messages); the panel redraws on its
own 4 Hz timer, so a burst of tokens costs one redraw, and memory is sampled even between them.
"""

from __future__ import annotations

import time
from collections import deque

import mlx.core as mx
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Sparkline, Static

from pocket_mlx.generation import GenerationStats

from .model_info import human_bytes

REFRESH_S = 0.25


class StatsPanel(Vertical):
    """Right-hand panel. Public methods are called by the app on engine messages."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "throughput"
        self.phase = "loading model"
        self.stats: GenerationStats | None = None
        self.context_used = 0
        self.context_max = 0
        self.device_label = "?"
        self.wired: str | None = None
        self.kernels = "MLX"
        self.bytes_per_token = 0
        self._rates: deque[float] = deque([0.0] * 24, maxlen=24)
        self._last: tuple[float, int] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="phase")
        yield ProgressBar(id="prefill-bar", show_eta=False)
        yield Static(id="speeds")
        yield Sparkline(list(self._rates), id="tps-spark")
        yield Static(id="details")

    def on_mount(self) -> None:
        self.query_one("#prefill-bar").display = False
        self.set_interval(REFRESH_S, self.redraw)
        self.redraw()

    # ---- inputs --------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        self.phase = phase
        bar = self.query_one("#prefill-bar", ProgressBar)
        bar.display = phase == "prefill"
        if phase == "prefill":
            bar.update(total=None, progress=0)
            self.stats = None
            self._last = None

    def set_prefill(self, done: int, total: int, context: int) -> None:
        self.query_one("#prefill-bar", ProgressBar).update(total=total, progress=done)
        self.context_used = context

    def set_stats(self, stats: GenerationStats, context: int) -> None:
        self.stats = stats
        self.context_used = context
        if stats.phase == "decode" and self.phase == "prefill":
            self.set_phase("decoding")

    # ---- drawing -------------------------------------------------------------------------
    def _sample_rate(self) -> None:
        s = self.stats
        if self.phase != "decoding" or s is None:
            return
        now = time.perf_counter()
        if self._last is not None:
            t, n = self._last
            if now > t:
                self._rates.append(max(0.0, (s.generation_tokens - n) / (now - t)))
        self._last = (now, s.generation_tokens)
        self.query_one("#tps-spark", Sparkline).data = list(self._rates)

    def redraw(self) -> None:
        self._sample_rate()
        s = self.stats
        label = {"prefill": "prefill", "decoding": "decoding"}.get(self.phase, self.phase)
        phase = Text.assemble(("● ", "bold green" if self.phase in ("prefill", "decoding")
                               else "dim"), (label, "bold"))
        self.query_one("#phase", Static).update(phase)

        speeds = Table.grid(padding=(0, 1))
        speeds.add_column(style="dim", no_wrap=True)
        speeds.add_column(no_wrap=True)
        speeds.add_row("TTFT", f"{s.ttft_s:.2f} s" if s and s.ttft_s else "–")
        speeds.add_row("prefill", f"{s.prompt_tps:,.0f} tok/s" if s and s.prompt_tps else "–")
        speeds.add_row("decode", Text(f"{s.generation_tps:.1f} tok/s", style="bold")
                       if s and s.generation_tps else "–")
        self.query_one("#speeds", Static).update(speeds)

        d = Table.grid(padding=(0, 1))
        d.add_column(style="dim", no_wrap=True)
        d.add_column(no_wrap=True)
        d.add_row("tokens", str(s.generation_tokens) if s else "–")
        d.add_row("context", f"{self.context_used:,} / {self.context_max:,}")
        bpt = (s.bytes_per_token if s and s.bytes_per_token else self.bytes_per_token)
        d.add_row("weights", f"{human_bytes(bpt)}/tok" if bpt else "–")
        d.add_row("bandwidth", f"{s.gbps:.2f} GB/s" if s and s.generation_tps else "–")
        d.add_row("memory", f"{human_bytes(mx.get_active_memory())} active")
        d.add_row("peak", human_bytes(mx.get_peak_memory()))
        d.add_row("device", self.device_label)
        if self.wired:
            d.add_row("wired", self.wired)
        d.add_row("kernels", self.kernels)
        self.query_one("#details", Static).update(d)
