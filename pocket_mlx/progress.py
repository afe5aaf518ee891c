"""Progress on stderr: a tqdm bar on a terminal, plain periodic lines anywhere else.

A bar redraws itself with `\\r`, which is garbage in a log file or a pipe; and printing nothing
in a pipe leaves a user (or CI) looking at minutes of silence during a conversion. So when the
stream is not a terminal, progress is one plain line after the first step, one every
`interval` seconds ($POCKET_MLX_PROGRESS_INTERVAL, default 10), and one when it is complete;
each says how far, how fast and, with a total, how long is left. Nothing is printed before the
first step: a task that fails at once leaves its error alone on stderr (one line), not mixed
with progress. Byte counts (unit "B" with unit_scale) read as everywhere else: units.size (IEC).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm import tqdm

from pocket_mlx import units

DEFAULT_INTERVAL = 10.0


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("POCKET_MLX_PROGRESS_INTERVAL", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


def _is_bytes(unit: str, scale: bool) -> bool:
    return scale and unit == "B"


def _amount(n: float, total: float | None, unit: str, scale: bool) -> str:
    """How far: '1.20 MiB/3.11 MiB' (bytes), '12/40 it', '1.50M/2.00M tok' (a scaled count);
    without a total just the first figure."""
    if _is_bytes(unit, scale):
        return f"{units.size(n)}/{units.size(total)}" if total else units.size(n)

    def num(v: float) -> str:
        return units.count(v) if scale else f"{v:g}"

    return f"{num(n)}/{num(total)} {unit}" if total else f"{num(n)} {unit}"


def _clock(seconds: float) -> str:
    """'0:42', '12:05', '1:02:03'."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _rate(per_s: float, unit: str, scale: bool) -> str:
    if _is_bytes(unit, scale):
        return f"{units.size(per_s)}/s"
    return f"{units.count(per_s) if per_s >= 1000 else f'{per_s:.3g}'} {unit}/s"


class PlainProgress:
    """tqdm's small surface (`update`, `close`, `total`, `n`, iteration, `with`) as lines."""

    def __init__(self, iterable: Iterable | None = None, *, total: float | None = None,
                 desc: str = "", unit: str = "it", unit_scale: bool = False,
                 file: IO[str] | None = None, interval: float | None = None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.n = total, 0
        self.desc, self.unit, self.unit_scale = desc, unit, unit_scale
        self.file = file or sys.stderr
        self.interval = _interval() if interval is None else interval
        self.t0 = self.last = time.monotonic()
        self.closed = self.started = False
        self.postfix = ""

    def _line(self, note: str = "") -> None:
        scaled = self.unit_scale
        done = _amount(self.n, self.total, self.unit, scaled)
        if self.total:
            done += f" ({100 * self.n / self.total:.0f}%)"
        elapsed = time.monotonic() - self.t0
        parts = [f"{self.desc}: {done}", f"{elapsed:.0f} s"]
        if self.n > 0 and elapsed >= 0.5:  # before that a rate is noise
            rate = self.n / elapsed
            parts.append(_rate(rate, self.unit, scaled))
            if self.total and self.n < self.total:
                parts.append(f"{_clock((self.total - self.n) / rate)} left")
        if note or self.postfix:  # the item in hand, or how it ended
            parts.append(note or self.postfix)
        print(", ".join(parts), file=self.file, flush=True)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """What the lines end with (tqdm's name): the item being worked on."""
        self.postfix = s

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if not self.started or now - self.last >= self.interval:
            self.started, self.last = True, now
            if not self.total or self.n < self.total:  # else close() says it
                self._line()

    def close(self) -> None:
        """The last line, when the task completed (a failed one has its own error line)."""
        if not self.closed:
            self.closed = True
            if self.started and (not self.total or self.n >= self.total):
                self._line("done")

    def __iter__(self) -> Iterator:
        try:
            for x in self.iterable or ():
                yield x
                self.update()
        finally:
            self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _ByteBar(tqdm):
    """A tqdm bar whose byte counts and rate read as units.size writes them (IEC, with the
    unit's name: '4.66 GiB/18.6 GiB', '40.0 MiB/s'), not tqdm's own '5.00G/20.0GB'."""

    BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {done}/{all} "
                  "[{elapsed}<{remaining}, {speed}{postfix}]")

    @property
    def format_dict(self) -> dict:
        d = super().format_dict
        rate = d["rate"] or (d["n"] / d["elapsed"] if d["elapsed"] else None)
        d.update(done=units.size(d["n"]), all=units.size(d["total"]) if d["total"] else "?",
                 speed=f"{units.size(rate)}/s" if rate else "? B/s")
        return d


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "",
             unit: str = "it", unit_scale: bool = False, enabled: bool = True,
             file: IO[str] | None = None) -> Any:
    """A progress tracker for `iterable` (or for `update(n)` calls up to `total`).

    `enabled=False` (a --quiet flag) shows nothing. Otherwise: a transient tqdm bar when
    `file` (default stderr) is a terminal, plain periodic lines when it is not. Both take
    `update(n)`, `set_postfix_str(s)` and `close()`.
    """
    file = file or sys.stderr
    if enabled and not _isatty(file):
        return PlainProgress(iterable, total=total, desc=desc, unit=unit,
                             unit_scale=unit_scale, file=file)
    if enabled and _is_bytes(unit, unit_scale):
        return _ByteBar(iterable, total=total, desc=desc, unit=unit, leave=False, file=file,
                        bar_format=_ByteBar.BAR_FORMAT)
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                disable=not enabled, leave=False, file=file)


def _isatty(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False
