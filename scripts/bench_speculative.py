"""Speculative decoding, measured (docs/SPECULATIVE.md). The tok/s tables (default and
--ordinary) are `pocket-mlx bench speculative [--ordinary]` (pocket_mlx/analysis/
speculative_bench.py), run from here as before; --verify-cost, a developer's measurement, is here.

Two measurements:

  tok/s (default): `generate`'s decode tok/s with --speculative off against lookup (K in
  --k) and auto (K = 3), runs interleaved, on a copy-heavy prompt (code to repeat with an edit), greedy; also
  checks each speculative reply is token-identical to off and reports drafted / accepted.

    python scripts/bench_speculative.py [--model PATH] [--k 2,3,4] [--reps 3] [-n 256]

  --ordinary: the same over three ordinary raw prompts (English verse, Chinese poem, Python),
  for the methods in --methods (default off, mtp K = 1, 2, 3, auto), summed over the three;
  adds the MTP drafter's acceptance per depth (draft d kept, of the passes that drafted d)
  and the share of decode time spent in its head (drafting) against the rest (verify passes).

    python scripts/bench_speculative.py --ordinary [--methods off,mtp:1,mtp:2,mtp:3,auto:3]

  --verify-cost: the time of one verify pass of L = k + 1 rows against one one-token decode
  step (k = 1..--max-k), on any model (the 35B shape: --model synthetic:pocket-35b-e128, run
  under `flock /work/wt/heavy.lock`), with the experts the L tokens route to (distinct per
  layer) and the weight bytes that implies against one step's.

    python scripts/bench_speculative.py --verify-cost --model synthetic:pocket-35b-e128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pocket_mlx import kernels  # noqa: E402
from pocket_mlx.analysis import speculative_bench as sb  # noqa: E402
from pocket_mlx.analysis.bench import cpu_model  # noqa: E402
from pocket_mlx.analysis.speculative_bench import CODE, ORDINARY, PROMPT  # noqa: E402, F401
from pocket_mlx.engine.loader import load, model_weight_stats  # noqa: E402
from pocket_mlx.models.verify import commit, verify_forward  # noqa: E402


def _distinct_experts(model, cache, rows: mx.array) -> float:
    """Mean over MoE layers of the distinct experts `rows` route to (observer hook)."""
    seen: list[int] = []
    for layer in model.layers:
        layer.mlp.observer = lambda x, inds, *_: seen.append(len(set(inds.flatten().tolist())))
    try:
        logits, _, tape = verify_forward(model, rows, cache)
        mx.eval(logits)
        commit(cache, tape, 1)
    finally:
        for layer in model.layers:
            layer.mlp.observer = None
    return statistics.fmean(seen)


def verify_cost(args, model, tok) -> None:
    ids = tok.encode(CODE) if tok is not None else list(range(1, 200))
    ids = [i % model.args.vocab_size for i in ids][: args.context]
    cache = model.make_cache()
    model(mx.array(ids[:-1])[None], cache=cache)
    mx.eval([a for c in cache for a in c.arrays])
    ws = model_weight_stats(model)
    sw = model.layers[0].mlp.switch_mlp
    per_expert = (
        sum(
            v.nbytes
            for p in (sw.gate_proj, sw.up_proj, sw.down_proj)
            for v in p.parameters().values()
        )
        // model.args.num_experts
    )
    n_layers = len(model.layers)
    dense = ws.bytes_per_token - n_layers * model.args.num_experts_per_tok * per_expert

    def snapshot():
        return [
            (c.offset, getattr(c, "conv_state", None), c.state)
            if hasattr(c, "conv_state")
            else (c.offset,)
            for c in cache
        ]

    def restore(snap) -> None:
        for c, s in zip(cache, snap):
            if len(s) == 3:
                c.offset, c.conv_state, c.state = s
            else:
                c.trim(c.offset - s[0])

    def pass_time(L: int) -> float:
        rows = mx.array([ids[(i * 7) % len(ids)] for i in range(L)], mx.uint32)
        snap = snapshot()
        t = time.perf_counter()
        if L == 1:  # the plain decode step
            mx.eval(model(rows[None], cache=cache))
        else:
            logits, _, tape = verify_forward(model, rows, cache)
            mx.eval(logits)
            commit(cache, tape, 1)
        t = time.perf_counter() - t
        restore(snap)
        return t

    # Rounds over every L in turn (the step and each pass size), so that a burst of load on a
    # shared machine hits them alike; median and minimum over the rounds.
    Ls = list(range(1, args.max_k + 2))
    for L in Ls:
        pass_time(L)
    times: dict[int, list[float]] = {L: [] for L in Ls}
    for _ in range(args.reps):
        for L in Ls:
            times[L].append(pass_time(L))
    one, one_min = statistics.median(times[1]), min(times[1])
    print(
        f"model {args.model}, CPU {cpu_model()}, kernels {kernels.label()}, median and minimum "
        f"of {args.reps} interleaved rounds, load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        f"one-token decode step: {1e3 * one:.1f} ms (min {1e3 * one_min:.1f}); weights read per "
        f"token {ws.bytes_per_token / 1e9:.3f} GB\n"
    )
    print(
        "| k | rows | verify pass ms | vs one step | min ms | min vs min | "
        "distinct experts/layer | weight bytes vs one step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for L in Ls[1:]:
        t, t_min = statistics.median(times[L]), min(times[L])
        rows = mx.array([ids[(i * 7) % len(ids)] for i in range(L)], mx.uint32)
        snap = snapshot()
        e = _distinct_experts(model, cache, rows)
        restore(snap)
        bytes_ratio = (dense + n_layers * e * per_expert) / ws.bytes_per_token
        print(
            f"| {L - 1} | {L} | {1e3 * t:.1f} | {t / one:.2f}x | {1e3 * t_min:.1f} | "
            f"{t_min / one_min:.2f}x | {e:.1f} | {bytes_ratio:.2f}x |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/pocket-tiny")
    ap.add_argument("--k", default="2,3,4", help="draft lengths for lookup (tok/s mode)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", type=int, default=256, help="tokens per reply (tok/s mode)")
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--ordinary", action="store_true",
                    help="three ordinary prompts (en, zh, code), methods from --methods")
    ap.add_argument("--methods", default="off,mtp:1,mtp:2,mtp:3,auto:3",
                    help="METHOD[:K],... for --ordinary (the first is the baseline)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens (verify-cost)")
    args = ap.parse_args()
    model, tok = load(args.model, device="cpu", fuse=True)
    if args.verify_cost:
        verify_cost(args, model, tok)
    elif args.ordinary:
        sb.ordinary_table(model, tok, name=args.model, methods=sb.parse_methods(args.methods),
                          reps=args.reps, n=args.n)
    else:
        sb.tps_table(model, tok, name=args.model, ks=[int(x) for x in args.k.split(",")],
                     reps=args.reps, n=args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
