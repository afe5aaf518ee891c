#!/usr/bin/env python
"""Where a prefill chunk's time goes on the CPU: time per part of the model for T tokens at once.

Each part (a Gated DeltaNet mixer, its projections alone, its recurrence alone, a full-attention
mixer and its projections, a MoE block, its routed and shared experts, the lm_head) is built for
a T-token chunk on an empty cache and evaluated on its own, best of a few runs; times are for one
layer, then scaled by how many layers of that kind the model has.

    python scripts/profile_prefill.py [--synthetic pocket-35b-e128] [--tokens 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from pocket_mlx.convert import synthetic
from pocket_mlx.engine.loader import load
from pocket_mlx.models.fusion import project


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="pocket-35b-e128")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model, _ = load(str(synthetic.build(args.synthetic)), device="cpu", dtype="float32")
    tm = model.language_model.model
    lin = [m for m in tm.layers if m.is_linear]
    att = [m for m in tm.layers if not m.is_linear]
    T = args.tokens
    h0 = mx.random.normal((1, T, tm.norm.weight.shape[0]))
    mx.eval(h0)
    total = 0.0

    def run(name: str, f, count: int, add: bool = False) -> None:
        nonlocal total
        mx.eval(f(h0))
        best = cpu = float("inf")
        for _ in range(args.runs):
            t, c = time.perf_counter(), time.process_time()
            mx.eval(f(h0))
            best = min(best, time.perf_counter() - t)
            cpu = min(cpu, time.process_time() - c)
        if add:
            total += best * count
        # CPU time (all threads) next to wall time: on a shared machine the wall time includes
        # waiting for a core.
        print(f"{name:32s} {1e3 * best:9.2f} ms (cpu {1e3 * cpu:8.2f} ms) x{count:3d} = "
              f"{best * count:7.2f} s", flush=True)

    la, sa, moe = lin[0].linear_attn, att[0].self_attn, lin[0].mlp

    def lin_matmuls(h):
        qkv, z, b, g = project(la, h, *la.FUSED)
        return la.out_proj(qkv[..., :la.value_dim] * z) + b.sum() + g.sum()

    def att_matmuls(h):
        q, k, v = project(sa, h, *sa.FUSED)
        return sa.o_proj(q[..., :sa.n_heads * sa.head_dim]) + k.sum() + v.sum()

    def routed(h):
        inds = mx.argpartition(moe.gate(h), kth=-moe.top_k, axis=-1)[..., -moe.top_k:]
        return moe.switch_mlp(h, inds).sum(-2)

    print(f"T = {T} tokens; model: {len(lin)} linear-attention, {len(att)} full-attention layers")
    run("linear-attention mixer", lambda h: la(h, None), len(lin), True)
    run("  its projections only", lin_matmuls, len(lin))
    run("full-attention mixer", lambda h: sa(h, None), len(att), True)
    run("  its projections only", att_matmuls, len(att))
    run("MoE block", lambda h: moe(h), len(tm.layers), True)
    run("  routed experts only", routed, len(tm.layers))
    run("  shared expert only", lambda h: moe.shared_expert(h), len(tm.layers))
    run("norms x2", lambda h: lin[0].post_attention_layernorm(lin[0].input_layernorm(h)),
        len(tm.layers), True)
    run("lm_head (last token)", lambda h: model.language_model.lm_head(h[:, -1:]), 1, True)
    print(f"sum of parts: {total:.2f} s for {T} tokens = {T / total:.2f} tok/s")


if __name__ == "__main__":
    main()
