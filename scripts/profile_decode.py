#!/usr/bin/env python
"""Where one decode step's time goes on the CPU: graph nodes per step and time per part.

Each part (the 30 linear-attention mixers, their projections alone, the 10 full-attention mixers,
the 40 MoE blocks, their routed experts and shared experts, the norms, the lm_head, the whole
step) is built for one token on a warm cache and evaluated on its own, best of a few runs. Parts
are synchronised separately, so they do not add up exactly to the pipelined step.

    python scripts/profile_decode.py [--synthetic pocket-35b-e128] [--runs 5] [--unfused]
                                     [--depth 16384] [--cache-type f16]

`--depth N`: the step at N tokens of context (agents decode at 10-30k), the full-attention
layers' caches filled with N random positions (no prefill: a step's work does not depend on what
the positions hold); the full-attention mixers' share of the step is printed at the end.
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import time

import mlx.core as mx

from pocket_mlx.convert import synthetic
from pocket_mlx.engine.loader import load
from pocket_mlx.models.cache import KVCache
from pocket_mlx.models.fusion import project


def fill_depth(cache: list, depth: int, room: int = 512) -> None:
    """Each KV cache holding `depth` random positions (in its storage type), with `room` more."""
    for c in cache:
        if type(c) is not KVCache or c.keys is None:
            continue
        b, h, _, d = c.keys.shape
        size = (depth + room + c.step - 1) // c.step * c.step
        c.keys, c.values = (mx.random.normal((b, h, size, d)).astype(c.keys.dtype)
                            for _ in range(2))
        c.offset = depth
        mx.eval(c.keys, c.values)


def graph_nodes(y: mx.array) -> collections.Counter:
    f = io.StringIO()
    mx.export_to_dot(f, y)
    return collections.Counter(re.findall(r'label ="([A-Za-z]+)', f.getvalue()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="pocket-35b-e128")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--unfused", action="store_true",
                    help="keep every projection a matmul of its own (as before fusion)")
    ap.add_argument("--depth", type=int, default=0, help="tokens of context (default 0)")
    ap.add_argument("--cache-type", choices=["f32", "f16", "bf16"], default="f32",
                    help="the KV cache's storage type (default f32)")
    args = ap.parse_args()
    model, _ = load(str(synthetic.build(args.synthetic)), device="cpu", dtype="float32",
                    fuse=not args.unfused)
    model.set_cache_type(args.cache_type)
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    if args.depth:
        fill_depth(cache, args.depth, room=40 * (args.runs + 1))
    tm = model.language_model.model
    layers = list(zip(tm.layers, cache))
    lin = [(m, c) for m, c in layers if m.is_linear]
    att = [(m, c) for m, c in layers if not m.is_linear]
    h0 = mx.random.normal((1, 1, tm.norm.weight.shape[0]))
    mx.eval(h0)

    nodes = graph_nodes(model(mx.array([[5]]), cache=cache))
    print(f"graph nodes per decode step: {sum(nodes.values())}")
    print("  " + ", ".join(f"{k} {v}" for k, v in nodes.most_common(12)))

    def run(name: str, f) -> None:
        mx.eval(f(h0))
        best = float("inf")
        for _ in range(args.runs):
            t = time.perf_counter()
            mx.eval(f(h0))
            best = min(best, time.perf_counter() - t)
        print(f"{name:34s} {1e3 * best:8.2f} ms", flush=True)
        return best

    def chain(fn, group):
        def f(h):
            for m, c in group:
                h = h + fn(m, c, h)
            return h
        return f

    def lin_matmuls(m, c, h):
        a = m.linear_attn
        qkv, z, b, g = project(a, h, *a.FUSED)
        return a.out_proj(qkv[..., :a.value_dim] * z) + b.sum() + g.sum()

    def att_matmuls(m, c, h):
        a = m.self_attn
        q, k, v = project(a, h, *a.FUSED)
        return a.o_proj(q[..., :a.n_heads * a.head_dim]) + k.sum() + v.sum()

    def routed(m, c, h):
        inds = mx.argpartition(m.mlp.gate(h), kth=-m.mlp.top_k, axis=-1)[..., -m.mlp.top_k:]
        return m.mlp.switch_mlp(h, inds).sum(-2)

    run(f"linear-attention mixers x{len(lin)}", chain(lambda m, c, h: m.linear_attn(h, c), lin))
    run("  their projections only", chain(lin_matmuls, lin))
    t_att = run(f"full-attention mixers x{len(att)}",
                chain(lambda m, c, h: m.self_attn(h, c), att))
    run("  their projections only", chain(att_matmuls, att))
    run(f"MoE blocks x{len(layers)}", chain(lambda m, c, h: m.mlp(h), layers))
    run("  routed experts only", chain(routed, layers))
    run("  shared experts only", chain(lambda m, c, h: m.mlp.shared_expert(h), layers))
    run(f"norms x{2 * len(layers)}", chain(
        lambda m, c, h: m.post_attention_layernorm(m.input_layernorm(h)), layers))
    run("lm_head", lambda h: model.language_model.lm_head(h))
    t_step = run("whole step (one token)", lambda h: model(mx.array([[5]]), cache=cache))
    print(f"full-attention share of the step at depth {args.depth} ({args.cache_type} cache): "
          f"{100 * t_att / t_step:.1f}%")


if __name__ == "__main__":
    main()
