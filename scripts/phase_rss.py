"""Run a command and report its peak resident memory per phase, the phase being the name before
the colon of its latest progress line (`calibrate: 3/40 layer ...`, `search logits: ...`).

    python scripts/phase_rss.py [--log FILE] -- pocket-mlx convert SRC OUT ...

Why: /usr/bin/time -v gives one peak for the whole run; to bring a peak down one has to know
which phase holds it. RSS is read from /proc/PID/status every 0.2 s (Linux only), for the
process and its children; a phase shorter than that may be missed, the overall VmHWM is not.
A phase's figure is the RSS seen while it ran, which can include memory an earlier phase freed
but the allocator had not yet given back: the highest phase is where to look, not a ledger.
The command's output is passed through (and to --log).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

PHASE = re.compile(r"^([a-z][a-z +_-]*?): (\d+/\d+|\d+ )")


def _rss_kb(pid: int, key: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            out += _tree(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command given")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    phase, peaks, order = "start", {}, ["start"]
    hwm = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal hwm
        while not done.is_set():
            tree = _tree(proc.pid)
            rss = sum(_rss_kb(p) for p in tree)
            peaks[phase] = max(peaks.get(phase, 0), rss)
            # Each process's own high-water mark: the command is often a wrapper (`timeout`)
            # whose child is the one that peaks.
            hwm = max(hwm, *(_rss_kb(p, "VmHWM") for p in tree))
            time.sleep(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    log = a.log.open("a") if a.log else None
    for line in proc.stdout:
        sys.stdout.write(line)
        if log:
            log.write(line)
            log.flush()
        m = PHASE.match(line)
        if m and m.group(1) != phase:
            phase = m.group(1)
            if phase not in order:
                order.append(phase)
    rc = proc.wait()
    done.set()
    t.join()
    rows = [f"  {p:<16} {peaks.get(p, 0) * 1024 / 1e9:6.2f} GB" for p in order if p in peaks]
    report = "peak RSS per phase (sampled, GB = 10^9 bytes):\n" + "\n".join(rows) + (
        f"\n  {'whole run':<16} {max([hwm, *peaks.values()]) * 1024 / 1e9:6.2f} GB (VmHWM)\n")
    sys.stdout.write(report)
    if log:
        log.write(report)
        log.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
