#!/usr/bin/env python
"""Run the standard benchmark set and write its report (docs/bench-log/bench-report-DATE.md).

docs/BENCHMARKS.md is the hand-kept reference page (the latest figure per machine, with its
command and date); a report this writes goes into the log beside the others.

The set: synthetic `tiny` and `pocket-35b-e128` (pocket-2bit recipe), pp and tg, ours against
stock mlx-lm (interleaved), on the CPU, and on the GPU where MLX has one. Each configuration runs
`pocket-mlx bench ... -o json` in its own process (a fresh process per model keeps RAM at one
model). The 35B sizes default to what a slow CPU finishes in ~25 minutes; say so in the doc.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pocket_mlx import kernels, units  # noqa: E402
from pocket_mlx.analysis import bench  # noqa: E402
from pocket_mlx.engine import devices  # noqa: E402


def run_bench(args: list[str], env: dict[str, str]) -> tuple[dict, str, float]:
    cmd = ["pocket-mlx", "bench", *args, "--vs-mlx-lm", "--bandwidth", "-o", "json"]
    shown = " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(cmd)
    print("$", shown, file=sys.stderr, flush=True)
    t = time.time()
    proc = subprocess.run([sys.executable, "-m", "pocket_mlx", *cmd[1:]], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, check=True,
                          env={**os.environ, **env})
    return json.loads(proc.stdout), shown, time.time() - t


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench-log" /
                                         f"bench-report-{time.strftime('%Y-%m-%d')}.md"))
    ap.add_argument("--tiny", default="-p 512 -n 128 -r 3", help="bench flags for tiny")
    ap.add_argument("--big", default="-p 512 -n 128 -r 1",
                    help="bench flags for pocket-35b-e128 on the CPU (the standard pp512/tg128 "
                         "takes ~32 min here, mostly stock mlx-lm; -p 32 -n 16 for a quick look)")
    ap.add_argument("--big-gpu", default="-p 512 -n 128 -r 3",
                    help="bench flags for pocket-35b-e128 on the GPU")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--note", default="", help="extra paragraph for the doc")
    a = ap.parse_args()

    plan: list[tuple[list[str], dict[str, str]]] = [
        (["--synthetic", "tiny", *a.tiny.split(), "--device", "cpu"], {})]
    if kernels.info()["active"]:
        # Our engine on MLX's own kernels too: separates engine from kernel effects.
        plan.append((plan[0][0], {"POCKET_MLX_KERNELS": "0"}))
    if not a.skip_big:
        plan.append((["--synthetic", "pocket-35b-e128", *a.big.split(), "--device", "cpu"], {}))
    if devices.gpu_available():
        plan.append((["--synthetic", "tiny", *a.tiny.split(), "--device", "gpu"], {}))
        if not a.skip_big:
            plan.append((["--synthetic", "pocket-35b-e128", *a.big_gpu.split(), "--device",
                          "gpu"], {}))

    started = time.strftime("%Y-%m-%d %H:%M %Z")
    loads = [load_avg()]
    rows, commands, machine = [], [], None
    for args, env in plan:
        data, cmd, secs = run_bench(args, env)
        machine = machine or data["machine"]
        rows += [bench.Row(**r) for r in data["rows"]]
        commands.append(f"{cmd}   # {secs / 60:.1f} min, bandwidth probe "
                        f"{data['machine']['bandwidth_gbps']} GB/s")
        loads.append(load_avg())

    m = machine
    ram = units.size(m.get("ram_bytes"))
    doc = f"""# Benchmarks

Measured {started} with `scripts/bench_report.py`. Regenerate: `python scripts/bench_report.py`.

Machine: {m['cpu']}, {m['cores']} cores, {ram} RAM, {m['os']}; GPU: {m['gpu']};
mlx {m['mlx']}, mlx-lm {m['mlx_lm']}; quantized-matmul kernels: {m['kernels']}.

{bench.format_markdown(rows)}

How to read it (llama-bench semantics): `ppP` prefills P random tokens into an empty cache;
`tgN` decodes N tokens after a 4-token prompt, timed from the first decoded token; t/s is the mean
± standard deviation over `-r` runs after a warm-up (pp8 and tg2). Ours and stock mlx-lm run
interleaved (ours, theirs, ours, ...) in one process on the very same weight arrays (mlx-lm's
own module tree and `generate_step`; its arrays are swapped for ours after its loader validated
the checkpoint). bytes/token is the weight bytes read per decoded token as held in memory
(all dense modules, top-k/E of the experts, one embedding row); GB/s = bytes/token x t/s;
roofline = that over this machine's memory read bandwidth, measured in-process (numpy max over
1 GB, threads as in the table, best of 7). pp rows have no bandwidth figures: prefill reads the
weights once per batch, not once per token. On the CPU the synthetic models run in float32
(`--dtype auto`): MLX's bf16 arithmetic is 5-40x slower on x86.

Commands:

```
{chr(10).join(commands)}
```

The 35B-shaped model (`pocket-35b-e128`: 40 layers, 128 experts, top-8, vocab 248320, experts
2-bit g64, router 8-bit, embeddings/lm_head 6-bit, the rest 4-bit; random weights) ran on the
CPU with `{a.big}` (stock mlx-lm, on MLX's scalar CPU quantized matmul, needs minutes for pp512
and seconds per decoded token here). Rows with kernels `mlx` ran with `POCKET_MLX_KERNELS=0` (our
engine on MLX's own quantized matmuls).

Noise: this is a shared 2-core machine; other processes may have been running
(load average at the start and after each configuration: {'; '.join(loads)}), so expect
10-30% run-to-run variation and read ratios rather than absolutes.
{a.note}
"""
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(doc)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
