"""Memory bandwidth of Apple-silicon chips, for the decode ceiling (bandwidth / bytes per token).

Figures are Apple's published unified-memory bandwidth in GB/s (10^9 bytes/s), from the Apple
Newsroom launch announcements and the Mac "Tech Specs" pages (support.apple.com/specs):
M1 Pro/Max (Oct 2021), M1 Ultra (Mar 2022), M2 (Jun 2022), M2 Pro/Max (Jan 2023), M2 Ultra
(Jun 2023), M3 family (Oct 2023), M4 (May 2024), M4 Pro/Max (Oct 2024), M3 Ultra (Mar 2025),
M5 (Oct 2025). Apple gave no number for the base M1; 68.25 GB/s is its LPDDR4X-4266 x 128-bit
interface (Apple's "M1 Pro: up to 200GB/s, nearly 3x M1" agrees).
The M3 Max and M4 Max come in two bins with different memory buses: the 14-core CPU (10
performance cores) has the lower figure, the 16-core (12 performance cores) the higher.
"""

from __future__ import annotations

import re

from pocket_mlx.system.host import Platform, get_platform

# chip -> GB/s; "Max" entries with two bins are (lower bin, upper bin).
BANDWIDTH_GBPS: dict[str, float | tuple[float, float]] = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": (300, 400), "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": (410, 546),
    "M5": 153,
}
_CHIP = re.compile(r"\bApple (M\d+)(?: (Pro|Max|Ultra))?\b")


def parse_chip(brand: str) -> str | None:
    """'Apple M3 Pro' -> 'M3 Pro'; None for anything else."""
    m = _CHIP.search(brand or "")
    if not m:
        return None
    return m.group(1) + (f" {m.group(2)}" if m.group(2) else "")


def chip_bandwidth(chip: str, performance_cores: int | None = None) -> float | None:
    """Published GB/s of a chip; for two-bin Max chips the core count picks the bin (the
    lower one when unknown, so the ceiling is never overstated)."""
    value = BANDWIDTH_GBPS.get(chip)
    if isinstance(value, tuple):
        return value[1] if performance_cores and performance_cores >= 12 else value[0]
    return float(value) if value is not None else None


def detect(platform: Platform | None = None) -> tuple[str, float] | None:
    """(chip, GB/s) of this Mac, via `sysctl -n machdep.cpu.brand_string`; None elsewhere."""
    platform = platform or get_platform()
    if not platform.is_macos():
        return None
    chip = parse_chip(platform.sysctl_read("machdep.cpu.brand_string") or "")
    if chip is None:
        return None
    cores = platform.sysctl_read("hw.perflevel0.physicalcpu")
    bw = chip_bandwidth(chip, int(cores) if cores and cores.isdigit() else None)
    return (chip, bw) if bw else None
