#!/usr/bin/env python
"""One quantized matrix streamed from DRAM: GB/s of weights per call, MLX layout vs panels.

Why: in a decode step the mid-size projections and the experts stream below what one long
matrix (lm_head) reaches; this isolates one shape, one call per copy over >= 1.5 GB of copies
(so every call reads from DRAM), through `kernels.ops.quantized_matmul` as the model calls it.

    python scripts/bench_matrix_stream.py N K BITS [--rows B] [--layout rows|panels]
    python scripts/bench_matrix_stream.py 12288 2048 4 --layout panels
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pocket_mlx import kernels  # noqa: E402
from pocket_mlx.kernels import ops  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("N", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("bits", type=int)
    ap.add_argument("--rows", type=int, default=1, help="activation rows per call (B)")
    ap.add_argument("--layout", choices=("rows", "panels"), default="rows")
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    gs = a.group_size
    nbytes = a.N * a.K * a.bits / 8 + 2 * a.N * (a.K // gs) * 2  # codes + bf16 scales, biases
    copies = max(2, int(1.5e9 // nbytes))
    mats = []
    for _ in range(copies):
        q = mx.quantize(mx.random.normal((a.N, a.K)).astype(mx.bfloat16), group_size=gs,
                        bits=a.bits)
        mx.eval(q)
        if a.layout == "panels" and kernels.pack_matrix(*q, bits=a.bits, group_size=gs) == 0:
            print("no panel kernels for these bits on this CPU", file=sys.stderr)
            return 2
        mats.append(q)
    x = mx.random.normal((a.rows, a.K))
    mx.eval(x)

    def run() -> None:
        mx.eval([ops.quantized_matmul(x, *q, group_size=gs, bits=a.bits) for q in mats])

    run()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - t) / copies)
    print(f"N={a.N} K={a.K} bits={a.bits} B={a.rows} {a.layout} ({kernels.label()}): "
          f"{best * 1e6:.0f} us/call, {nbytes / best / 1e9:.1f} GB/s of weights, {copies} copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
