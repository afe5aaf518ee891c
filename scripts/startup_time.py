#!/usr/bin/env python
"""Wall time of a short generation as a user runs it: `pocket-mlx generate` vs `mlx_lm.generate`.

Each command is a fresh process (imports, model load, 16 tokens, exit), on the bundled model,
run REPEATS times (default 5) after one unmeasured warm-up (page cache), the two interleaved
so a busy machine hurts both alike. Prints both medians; exit 1 when pocket-mlx's median is not
below --target seconds (default 1.0; 0 = no check).

    python scripts/startup_time.py [--repeats 5] [--json] [--target 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "pocket-tiny"
ARGS = ["--prompt", "hi", "--max-tokens", "16"]


def command(script: str, module: list[str]) -> list[str]:
    """The console script beside this Python (what a user types), else `python -m`."""
    exe = Path(sys.executable).parent / script
    found = str(exe) if exe.is_file() else shutil.which(script)
    return [found] if found else [sys.executable, "-m", *module]


def wall(cmd: list[str]) -> float:
    """Seconds from start to exit; RuntimeError (its last stderr line) when it fails."""
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    dt = time.perf_counter() - t
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {tail}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--target", type=float, default=1.0,
                    help="pocket-mlx median must be below this many seconds (0 = no check)")
    ap.add_argument("--no-mlx-lm", action="store_true", help="time pocket-mlx only")
    args = ap.parse_args()
    runs = {"pocket-mlx": command("pocket-mlx", ["pocket_mlx"]) + ["generate", *ARGS]}
    if not args.no_mlx_lm:
        runs["mlx-lm"] = (command("mlx_lm.generate", ["mlx_lm", "generate"])
                          + ["--model", str(MODEL), *ARGS])
    failed: dict[str, str] = {}
    for name, cmd in list(runs.items()):
        try:
            wall(cmd)  # warm-up: page cache, .pyc files
        except RuntimeError as e:
            if name == "pocket-mlx":
                raise SystemExit(str(e)) from None
            failed[name] = str(e)  # stock mlx-lm cannot run this model: say so, time ours
            del runs[name]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, cmd in runs.items():
            times[name].append(wall(cmd))
    medians = {name: statistics.median(t) for name, t in times.items()}
    ok = not args.target or medians["pocket-mlx"] < args.target
    if args.json:
        print(json.dumps({"model": str(MODEL.relative_to(ROOT)), "args": ARGS,
                          "repeats": args.repeats, "median_s": medians,
                          "runs_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
                          "target_s": args.target, "ok": ok, "failed": failed,
                          "load_average": os.getloadavg()}))
    else:
        for name, m in medians.items():
            print(f"{name:10s} median {m:.3f} s over {args.repeats} runs "
                  f"({', '.join(f'{x:.2f}' for x in times[name])})")
        for name, why in failed.items():
            print(f"{name:10s} did not run: {why}")
        if args.target:
            print(f"pocket-mlx below {args.target:g} s: {'yes' if ok else 'NO'} "
                  f"(load average {os.getloadavg()[0]:.1f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
