"""The model's own surgery for a distributed run: keep this rank's layers, or its experts.

Why in models/: cutting a model down and the forward pass that then runs are the model's
business (mlx-lm's `PipelineMixin` and `Model.shard` are the same idea), so the engine asks
(`Model.pipeline(group, ranges)`, `Model.shard_experts(group)`) instead of swapping classes
under the model. The engine (engine/distributed/) owns the group, decides the ranges and
checks per-rank shards; `group` here is MLX's `mx.distributed.Group`.

- pipeline (`PipelineMixin`, on LanguageModel): rank r runs layers [lo, hi) (the last layers,
  the final norm and lm_head on rank 0; the first layers and the embedding on the last rank),
  receiving the hidden state from rank r + 1 and sending it to rank r - 1. Layers cut away are
  never read: the model is still lazy when it is cut.
- experts (`ExpertParallelMixin`, on SparseMoeBlock): rank r holds a contiguous block of every
  layer's routed experts plus one all-zero expert; routing runs as in one process, each rank
  computes its experts' *unweighted per-slot* outputs (a slot is nonzero on exactly one rank,
  and x + 0 == x exactly), one `all_sum` gathers them, and every rank then runs the
  one-process combine on identical inputs: the result is bit-identical to one process. The
  shared expert of layer i is computed by rank i mod N only and rides in the same all_sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx.errors import PocketError
from pocket_mlx.kernels import ops
from pocket_mlx.models.layers import combine_experts


def split_evenly(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of `parts` contiguous ranges of range(n), sizes differing by at most 1."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


def pipeline_ranges(layer_bytes: list[int], head_bytes: int, tail_bytes: int,
                    shares: list[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per rank, in rank order; rank 0 runs the last layers (and
    holds `tail_bytes`: norm + lm_head), the last rank the first ones (with `head_bytes`: the
    embedding). The rule: walk the layers from the first, and cut where the bytes so far pass
    each rank's cumulative share of all bytes (`shares`, e.g. each rank's RAM), leaving every
    rank at least one layer."""
    n, size = len(layer_bytes), len(shares)
    if n < size:
        raise PocketError(f"pipeline over {size} ranks needs at least {size} layers; the model "
                          f"has {n}")
    total = head_bytes + sum(layer_bytes) + tail_bytes
    order = list(range(size - 1, -1, -1))  # ranks from the first layers to the last
    weight = sum(shares)
    cuts, acc, start = [], head_bytes, 0
    for pos, r in enumerate(order[:-1]):
        target = total * sum(shares[q] for q in order[:pos + 1]) / weight
        end, last = start, n - (size - 1 - pos)  # later ranks keep one layer each at least
        while end < last:
            nxt = acc + layer_bytes[end]
            if end > start and abs(nxt - target) >= abs(acc - target):
                break
            acc, end = nxt, end + 1
        cuts.append((r, start, end))
        start = end
    cuts.append((order[-1], start, n))
    ranges = [(0, 0)] * size
    for r, lo, hi in cuts:
        ranges[r] = (lo, hi)
    return ranges


# ---- pipeline -----------------------------------------------------------------------------------
class RemoteLayer(nn.Module):
    """A layer another rank runs: no weights here, only what `make_cache` asks of a layer."""

    def __init__(self, is_linear: bool):
        super().__init__()
        self.is_linear = is_linear

    def __call__(self, x, cache=None):
        raise RuntimeError("this layer runs on another rank")


@dataclass
class PipelineShare:
    """What `PipelineMixin.pipeline` kept: this rank's layers [lo, hi) and how to reach the
    others (the dtype of the hidden state it receives)."""

    group: mx.distributed.Group
    rank: int
    size: int
    lo: int
    hi: int
    in_dtype: mx.Dtype


def layer_input_dtypes(text_model: nn.Module) -> list[mx.Dtype]:
    """The dtype of the hidden state entering each layer (and, last, leaving the last one),
    traced lazily (a graph only, nothing is read or computed): what each rank receives."""
    h = text_model.embed_tokens(mx.zeros((1, 1), mx.uint32))
    out = []
    for layer in text_model.layers:
        out.append(h.dtype)
        h = layer(h, None)
    out.append(h.dtype)
    return out


