#!/usr/bin/env python
"""Micro benchmark: pocket-mlx CPU quantized kernels vs MLX's own CPU ops. Without --table this
is `pocket-mlx bench kernels` (pocket_mlx/analysis/kernel_bench.py), run from here as before.

Reports GB/s of quantized weights (packed words + scales + biases actually read) for
  - decode MoE matvec of the POCKET-35B shape: 8 of 128 experts, gate/up K=2048 -> N=512 and
    down K=512 -> N=2048, 2-bit, group 64, bf16 scales (float32 activations),
  - a 4-bit 2048x4096 matvec (K=2048 -> N=4096, g64),
  - a prefill-size matmul (M=512) on the 4-bit 2048x4096 weight and a prefill MoE (sorted),
  - 1-bit vs 2-bit decode (same weights quantized both ways, interleaved, best of each): the
    MoE gate/up and down matvecs and a 2048->4096 matvec; the ratio is the 1-bit speed-up.
Usage: python scripts/bench_kernels.py [--threads N] [--mode exact|fast] [--quick] [--only-1bit]

`--table` instead runs the kernel table (scripts/kernel_table.py; docs/BENCHMARKS.md names the
latest run): GB/s of weights per core for every real shape of the 35B model (2-bit experts,
4-bit attention and shared expert, 6-bit lm_head), B = 1, 2, 4, 8, one and two threads, hot and
from DRAM, a one-thread read probe beside it, and llama.cpp's `test-backend-ops perf` at the
same sizes (from the anchor build, --llamacpp; `none` skips it). It writes the JSON (--out) and
prints the table:
    python scripts/bench_kernels.py --table [--mode fast] [--llamacpp ~/.cache/llamacpp-anchor]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mlx.core as mx

from pocket_mlx import kernels
from pocket_mlx.analysis import kernel_bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--mode", default=None, help="exact (default) or fast (--table's default: "
                    "the mode the model runs in)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-1bit", action="store_true", help="only the 1-bit vs 2-bit section")
    ap.add_argument("--table", action="store_true",
                    help="the per-shape kernel table (see the docstring)")
    ap.add_argument("--out", default=None,
                    help="--table's JSON (default: "
                         "docs/bench-log/bench-kernels-table-<variant>.json)")
    ap.add_argument("--llamacpp", default="~/.cache/llamacpp-anchor",
                    help="--table: the llama.cpp anchor (src/ and build/bin/), or none")
    ap.add_argument("--only", default=None, help="--table: shapes whose name contains this")
    ap.add_argument("--part", choices=["all", "ours", "llamacpp"], default="all",
                    help="--table: run one side only and merge it into the JSON --out already "
                         "holds (two shorter runs under the machine lock)")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    if args.table:
        args.mode = args.mode or "fast"
        table(args)
        return
    kernel_bench.run(threads=args.threads or None, mode=args.mode or "exact", quick=args.quick,
                     only_1bit=args.only_1bit, say=lambda s: print(s, flush=True))


def table(args) -> None:
    """--table: ours (and llama.cpp's) per shape, B and thread count; JSON written, then the
    markdown printed."""
    import kernel_table as kt  # scripts/ (this script's folder is on sys.path)

    if not kernels.enabled():
        raise SystemExit("the CPU kernels are not active: nothing to measure")
    kernels.set_mode(args.mode)
    info = kt.machine()
    print("machine:", json.dumps(info), flush=True)
    shapes = [s for s in kt.SHAPES if not args.only or args.only in s.name]
    out = Path(args.out or Path(__file__).resolve().parents[1] / "docs" / "bench-log" /
               f"bench-kernels-table-{info['kernels'].get('variant', 'none')}.json")
    old = json.loads(out.read_text()) if args.part != "all" and out.is_file() else {}
    ours, theirs, exe = old.get("ours", []), old.get("llamacpp", []), old.get("llamacpp_binary")
    if args.part in ("all", "ours"):
        ours = []
        for s in shapes:
            ours += kt.measure_shape(s, min_time=0.15 if args.quick else 0.3)
    if args.llamacpp != "none" and args.part in ("all", "llamacpp"):
        anchor = Path(args.llamacpp).expanduser()
        exe = kt.build_llamacpp_perf(anchor, Path.home() / ".cache" / "pocket-mlx" / "llamacpp-perf")
        theirs = [r for r in kt.llamacpp_rows(exe) if any(s.name == r["shape"] for s in shapes)]
    info["load_average_after"] = os.getloadavg()
    runs = old.get("runs", []) + [{"part": args.part, "load_average_before":
                                   info["load_average_before"], "load_average_after":
                                   info["load_average_after"], "utc": time.strftime(
                                       "%Y-%m-%d %H:%M:%S", time.gmtime())}]
    doc = {"machine": info, "runs": runs, "mode": args.mode, "command": "python scripts/bench_kernels.py --table "
           f"--mode {args.mode}", "llamacpp_binary": str(exe) if exe else None,
           "ours": ours, "llamacpp": theirs}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}\n")
    print(kt.markdown(ours, theirs))


if __name__ == "__main__":
    main()
