"""Progress on stderr: a tqdm bar on a terminal, plain periodic lines anywhere else.

A bar redraws itself with `\\r`, which is garbage in a log file or a pipe; and printing nothing
in a pipe leaves a user (or CI) looking at minutes of silence during a conversion. So when the
stream is not a terminal, progress is one plain line after the first step, one every
`interval` seconds ($POCKET_MLX_PROGRESS_INTERVAL, default 10), and one when it is complete.
Nothing is printed before the first step: a task that fails at once leaves its error alone on
stderr (one line), not mixed with progress.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm import tqdm

DEFAULT_INTERVAL = 10.0


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("POCKET_MLX_PROGRESS_INTERVAL", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


def _amount(n: float, unit: str, scale: bool) -> str:
    if not scale:
        return f"{n:g}"
    for suffix, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:g}"


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

    def _line(self, note: str = "") -> None:
        done = _amount(self.n, self.unit, self.unit_scale)
        of = f"/{_amount(self.total, self.unit, self.unit_scale)}" if self.total else ""
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        elapsed = time.monotonic() - self.t0
        tail = f", {note}" if note else ""
        print(f"{self.desc}: {done}{of} {self.unit}{pct}, {elapsed:.0f} s{tail}",
              file=self.file, flush=True)

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


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "",
             unit: str = "it", unit_scale: bool = False, enabled: bool = True,
             file: IO[str] | None = None) -> Any:
    """A progress tracker for `iterable` (or for `update(n)` calls up to `total`).

    `enabled=False` (a --quiet flag) shows nothing. Otherwise: a transient tqdm bar when
    `file` (default stderr) is a terminal, plain periodic lines when it is not.
    """
    file = file or sys.stderr
    if enabled and not _isatty(file):
        return PlainProgress(iterable, total=total, desc=desc, unit=unit,
                             unit_scale=unit_scale, file=file)
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                disable=not enabled, leave=False, file=file)


def _isatty(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False
