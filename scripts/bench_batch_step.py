#!/usr/bin/env python
"""Where a batched decode step's time goes (models/batched.py, the server's continuous batching).

In one process on one loaded model: the time of a whole `DecodeBatch.step` of B = 1, 2, 4
sequences (each after a short prompt), and of its parts run alone on the real weights, B rows
each: the dense quantized matmuls of a Gated DeltaNet layer and of a full-attention layer
(projections), the sparse MoE block (router, shared expert, the B tokens' routed experts: one
extension node), the Gated DeltaNet core, the per-sequence attention, and the lm_head; parts are
multiplied by their layer counts. Best of --repeats, interleaved over B so a slow phase of a
shared machine hits every width. What batching can win: the dense parts read their weights once
per step, the routed experts of B tokens are mostly different experts (B x top-k of E).

    python scripts/bench_batch_step.py [--model synthetic:pocket-35b-e128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocket_mlx import kernels  # noqa: E402 - after the path above
from pocket_mlx.analysis import parallel  # noqa: E402
from pocket_mlx.analysis.routing import RouteRecorder  # noqa: E402
from pocket_mlx.engine.loader import load, resolve_model_path  # noqa: E402
from pocket_mlx.models.batched import DecodeBatch, attend  # noqa: E402
from pocket_mlx.models.fusion import project  # noqa: E402
from pocket_mlx.models.qwen3_5_moe import LinearAttentionCache  # noqa: E402

WIDTHS = (1, 2, 4)


class Seq:
    def __init__(self, model, prompt: list[int]) -> None:
        self.cache = model.make_cache()
        logits = model(mx.array(prompt)[None], cache=self.cache)[:, -1, :]
        self.token = mx.argmax(logits, axis=-1).astype(mx.uint32)
        mx.eval(self.token, [a for c in self.cache for a in c.arrays])


def best(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        out = min(out, time.perf_counter() - t)
    return out


def step_bytes(model, seqs: list[Seq], steps: int) -> dict[int, dict[str, float]]:
    """Bytes a decode step of B sequences must move, B = 1, 2, 4, on this checkpoint with its
    own routing: every non-expert weight once (plus B embedding rows), each layer's distinct
    routed experts among the B tokens' top-k (recorded over `steps` real batched steps), and
    per sequence its Gated DeltaNet state and conv state read and written and its KV cache
    read (the accounting of `bench --parallel`, analysis/parallel.py). The ratio
    B x bytes(1) / bytes(B) is what batching can give when a step of B runs at the same GB/s
    as a step of one: the bandwidth-bound ceiling of the speed-up."""
    split = parallel.weight_split(model)
    out = {}
    for b in WIDTHS:
        batch = DecodeBatch(model)
        members = batch.set_members(seqs[:b])
        t = mx.concatenate([s.token for s in members])
        with RouteRecorder(model) as rec:
            for _ in range(steps):
                t = mx.argmax(batch.step(t), axis=-1).astype(mx.uint32)
                mx.eval(t)
        batch.set_members([])
        distinct = parallel.distinct_experts(rec.got, b)
        out[b] = parallel.step_bytes(split, distinct, b,
                                     parallel.state_bytes([s.cache for s in seqs[:b]]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:pocket-35b-e128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per timed whole step")
    ap.add_argument("--bytes-steps", type=int, default=16,
                    help="batched steps whose routing gives the bytes per step (0: skip)")
    args = ap.parse_args()
    model, tok = load(str(resolve_model_path(args.model)), device="cpu", fuse=True)
    layers = model.layers
    lin = next(i for i, layer in enumerate(layers) if layer.is_linear)
    full = next(i for i, layer in enumerate(layers) if not layer.is_linear)
    n_lin = sum(layer.is_linear for layer in layers)
    n_full = len(layers) - n_lin
    H = model.args.hidden_size
    rows: dict[int, dict[str, float]] = {b: {} for b in WIDTHS}
    with mx.stream(mx.cpu):
        seqs = [Seq(model, tok.encode(f"Sequence number {i} starts here, and it goes on"))
                for i in range(max(WIDTHS))]
        for _ in range(args.repeats):
            for b in WIDTHS:
                r = rows[b]
                x = mx.random.normal((b, 1, H))
                mx.eval(x)
                # The whole step, `steps` of them back to back (each evaluated: no pipelining).
                batch = DecodeBatch(model)
                members = batch.set_members(seqs[:b])

                def whole(batch=batch, members=members):
                    t = mx.concatenate([s.token for s in members])
                    for _ in range(args.steps):
                        logits = batch.step(t)
                        t = mx.argmax(logits, axis=-1).astype(mx.uint32)
                        mx.eval(t)
                    return t

                r["step"] = min(r.get("step", 1e9), best(whole, 1) / args.steps)
                batch.set_members([])
                la, at, moe = layers[lin].linear_attn, layers[full].self_attn, layers[lin].mlp
                parts = {
                    "linear-attn projections": (n_lin, lambda la=la, x=x: [
                        *project(la, x, *la.FUSED), la.out_proj(
                            mx.zeros((x.shape[0], 1, la.value_dim)))]),
                    "attention projections": (n_full, lambda at=at, x=x: [
                        *project(at, x, *at.FUSED),
                        at.o_proj(mx.zeros((x.shape[0], 1, at.n_heads * at.head_dim)))]),
                    "MoE block": (len(layers), lambda moe=moe, x=x: moe(x)),
                    "lm_head": (1, lambda x=x: model.language_model.lm_head(x)),
                }
                for name, (count, fn) in parts.items():
                    r[name] = min(r.get(name, 1e9), count * best(fn, 1))

                def delta_core(la=la, x=x, b=b, seqs=seqs):
                    c = LinearAttentionCache()
                    c.conv_state = mx.concatenate([s.cache[lin].conv_state for s in seqs[:b]])
                    c.state = mx.concatenate([s.cache[lin].state for s in seqs[:b]])
                    qkv, z, bb, a = project(la, x, *la.FUSED)
                    mx.eval(qkv, z, bb, a, c.conv_state, c.state)
                    t = time.perf_counter()
                    out = la._decode_step(qkv, z, bb, a, c)
                    mx.eval(out)
                    return time.perf_counter() - t

                r["Gated DeltaNet core"] = min(r.get("Gated DeltaNet core", 1e9),
                                               n_lin * min(delta_core() for _ in range(2)))

                def attention_core(at=at, x=x, b=b, seqs=seqs):
                    # Projections included once more; subtracted below.
                    caches = [s.cache[full] for s in seqs[:b]]
                    offsets = [c.offset for c in caches]
                    t = time.perf_counter()
                    mx.eval(attend(at, x, caches))
                    dt = time.perf_counter() - t
                    for c, o in zip(caches, offsets):
                        c.trim(c.offset - o)
                    return dt

                r["attention (whole layer mixer)"] = min(
                    r.get("attention (whole layer mixer)", 1e9),
                    n_full * min(attention_core() for _ in range(2)))
        moved = step_bytes(model, seqs, args.bytes_steps) if args.bytes_steps else {}
    out = {"model": args.model, "kernels": kernels.info(), "layers": len(layers),
           "linear_layers": n_lin, "full_layers": n_full,
           "ms": {b: {k: round(v * 1e3, 2) for k, v in r.items()} for b, r in rows.items()},
           "bytes_per_step": {b: {k: round(v, 2) for k, v in r.items()}
                              for b, r in moved.items()}}
    print(json.dumps(out, indent=2))
    one = rows[1]["step"]
    print(f"\n{'part (x layers)':<34}" + "".join(f"{'B=' + str(b):>10}" for b in WIDTHS),
          file=sys.stderr)
    for k in rows[1]:
        print(f"{k:<34}" + "".join(f"{rows[b][k] * 1e3:>9.1f}m" for b in WIDTHS), file=sys.stderr)
    print(f"{'tokens/s (B / step)':<34}" + "".join(f"{b / rows[b]['step']:>10.2f}"
                                                 for b in WIDTHS), file=sys.stderr)
    print(f"{'vs B=1':<34}" + "".join(f"{b * one / rows[b]['step']:>9.2f}x" for b in WIDTHS),
          file=sys.stderr)
    if moved:
        print(f"\n{'bytes per step (MB)':<34}" + "".join(f"{'B=' + str(b):>10}" for b in WIDTHS),
              file=sys.stderr)
        for k in moved[1]:
            unit = 1 if k.startswith("distinct") else 1e6
            print(f"{k:<34}" + "".join(f"{moved[b][k] / unit:>10.1f}" for b in WIDTHS),
                  file=sys.stderr)
        print(f"{'ceiling at B=1 GB/s':<34}" + "".join(
            f"{b * moved[1]['total'] / moved[b]['total']:>9.2f}x" for b in WIDTHS),
            file=sys.stderr)
        print(f"{'GB/s of the timed whole step':<34}" + "".join(
            f"{moved[b]['total'] / rows[b]['step'] / 1e9:>10.1f}" for b in WIDTHS),
            file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
