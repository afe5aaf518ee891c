"""Live throughput panel: phase, speeds, tokens, context, bandwidth, memory, device; with
speculative decoding on, the drafts accepted per trunk pass.

The app hands it the latest stats (a copy the engine published) and calls `redraw` on its one
4 Hz tick (REFRESH_S), in the same callback as the reply's text appends; memory is sampled even
between replies.

The panel is one widget that draws its lines itself (Textual's line API), not a container of a
dozen widgets: while a reply streams, each text append re-lays out the whole screen and every
widget on it is arranged again, and each widget that changes costs an update message and a render
of its own. `redraw` works out *what* each line shows; only the lines that changed are repainted,
never with a layout (the panel's size does not depend on its content), and `render_line` draws a
line straight into segments (no Rich or Content render pass). It has no timers of its own either
(a `ProgressBar` animates at 15 Hz and polls at 1 Hz).
"""

from __future__ import annotations

import time
from collections import deque

import mlx.core as mx
from rich.segment import Segment
from rich.style import Style
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from pocket_mlx import kernels, units
from pocket_mlx.engine.devices import describe
from pocket_mlx.engine.generation import GenerationStats
from pocket_mlx.system.memory import wired_limit_status

REFRESH_S = 0.25
LABEL_W = 10  # label column of the speed and detail rows
SPARK_POINTS = 24  # decode tok/s samples in the sparkline: the last 6 s at 4 Hz
SPARK_ROWS = 2
BARS = "▁▂▃▄▅▆▇█"
SPARK_SHADES = 16  # colours between the lowest and highest bar


class StatsPanel(Widget):
    """Right-hand panel. Public methods are called by the app on engine messages."""

    COMPONENT_CLASSES = {
        "stats--label", "stats--live", "stats--idle", "stats--phase",
        "stats--bar", "stats--bar-back", "stats--spark-min", "stats--spark-max",
    }

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
        self.prefill: tuple[int, int] | None = None  # (done, total) prompt tokens while prefilling
        self._rates: deque[float] = deque([0.0] * SPARK_POINTS, maxlen=SPARK_POINTS)
        self._last: tuple[float, int] | None = None
        self._shown: list[tuple] = []  # what each line shows now (see `lines`)
        self._style_cache: dict | None = None

    def on_mount(self) -> None:
        self.redraw()  # then on the app's tick, every REFRESH_S

    # ---- inputs --------------------------------------------------------------------------
    def show_host(self, device: str) -> None:
        """The rows that stay for the session: the device, the kernels, the wired limit."""
        self.device_label = describe(device)
        self.kernels = kernels.label()
        try:
            self.wired = wired_limit_status()
        except Exception:  # noqa: BLE001 - a missing sysctl must not stop the chat
            self.wired = None

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if phase == "prefill":
            self.prefill = None
            self.stats = None
            self._last = None

    def set_prefill(self, done: int, total: int, context: int) -> None:
        self.prefill = (done, total)
        self.context_used = context

    def set_context(self, tokens: int) -> None:
        """The tokens of the conversation on screen, between replies (new, opened, undone)."""
        self.context_used = tokens

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

    def rows(self) -> list[tuple[str, str]]:
        """The label/value lines under the phase: speeds first, then the details."""
        s = self.stats
        bpt = s.bytes_per_token if s and s.bytes_per_token else self.bytes_per_token
        rows = [
            ("TTFT", f"{s.ttft_s:.2f} s" if s and s.ttft_s else "–"),
            ("prefill", f"{s.prompt_tps:,.0f} tok/s" if s and s.prompt_tps else "–"),
            ("decode", f"{s.generation_tps:.1f} tok/s" if s and s.generation_tps else "–"),
            ("tokens", str(s.generation_tokens) if s else "–"),
            *token_split(s),
            *([("accepted", accepted_per_pass(s.speculative))] if s and s.speculative else []),
            ("context", f"{self.context_used:,} / {self.context_max:,}"),
            ("weights", f"{units.size(bpt)}/tok" if bpt else "–"),
            ("bandwidth", units.bandwidth(s.gbps) if s and s.generation_tps else "–"),
            ("memory", f"{units.size(mx.get_active_memory())} active"),
            ("peak", units.size(mx.get_peak_memory())),
            ("device", self.device_label),
        ]
        if self.wired:
            rows.append(("wired", self.wired))
        rows.append(("kernels", self.kernels))
        return rows

    def lines(self) -> list[tuple]:
        """What each line shows, as plain data (`render_line` draws it)."""
        live = self.phase in ("prefill", "decoding")
        prefill = None
        if self.phase == "prefill":
            done, total = self.prefill or (0, 0)
            prefill = done / total if total else 0.0
        rates = tuple(self._rates)
        rows = self.rows()
        return [
            ("phase", self.phase, live),
            ("bar", prefill),  # blank after prefill: the line stays, nothing below moves
            *(("row", *r) for r in rows[:3]),
            *(("spark", i, rates) for i in reversed(range(SPARK_ROWS))),
            ("blank",),
            *(("row", *r) for r in rows[3:]),
        ]

    def redraw(self) -> None:
        """Work out what to show; repaint the lines that changed (never a layout)."""
        self._sample_rate()
        new, old = self.lines(), self._shown
        self._shown = new
        if len(new) != len(old):
            self.refresh()
            return
        width = self.size.width
        for y, (a, b) in enumerate(zip(new, old)):
            if a != b:
                self.refresh(Region(0, y, width, 1))

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        st = self._styles()
        base = st["base"]
        if y >= len(self._shown) or not width:
            return Strip.blank(width, base)
        kind, *args = self._shown[y]
        segments: list[Segment]
        if kind == "phase":
            phase, live = args
            segments = [Segment("● ", st["live" if live else "idle"]), Segment(phase, st["phase"])]
        elif kind == "row":
            label, value = args
            segments = [Segment(label.ljust(LABEL_W), st["label"]), Segment(value, base)]
        elif kind == "bar" and args[0] is not None:
            segments = bar(args[0], width, st["bar"], st["bar-back"], base)
        elif kind == "spark":
            row, rates = args
            segments = sparkline_row(rates, width, row, SPARK_ROWS, st["spark"], base)
        else:
            segments = []
        strip = Strip(segments)
        if strip.cell_length > width:  # a long device or kernels label: cut with an ellipsis
            strip = strip.crop(0, width - 1).extend_cell_length(width - 1, base)
            return Strip([*strip, Segment("…", base)], width)
        return strip.extend_cell_length(width, base)

    def _styles(self) -> dict:
        """The Rich styles of the panel's parts, from chat.tcss; worked out once (Textual's own
        lookups walk the DOM), again after a CSS or theme change (`notify_style_update`)."""
        if self._style_cache is None:
            base = self.rich_style
            _, background = self.background_colors

            def part(name: str) -> Style:
                return base + self.get_component_rich_style(f"stats--{name}", partial=True)

            def fg(name: str) -> Style:  # alpha blended over the background, as Textual's
                # own Sparkline and Bar draw theirs
                color = background + self.get_component_styles(f"stats--{name}").color
                return base + Style(color=color.rich_color)

            lo = background + self.get_component_styles("stats--spark-min").color
            hi = background + self.get_component_styles("stats--spark-max").color
            self._style_cache = {
                "base": base, "label": part("label"), "phase": part("phase"),
                "live": part("live"), "idle": part("idle"), "bar": fg("bar"),
                "bar-back": fg("bar-back"),
                # the sparkline's colours by bar height, lowest to highest
                "spark": [base + Style(color=lo.blend(hi, i / SPARK_SHADES).rich_color)
                          for i in range(SPARK_SHADES + 1)],
            }
        return self._style_cache

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._style_cache = None


