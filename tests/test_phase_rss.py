"""scripts/phase_rss.py: a command's peak RSS attributed to the phase of its latest progress
line, its output passed through, its exit status kept."""

import subprocess
import sys

from conftest import ROOT

CHILD = """
import time
print("calibrate: 1/2 layer (50%), 1 s", flush=True)
a = bytearray(50_000_000); time.sleep(0.6)
print("search logits: 1/1 window (100%), 1 s", flush=True)
b = bytearray(250_000_000); time.sleep(0.6)
del a, b
c = b"x" * 600_000_000; del c  # a spike too short for the 0.2 s sampling: only VmHWM sees it
time.sleep(0.3)
raise SystemExit(3)
"""


def test_peaks_per_phase_and_the_exit_status(tmp_path):
    log = tmp_path / "log"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "phase_rss.py"), "--log", str(log),
                        "--", "timeout", "50", sys.executable, "-c", CHILD],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    rows = {line.rsplit(None, 2)[0].strip(): float(line.split()[-2])
            for line in r.stdout.splitlines()
            if line.startswith("  ") and line.endswith(" GB") and "whole" not in line}
    assert "calibrate: 1/2" in r.stdout and set(rows) == {"start", "calibrate", "search logits"}
    assert 0.05 <= rows["calibrate"] < 0.25 <= rows["search logits"]  # 50 MB, then 300 MB held
    # The whole run's figure is the converter's own VmHWM, not its wrapper's (`timeout` here).
    whole = next(line for line in r.stdout.splitlines() if "whole run" in line)
    assert float(whole.split()[2]) >= 0.6
    assert "whole run" in log.read_text()
