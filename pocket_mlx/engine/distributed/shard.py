"""This rank's share of the model, decided here and cut by the model itself.

pipeline: ranges of layers cut so each rank's share of the weight bytes is proportional to its
RAM (equal machines: equal bytes), or the ranges a checkpoint split by `pocket-mlx shard` was
written for; `Model.pipeline` keeps them. experts: an even block of every layer's routed experts
per rank; `Model.shard_experts` keeps it. Both run on the still-lazy model (the loader's `shard`
hook), so what a rank does not hold is never read. Then: every rank takes rank 0's token
(`attach`), and `rank_report` measures what each rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx.engine.distributed.group import DistributedError, Group
from pocket_mlx.models.accounting import module_costs, param_bytes
from pocket_mlx.models.parallel import pipeline_ranges, split_evenly
from pocket_mlx.system.host import total_ram_bytes


def setup_pipeline(model, g: Group) -> None:
    """Decide this rank's layers and have the model keep only them (before anything is
    evaluated: the others are never read)."""
    lm = model.language_model
    m = lm.model
    layers = m.layers
    tail = param_bytes(m.norm) + param_bytes(lm.get("lm_head"))
    head = param_bytes(m.embed_tokens)
    rank = getattr(model, "rank_shard", None)
    if rank is not None:  # per-rank shards: the ranges they were written for (rank_shards.py)
        ranges = [tuple(r) for r in rank["layers_all"]]
        if len(ranges) != g.size or ranges[-1][0] != 0 or ranges[0][1] != len(layers):
            raise DistributedError(f"rank {g.rank}: the shards' layer ranges {ranges} do not "
                                   f"fit {g.size} ranks and {len(layers)} layers; write them "
                                   "again")
    else:
        shares = [row[0] for row in g.gather_floats([float(total_ram_bytes() or 1)])]
        ranges = pipeline_ranges([param_bytes(la) for la in layers], head, tail, shares)
    model.pipeline(g.group, ranges)
    g.info = {"layers": [list(r) for r in ranges]}


def setup_experts(model, g: Group) -> None:
    """Check that this rank can hold an even block of every layer's routed experts (and that a
    per-rank shard holds that block), then have the model keep it."""
    E = model.args.num_experts
    if E < g.size:
        raise DistributedError(f"experts mode over {g.size} ranks needs at least {g.size} "
                               f"experts per layer; the model has {E}")
    lo, hi = split_evenly(E, g.size, g.rank)
    rank = getattr(model, "rank_shard", None)  # per-rank shards: only [lo, hi) were loaded
    if rank is not None and list(rank["experts"]) != [lo, hi]:
        raise DistributedError(f"rank {g.rank}: its shard holds experts {rank['experts']}, "
                               f"this run gives it [{lo}, {hi}); write the shards again")
    model.shard_experts(g.group, loaded=rank is not None)
    g.info = {"experts": [list(split_evenly(E, g.size, r)) for r in range(g.size)],
              "shared_expert": "layer i on rank i mod ranks"}


@dataclass
class Sharder:
    """The loader hook (`load(..., shard=...)`) that cuts a lazily built model down to this
    rank's share before any weight is read. The loader also reads `group` (mode, rank, size)
    to pick this rank's folder of a checkpoint split by `pocket-mlx shard`."""

    group: Group

    def __call__(self, model: nn.Module) -> None:
        setup = setup_pipeline if self.group.mode == "pipeline" else setup_experts
        setup(model, self.group)


def shard_for(g: Group) -> Sharder:
    return Sharder(g)


def attach(model, g: Group) -> None:
    """Generation takes rank 0's token on every rank (`generate_step` looks for
    `share_token`)."""
    object.__setattr__(model, "share_token", g.share_token)
    object.__setattr__(model, "dist", g)


def rank_bytes_per_token(model) -> int:
    """Weight bytes this rank reads per decoded token: `module_costs` with the routed experts
    counted as top_k x (held / all) of them, and shared experts only in the layers this rank
    computes them for (experts mode); only the layers held (pipeline)."""
    total = 0
    for c in module_costs(model):
        if ".shared_expert." in c.path + "." or c.path.endswith(".shared_expert_gate"):
            layer = int(c.path.split(".layers.")[1].split(".")[0])
            mlp = model.layers[layer].mlp
            ep = mlp.ep
            if ep is not None and not ep.shared and not c.path.endswith("shared_expert_gate"):
                continue
        total += c.bytes_per_token
    return total


def rank_report(model, g: Group) -> dict:
    """What each rank holds, measured from its loaded arrays, gathered on every rank."""
    mine = [float(param_bytes(model)), float(rank_bytes_per_token(model)),
            float(mx.get_active_memory()), float(getattr(model, "checkpoint_bytes", 0))]
    rows = g.gather_floats(mine)
    return {
        "mode": g.mode, "ranks": g.size, **g.info,
        "rank_weight_bytes": [int(r[0]) for r in rows],
        "rank_bytes_per_token": [int(r[1]) for r in rows],
        "rank_active_memory_bytes": [int(r[2]) for r in rows],
        # The safetensors files each rank mapped: the whole checkpoint, or its own shard.
        "rank_checkpoint_bytes": [int(r[3]) for r in rows],
    }