def token_split(s: GenerationStats | None) -> list[tuple[str, str]]:
    """A thinking model's tokens apart: those of its reasoning, then the rest (the answer,
    with the block's close). No rows for a reply without reasoning."""
    if s is None or not s.reasoning_tokens:
        return []
    return [(" thought", str(s.reasoning_tokens)),
            (" answer", str(max(0, s.generation_tokens - s.reasoning_tokens)))]


def accepted_per_pass(spec: dict) -> str:
    """Speculative decoding's yield (engine/speculative.py, SpecCounts): drafts accepted per
    trunk pass, and the share of drafts accepted: `1.52/pass (61%)`."""
    passes, drafted, accepted = spec.get("passes", 0), spec["drafted"], spec["accepted"]
    per = f"{accepted / passes:.2f}/pass" if passes else "–"
    return f"{per} ({100 * accepted / drafted:.0f}%)" if drafted else per


def bar(fraction: float, width: int, done: Style, back: Style, base: Style) -> list[Segment]:
    """A one-line progress bar with its percentage: `━━━━━━━━━━━━━━━━━━━━━  42%`."""
    cells = max(1, width - 5)
    filled = round(max(0.0, min(1.0, fraction)) * cells)
    return [Segment("━" * filled, done), Segment("━" * (cells - filled), back),
            Segment(f"{100 * fraction:4.0f}%", base)]


def sparkline_row(data: tuple[float, ...], width: int, row: int, height: int,
                  shades: list[Style], base: Style) -> list[Segment]:
    """Line `row` (0 = bottom) of bars scaled min..max over `width` columns and `height` lines,
    shaded by height (`shades`, lowest first): what Textual's Sparkline draws, without a widget."""
    low, high = min(data), max(data)
    extent = (high - low) or 1
    steps = len(BARS) * height - 1
    floor, ceil = row * len(BARS), (row + 1) * len(BARS)
    top = len(shades) - 1
    segments = []
    for c in range(width):
        start, end = len(data) * c // width, len(data) * (c + 1) // width
        ratio = (max(data[start:end] or data[start:start + 1]) - low) / extent
        i = int(ratio * steps)
        if i < floor:
            segments.append(Segment(" ", base))
        else:
            segments.append(Segment("█" if i >= ceil else BARS[i % len(BARS)],
                                    shades[round(ratio * top)]))
    return segments