class PipelineMixin:
    """For the language model (`self.model`: embed_tokens, layers, norm; `lm_head`, `args`):
    after `pipeline`, its forward runs this rank's layers only (`pipeline_call`)."""

    pipe: PipelineShare | None = None

    def pipeline(self, group: mx.distributed.Group, ranges: list[tuple[int, int]]) -> None:
        """Keep layers `ranges[rank]` (one contiguous range per rank, in rank order, rank 0 with
        the last layers) and what their ends need; call it before anything is evaluated, so
        the rest is never read."""
        rank, size = group.rank(), group.size()
        m = self.model
        lo, hi = ranges[rank]
        in_dtype = layer_input_dtypes(m)[lo]
        for i, layer in enumerate(m.layers):
            if not lo <= i < hi:
                m.layers[i] = RemoteLayer(layer.is_linear)
        if rank != size - 1 and not (rank == 0 and self.args.tie_word_embeddings):
            m.pop("embed_tokens")
        if rank != 0:
            m.pop("norm")
            if "lm_head" in self:
                self.pop("lm_head")
        self.pipe = PipelineShare(group, rank, size, lo, hi, in_dtype)

    def pipeline_call(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        """Receive the hidden state from the rank before (the last rank embeds instead), run
        this rank's layers, send it on (rank 0 applies the final norm and lm_head instead).
        Other ranks return placeholder logits that depend on the send, so evaluating a step
        (or the cache) performs it."""
        pipe = self.pipe
        m = self.model
        cache = cache or [None] * len(m.layers)
        B, L = inputs.shape[:2]
        if pipe.rank == pipe.size - 1:
            h = m.embed_tokens(inputs)
        else:
            h = mx.distributed.recv((B, L, self.args.hidden_size), pipe.in_dtype, pipe.rank + 1,
                                    group=pipe.group)
        for i in range(pipe.lo, pipe.hi):
            h = m.layers[i](h, cache[i])
        if pipe.rank == 0:
            h = m.norm(h)
            if self.args.tie_word_embeddings:
                return m.embed_tokens.as_linear(h)
            return self.lm_head(h)
        sent = mx.distributed.send(h, pipe.rank - 1, group=pipe.group)
        # Prefill evaluates only the cache: make this rank's last cache depend on the send.
        c = cache[pipe.hi - 1]
        if c is not None:
            for name in ("keys", "state"):
                if isinstance(getattr(c, name, None), mx.array):
                    setattr(c, name, mx.depends(getattr(c, name), sent))
                    break
        # Full-width (broadcast, never materialized) so any sampler runs on it unchanged.
        return mx.broadcast_to(mx.depends(mx.zeros((1, 1, 1), h.dtype), sent),
                               (B, L, self.args.vocab_size))


# ---- expert parallel ----------------------------------------------------------------------------
@dataclass
class ExpertShare:
    """What `ExpertParallelMixin.shard_experts` kept: experts [lo, hi) of the layer's routed
    experts, and whether this rank computes the layer's shared expert."""

    group: mx.distributed.Group
    lo: int
    hi: int
    shared: bool
    views: list | None = None  # the held experts' (weight, scales, biases) without the zero one


class ExpertParallelMixin:
    """For the MoE block (`gate`, `switch_mlp`, `shared_expert`, `shared_expert_gate`): after
    `shard_experts`, its forward computes only the held experts (`expert_parallel_call`)."""

    ep: ExpertShare | None = None

    def shard_experts(self, group: mx.distributed.Group, lo: int, hi: int, shared: bool,
                      loaded: bool = False) -> None:
        """Keep routed experts [lo, hi) of all of them, plus one all-zero expert that other
        ranks' slots are sent to on the MLX-ops path (copies: a slice of a mapped tensor would
        keep the whole tensor alive once evaluated). `loaded`: the weights hold only [lo, hi)
        already (a per-rank shard). `shared`: this rank computes the shared expert."""
        total = self.gate.weight.shape[0]  # the router scores every expert
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sw = self.switch_mlp[proj]
            for name in ("weight", "scales", "biases"):
                if name in sw:
                    a = sw[name]
                    held = a if loaded else a[lo:hi]
                    sw[name] = mx.concatenate([held, mx.zeros((1, *a.shape[1:]), a.dtype)])
            sw.experts_global = total  # what accounting divides top_k by
        self.ep = ExpertShare(group, lo, hi, shared)

    def expert_parallel_call(self, x: mx.array) -> mx.array:
        """Routing as in one process, this rank's experts' outputs, one all_sum, then the
        one-process combine (exact; see the module's docstring)."""
        ep = self.ep
        if self.observer is None and x.size <= self.FUSED_MAX_TOKENS * x.shape[-1]:
            mats = self._quantized_mats()
            if mats:
                # The extension takes the held experts without the zero one (views, made once).
                if ep.views is None:
                    ep.views = [tuple(a[: ep.hi - ep.lo] for a in m[:3]) for m in mats[-3:]]
                mats = mats[:-3] + [(*v, *m[3:]) for v, m in zip(ep.views, mats[-3:])]
            got = (ops.moe_block_parts(x, mats, self.top_k, self.norm_topk_prob, ep.lo,
                                       ep.shared) if mats else None)
            if got is not None:
                parts, scores = got
                return ops.moe_combine(mx.distributed.all_sum(parts, group=ep.group), scores)
        inds, scores = ops.moe_route(self.gate(x), self.top_k, self.norm_topk_prob)
        here = (inds >= ep.lo) & (inds < ep.hi)
        # Slots of other ranks' experts go to the zero expert: the held experts then see exactly
        # the rows they see in one process (the kernels' results depend on how rows group).
        local = mx.where(here, inds - ep.lo, ep.hi - ep.lo).astype(inds.dtype)
        experts = self.switch_mlp(x, local)
        experts = mx.where(here[..., None], experts, mx.zeros((), experts.dtype))
        if ep.shared:
            shared = self.shared_expert(x)
        else:
            shared = mx.zeros((*x.shape[:-1], experts.shape[-1]), experts.dtype)
        both = mx.distributed.all_sum(
            mx.concatenate([experts, shared[..., None, :].astype(experts.dtype)], axis=-2),
            group=ep.group)
        experts, shared = both[..., :-1, :], both[..., -1, :].astype(shared.dtype)
        return combine_experts(experts, scores, self.shared_expert_gate(x), shared)
