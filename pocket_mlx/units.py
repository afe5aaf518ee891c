"""One set of formatters for bytes, parameter counts and rates, so a figure reads the same in
`info`, `bench`, `wired`, `generate` and the chat.

Sizes are binary (IEC: KiB, MiB, GiB = 2**10, 2**20, 2**30 bytes) and say so: memory comes in
powers of two (a "16 GB" Mac has 16 GiB of RAM, the macOS wired-limit sysctl counts MiB,
mx.get_peak_memory counts bytes), and a size next to the RAM it must fit in has to be in the
RAM's unit. Bandwidth stays decimal (GB/s = 10**9 bytes per second), the unit in which Apple
publishes its chips' memory bandwidth and llama-bench reports throughput; it is always written
"GB/s", never next to a size. Parameter counts are plain decimal counts (K, M, B).
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
GB = 10**9  # bandwidth only (GB/s)

_SIZE_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_COUNT_UNITS = (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3))


def _three_figures(v: float) -> str:
    """8.84, 19.5, 221: about three significant figures, no exponent."""
    if v < 10:
        return f"{v:.2f}"
    if v < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"


def size(n: float | None) -> str:
    """Bytes in the largest IEC unit that keeps the number >= 1: '8.84 MiB', '56.0 GiB'."""
    if n is None:
        return "n/a"
    for unit, div in _SIZE_UNITS:
        if abs(n) >= div:
            return f"{_three_figures(n / div)} {unit}"
    return f"{int(n)} B"


def count(n: float) -> str:
    """A parameter (or token) count with a decimal suffix: '16.6M', '34.7B', '512'."""
    for unit, div in _COUNT_UNITS:
        if abs(n) >= div:
            return f"{_three_figures(n / div)}{unit}"
    return str(int(n))


def gbps(nbytes: float, seconds: float) -> float:
    """Bytes moved in `seconds` as GB/s (decimal)."""
    return nbytes / seconds / GB


def bandwidth(gb_per_s: float | None) -> str:
    """A memory bandwidth: '120.5 GB/s' (decimal gigabytes per second)."""
    if gb_per_s is None:
        return "n/a"
    return f"{gb_per_s:.2f} GB/s" if gb_per_s < 100 else f"{gb_per_s:.1f} GB/s"


_PARSE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}


def parse_size(text: str) -> int:
    """'5GB', '800MB', '5GiB', '1.5 GB' or a plain byte count -> bytes. Decimal units are
    powers of ten (as disks and model cards count), the IEC ones powers of two. ValueError
    (naming the accepted forms) for anything else or a size that is not positive."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _PARSE_UNITS:
        raise ValueError(f"{text!r} is not a size: use bytes (8400000) or a number with a unit "
                         "(800MB, 5GB, 5GiB)")
    n = int(float(m.group(1)) * _PARSE_UNITS[unit])
    if n <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    return n
