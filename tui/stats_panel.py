"""Live throughput panel: phase, speeds, tokens, context, bandwidth, memory, device.

The app hands it the latest stats (a copy the engine published) and calls `redraw` on its one
4 Hz tick (REFRESH_S), in the same callback as the reply's text appends, so the whole UI costs one
compositor pass per tick; memory is sampled even between replies.
"""

from __future__ import annotations

import time
from collections import deque

import mlx.core as mx
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
        self._shown: dict[str, str] = {}

    def compose(self) -> ComposeResult:
        yield Static(id="phase")
        yield ProgressBar(id="prefill-bar", show_eta=False)
        yield Static(id="speeds")
        yield Sparkline(list(self._rates), id="tps-spark")
        yield Static(id="details")

    def on_mount(self) -> None:
        self.query_one("#prefill-bar").display = False
        self.redraw()  # then on the app's tick, every REFRESH_S

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
        live = self.phase in ("prefill", "decoding")
        self._put("#phase", Text.assemble(("● ", "bold green" if live else "dim"),
                                          (self.phase, "bold")))
        self._put("#speeds", rows([
            ("TTFT", f"{s.ttft_s:.2f} s" if s and s.ttft_s else "–"),
            ("prefill", f"{s.prompt_tps:,.0f} tok/s" if s and s.prompt_tps else "–"),
            ("decode", f"{s.generation_tps:.1f} tok/s" if s and s.generation_tps else "–"),
        ]))
        bpt = s.bytes_per_token if s and s.bytes_per_token else self.bytes_per_token
        details = [
            ("tokens", str(s.generation_tokens) if s else "–"),
            ("context", f"{self.context_used:,} / {self.context_max:,}"),
            ("weights", f"{human_bytes(bpt)}/tok" if bpt else "–"),
            ("bandwidth", f"{s.gbps:.2f} GB/s" if s and s.generation_tps else "–"),
            ("memory", f"{human_bytes(mx.get_active_memory())} active"),
            ("peak", human_bytes(mx.get_peak_memory())),
            ("device", self.device_label),
        ]
        if self.wired:
            details.append(("wired", self.wired))
        details.append(("kernels", self.kernels))
        self._put("#details", rows(details))

    def _put(self, selector: str, text: Text) -> None:
        """Update a Static only when its text changed, and re-lay out the screen only when its
        line count did: a layout pass is the UI's costliest step, and it competes with decode."""
        old = self._shown.get(selector)
        if old != text.plain:
            self._shown[selector] = text.plain
            relayout = old is None or old.count("\n") != text.plain.count("\n")
            self.query_one(selector, Static).update(text, layout=relayout)


def rows(pairs: list[tuple[str, str]], width: int = 10) -> Text:
    """Label/value lines as one Text: far cheaper to render 4x a second than a Rich Table."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, (label, value) in enumerate(pairs):
        if i:
            text.append("\n")
        text.append(label.ljust(width), "dim")
        text.append(value)
    return text
