"""`bench --parallel`: the tg test with B sequences decoded together, and what the bytes allow.

Why: a decode step reads the weights once for all B sequences (models/batched.py), so B
sequences can go up to B times faster than one, but not all bytes are shared: each token reads
its own routed experts (B x top-k of E, fewer when tokens pick the same ones) and each sequence
its own Gated DeltaNet and KV state. `bytes_bound_x` = B x bytes(one sequence's step) /
bytes(the B-sequence step) is the speed-up a bandwidth-bound machine would give, counted with
the routing of the run itself; the measured aggregate tok/s is compared with it.

The run is the server's path: engine/batch.py's `BatchDecoder` (greedy, pipelined as `serve`
decodes), each sequence after a 4-token random prompt, timed over `n` steps of all B together
(as llama.cpp's batched-bench times its TG). The routing is recorded over a few more steps of
the same sequences, untimed (observing the router takes the MoE block off its fused node).
scripts/bench_batch_step.py uses the same byte accounting.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from pocket_mlx.models.cache import LinearAttentionCache

ROUTE_STEPS = 8  # untimed steps whose routing gives the distinct experts per step


@dataclass
class WeightSplit:
    """The model's weight bytes as a decode step reads them."""

    dense: float  # every weight but the routed experts and the embedding: read once per step
    embed_row: float  # one embedding row (each token reads its own)
    per_expert: list[float]  # per MoE layer, one routed expert's gate+up+down bytes
    top_k: int


def weight_split(model) -> WeightSplit:
    """Bytes of the loaded arrays (as they run: --dtype counts), split as a step reads them."""
    E = model.args.num_experts
    expert = [0] * len(model.layers)
    dense = embed = 0
    for name, a in tree_flatten(model.parameters()):
        m = re.search(r"layers\.(\d+)\.", name)
        if m and ".switch_mlp." in name:
            expert[int(m.group(1))] += a.nbytes
        elif "embed_tokens" in name:
            embed += a.nbytes
        else:
            dense += a.nbytes
    return WeightSplit(float(dense), embed / model.args.vocab_size, [b / E for b in expert],
                       int(model.args.num_experts_per_tok))


def distinct_experts(got: Sequence[Sequence[np.ndarray]], b: int) -> list[float]:
    """Per layer, the mean count of distinct experts a step of `b` tokens routes to; `got` is
    RouteRecorder.got (per layer, one [tokens, k] array per forward). Forwards of another
    size (a prefill, a smaller batch) are left out."""
    out = []
    for per_forward in got:
        counts = [len(np.unique(g)) for g in per_forward if g.shape[0] == b]
        out.append(float(np.mean(counts)) if counts else float("nan"))
    return out


def state_bytes(caches: Sequence[Sequence], batch=None) -> float:
    """Bytes of per-sequence state a step moves for these sequences' caches: Gated DeltaNet
    conv and delta-rule state read and written, the KV cache read. States a `DecodeBatch`
    holds stacked (its members' own entries are empty then) are counted from `batch`."""
    total = 0.0
    for cache in caches:
        for c in cache:
            if isinstance(c, LinearAttentionCache):
                if c.state is not None:
                    total += 2 * (c.state.nbytes + c.conv_state.nbytes)
            elif getattr(c, "keys", None) is not None:
                total += (c.keys[..., :c.offset, :].nbytes + c.values[..., :c.offset, :].nbytes)
    if batch is not None:
        for li in batch.linear:
            if batch.state[li] is not None:
                total += 2 * (batch.state[li].nbytes + batch.conv[li].nbytes)
    return total


def step_bytes(split: WeightSplit, distinct: Sequence[float], b: int, state: float) -> dict:
    """Bytes one step of `b` sequences moves: the parts and their total."""
    experts = float(sum(d * e for d, e in zip(distinct, split.per_expert)))
    dense = split.dense + b * split.embed_row
    return {"dense_weights": dense, "routed_experts": experts,
            "distinct_experts_per_layer": float(np.mean(distinct)), "state": state,
            "total": dense + experts + state}


def bound_x(split: WeightSplit, distinct: Sequence[float], b: int, state: float) -> float:
    """B x bytes(one sequence's step) / bytes(the B-sequence step). One sequence reads top-k
    experts per layer and a B-th of the B sequences' state (they are the same length)."""
    one = step_bytes(split, [split.top_k] * len(distinct), 1, state / b)["total"]
    return b * one / step_bytes(split, distinct, b, state)["total"]


@dataclass
class ParallelRun:
    tps: float  # aggregate: tokens of all B sequences per second
    distinct: list[float]  # per layer, distinct experts per step
    state: float  # bytes of per-sequence state a step moves (all B)


