"""Time the Gated DeltaNet state update of one decode token (ops.gated_delta), 30 layers.

Each layer's state ([B, Hv, Dv, Dk] float32, 2 MiB a sequence with the 35B shape's heads) is read
and written once a token; this times that update alone, the states out of cache (a 256 MiB buffer
is touched between rounds), and reports GB/s of state read plus written. Compare with a plain
read-and-stream copy of the same bytes to see whether the update is bound by memory.

    python scripts/bench_state_update.py [--batch 1] [--layers 30] [--rounds 15]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from pocket_mlx.kernels import ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1, help="sequences (B)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    B, L = args.batch, args.layers
    Hk, Hv, Dk, Dv = 16, 32, 128, 128  # Qwen3.5-35B-A3B's linear-attention heads
    states = [mx.random.normal((B, Hv, Dv, Dk)) * 0.1 for _ in range(L)]
    q, k = mx.random.normal((B, 1, Hk, Dk)), mx.random.normal((B, 1, Hk, Dk))
    v = mx.random.normal((B, 1, Hv, Dv))
    g, beta = mx.random.uniform(shape=(B, 1, Hv)), mx.random.uniform(shape=(B, 1, Hv))
    junk = mx.zeros((64 << 20,))
    mx.eval(states, q, k, v, g, beta, junk)
    best = float("inf")
    for _ in range(args.rounds):
        mx.eval(junk + 1)  # push the states out of the caches
        t = time.perf_counter()
        outs = [ops.gated_delta(q, k, v, g, beta, s)[1] for s in states]
        mx.eval(outs)
        best = min(best, time.perf_counter() - t)
        states = outs
    moved = 2 * B * L * Hv * Dv * Dk * 4
    print(f"B={B}, {L} layers: best {best * 1e3:.2f} ms a token, "
          f"{moved / best / 1e9:.1f} GB/s of state read + written")


if __name__ == "__main__":
    main()