def run_parallel(model, device: str, vocab: int, b: int, n: int, seed: int,
                 route_steps: int = ROUTE_STEPS) -> ParallelRun:
    """Decode `n` steps of `b` sequences together (after their prompts and first tokens,
    untimed), then `route_steps` more with their routing recorded."""
    from pocket_mlx.analysis.bench import TG_PROMPT, NullTokenizer, random_ids
    from pocket_mlx.analysis.routing import RouteRecorder
    from pocket_mlx.engine import devices
    from pocket_mlx.engine.batch import BatchDecoder, Token
    from pocket_mlx.engine.generation import SamplingParams
    from pocket_mlx.engine.prompt_cache import NoPromptCache

    stream = devices.stream_for(device)
    dec = BatchDecoder(model, NullTokenizer(), stream=stream, store=NoPromptCache())
    cap = n + route_steps + 2 * b + 8  # the first ones decode while the others prefill
    uids = [dec.insert(random_ids(vocab, TG_PROMPT, seed + i), cache=model.make_cache(),
                       n_cached=0, sampling=SamplingParams(), max_tokens=cap, room=cap)
            for i in range(b)]

    def settle() -> None:
        mx.eval([s.unread for s in dec.decoding])

    while dec.prefilling:
        dec.step()
    dec.step()  # the first step of all b: nothing of the prompts is left in flight
    settle()
    if dec.batch_size != b:
        raise RuntimeError(f"the batch decoded {dec.batch_size} sequences, not {b}")
    # Step i queues forward i and reads forward i-1's tokens: n steps and a settle compute n
    # forwards (the one read first finished before t0), and read as many tokens.
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(n):
        tokens += sum(isinstance(e, Token) for e in dec.step())
    settle()
    dt = time.perf_counter() - t0
    state = state_bytes([s.cache for s in dec.decoding], dec.batch)
    with RouteRecorder(model) as rec:
        for _ in range(route_steps):
            dec.step()
        settle()
    dec.remove(uids)
    if tokens != b * n:
        raise RuntimeError(f"{tokens} tokens in {n} steps of {b} sequences")
    return ParallelRun(tokens / dt, distinct_experts(rec.got, b), state)


def parallel_rows(model, device: str, *, widths: Sequence[int], n: int, repeats: int,
                  meta: dict, log=lambda s: None, probe=None) -> list:
    """One `bench` row per B: runs interleaved over B (a slow minute of a shared machine hits
    every width), the read bandwidth probed around each run as run_tests does."""
    from statistics import fmean

    from pocket_mlx import units
    from pocket_mlx.analysis.bench import WARMUP_TG, Row, mean_sd

    vocab = model.args.vocab_size
    split = weight_split(model)
    for b in widths:
        log(f"warm-up pocket-mlx x{b}")
        run_parallel(model, device, vocab, b, min(n, WARMUP_TG), 1, route_steps=1)
    runs: dict[int, list[ParallelRun]] = {b: [] for b in widths}
    bws: dict[int, list[float]] = {b: [] for b in widths}
    for i in range(repeats):
        for b in widths:
            before = probe() if probe else 0.0
            r = run_parallel(model, device, vocab, b, n, 200 + 100 * i)
            runs[b].append(r)
            note = ""
            if probe:
                bws[b].append((before + probe()) / 2)
                note = f" (read bandwidth around it: {bws[b][-1]:.1f} GB/s)"
            log(f"tg{n} x{b} run {i + 1}/{repeats}: {r.tps:.3f} tok/s aggregate{note}")
    rows = []
    for b in widths:
        tps = [r.tps for r in runs[b]]
        m, sd = mean_sd(tps)
        distinct = [fmean(r.distinct[li] for r in runs[b]) for li in range(len(split.per_expert))]
        state = fmean(r.state for r in runs[b])
        moved = step_bytes(split, distinct, b, state)
        per_token = moved["total"] / b
        frac = (fmean(per_token * t / units.GB / bw for t, bw in zip(tps, bws[b]))
                if bws[b] else None)
        rows.append(Row(**{**meta, "bytes_per_token": round(per_token)}, test=f"tg{n}",
                        tps_mean=m, tps_sd=sd, gbps=per_token * m / units.GB,
                        roofline_fraction=frac, runs=tps, bandwidth_runs=bws[b] or None,
                        parallel=b, bytes_bound_x=bound_x(split, distinct, b, state),
                        distinct_experts_per_layer=moved["distinct_experts_per_layer"],
                        step_bytes=round(moved["total"])))
    one = next((r for r in rows if r.parallel == 1), None)
    for r in rows:
        if one is not None and one.tps_mean:
            r.speedup_x = r.tps_mean / one.tps_mean
            r.vs_bound = r.speedup_x / r.bytes_bound_x
    return rows
