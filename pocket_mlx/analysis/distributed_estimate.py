"""Before buying a second Mac: per-rank memory and a decode estimate for `--distributed`.

`pocket-mlx info --ranks N --link thunderbolt5|10gbe|1gbe` (and scripts/bench_distributed.py's
projection) use this. The model: batch-1 decode is bound by reading weights, so a rank's compute
time per token is its bytes read per token / its memory bandwidth; to that come the collectives
of engine/distributed/, each costing the link's latency per ring step plus its bytes over the
link's bandwidth. It is a ceiling-style estimate (no kernel overheads, no overlap), to compare
layouts and links, not a promise.

The link figures are ASSUMPTIONS, typical values, not measurements of any particular setup:
- Thunderbolt 5: 80 Gb/s per direction (Intel/Apple spec; 120 Gb/s with Bandwidth Boost). IP
  over the Thunderbolt bridge (what MLX's ring backend uses) reaches a fraction of that: we
  assume 50 Gb/s usable and ~40 us per message one way (TCP stack on both ends). MLX's JACCL
  backend (RDMA over Thunderbolt 5, recent macOS) should do better than this on latency.
- 10 Gigabit Ethernet (Mac mini's optional 10GbE): 10 Gb/s, ~9.4 Gb/s usable TCP, ~60 us per
  message one way through a switch.
- Gigabit Ethernet: 1 Gb/s, ~0.94 Gb/s usable, ~150 us per message one way.
An all_sum over N ranks (ring) takes 2 (N - 1) steps, each sending 1/N of the message.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from pocket_mlx.errors import PocketError
from pocket_mlx.models.accounting import module_costs


@dataclass(frozen=True)
class Link:
    name: str
    nominal_gbit: float  # the standard's line rate, Gb/s
    usable_gbit: float  # assumed TCP throughput, Gb/s
    latency_us: float  # assumed one-way latency per message, microseconds

    @property
    def bytes_per_s(self) -> float:
        return self.usable_gbit * 1e9 / 8


LINKS = {
    "thunderbolt5": Link("Thunderbolt 5", 80.0, 50.0, 40.0),
    "10gbe": Link("10 Gigabit Ethernet", 10.0, 9.4, 60.0),
    "1gbe": Link("Gigabit Ethernet", 1.0, 0.94, 150.0),
}

# The Mac mini (M4) the issue plans for: 120 GB/s unified memory (Apple's published figure).
M4_BANDWIDTH_GBPS = 120.0


def link(name: str) -> Link:
    if name not in LINKS:
        raise PocketError(f"unknown --link {name!r}: use one of {', '.join(LINKS)}")
    return LINKS[name]


@dataclass
class Split:
    """A model's bytes by what the distributed modes do with them (from `module_costs`)."""

    total: int  # all weight bytes
    experts: int  # routed experts (split in experts mode)
    experts_per_token: int
    shared_per_token: int  # shared expert (computed by one rank per layer in experts mode)
    per_token: int  # all bytes read per token (one process)
    layers: int
    moe_layers: int
    hidden: int
    top_k: int
    num_experts: int


def split_of(model: nn.Module) -> Split:
    costs = module_costs(model)
    experts = [c for c in costs if ".switch_mlp." in c.path + "."]
    shared = [c for c in costs if ".shared_expert." in c.path + "."]
    args = model.args
    return Split(
        total=sum(c.bytes for c in costs),
        experts=sum(c.bytes for c in experts),
        experts_per_token=sum(c.bytes_per_token for c in experts),
        shared_per_token=sum(c.bytes_per_token for c in shared),
        per_token=sum(c.bytes_per_token for c in costs),
        layers=args.num_hidden_layers, moe_layers=args.num_hidden_layers,
        hidden=args.hidden_size, top_k=args.num_experts_per_tok, num_experts=args.num_experts)


def all_sum_s(nbytes: float, ranks: int, lk: Link) -> float:
    """Seconds for one ring all_sum of `nbytes` over `ranks` ranks."""
    steps = 2 * (ranks - 1)
    return steps * (lk.latency_us * 1e-6 + nbytes / ranks / lk.bytes_per_s)


def estimate(s: Split, ranks: int, lk: Link, bandwidth_gbps: float,
             act_bytes: int = 4, efficiency: float = 1.0) -> dict:
    """Per-rank memory, bytes per token, collectives per token and tok/s for one process and
    both modes over `ranks` machines of `bandwidth_gbps` each joined by `lk`. `act_bytes`: the
    activations' element size (4 on the CPU, 2 for bf16 on the GPU). `efficiency`: the share
    of the memory bandwidth decode achieves (1: the roofline; mlx-lm on Metal reaches ~0.4)."""
    if ranks < 2:
        raise PocketError(f"--ranks must be 2 or more, got {ranks}")
    bw = bandwidth_gbps * 1e9 * efficiency
    one = s.per_token / bw
    # experts: dense replicated, routed experts split, the shared expert on one rank per layer.
    # (+ the all-zero expert each rank adds, models/parallel.py)
    ex_mem = s.total - s.experts + s.experts / ranks + s.experts / s.num_experts
    ex_read = s.per_token - s.experts_per_token * (1 - 1 / ranks) \
        - s.shared_per_token * (1 - 1 / ranks)
    part = (s.top_k + 1) * s.hidden * act_bytes  # the exact per-slot all_sum's message
    ex_colls = s.moe_layers + 1  # + the sampled token from rank 0
    ex_comm = s.moe_layers * all_sum_s(part, ranks, lk) + all_sum_s(4, ranks, lk)
    ex_t = ex_read / bw + ex_comm
    # pipeline: one rank at a time; a hidden state per boundary, then the token.
    pp_comm = (ranks - 1) * (lk.latency_us * 1e-6 + s.hidden * act_bytes / lk.bytes_per_s) \
        + all_sum_s(4, ranks, lk)
    pp_t = one + pp_comm
    # Not implemented, for comparison: experts split AND every dense matrix sharded too
    # (tensor parallel). Each rank then reads ~1/N of everything, but each layer needs ~3 more
    # collectives (mixer in / out projections, shared expert) of D values, plus one for lm_head.
    tp_read = s.per_token / ranks
    tp_colls = 4 * s.moe_layers + 2
    tp_comm = (s.moe_layers * all_sum_s(part, ranks, lk)
               + 3 * s.moe_layers * all_sum_s(s.hidden * act_bytes, ranks, lk)
               + all_sum_s(4, ranks, lk) + all_sum_s(4 * 1024, ranks, lk))
    tp_t = tp_read / bw + tp_comm
    return {
        "ranks": ranks, "link": lk.name, "link_nominal_gbit": lk.nominal_gbit,
        "link_usable_gbit": lk.usable_gbit, "link_latency_us": lk.latency_us,
        "bandwidth_gbps": bandwidth_gbps, "efficiency": efficiency,
        "one_process": {"memory_bytes": s.total, "bytes_per_token": s.per_token,
                        "decode_tps": 1 / one},
        "pipeline": {"memory_bytes_per_rank": s.total / ranks,
                     "bytes_per_token_per_rank": s.per_token / ranks,
                     "collectives_per_token": ranks,  # N - 1 sends + the token's all_sum
                     "comm_ms_per_token": pp_comm * 1e3, "decode_tps": 1 / pp_t},
        "experts": {"memory_bytes_per_rank": ex_mem, "bytes_per_token_per_rank": ex_read,
                    "collectives_per_token": ex_colls, "bytes_per_collective": part,
                    "comm_ms_per_token": ex_comm * 1e3, "decode_tps": 1 / ex_t},
        "experts_sharded_dense": {"implemented": False, "bytes_per_token_per_rank": tp_read,
                                  "collectives_per_token": tp_colls,
                                  "comm_ms_per_token": tp_comm * 1e3, "decode_tps": 1 / tp_t},
    }


def format_text(e: dict) -> list[str]:
    """`info`'s lines for an estimate."""
    from pocket_mlx.units import size

    pp, ex, one = e["pipeline"], e["experts"], e["one_process"]
    tp = e["experts_sharded_dense"]
    return [
        f"distributed      {e['ranks']} ranks over {e['link']} (assumed {e['link_usable_gbit']:g} "
        f"of {e['link_nominal_gbit']:g} Gb/s usable, {e['link_latency_us']:g} us per message), "
        f"{e['bandwidth_gbps']:g} GB/s memory per rank ({e['bandwidth_source']})",
        f"  one process    {size(one['memory_bytes'])}, {size(one['bytes_per_token'])}/token, "
        f"~{one['decode_tps']:.1f} tok/s",
        f"  pipeline       {size(pp['memory_bytes_per_rank'])} per rank, "
        f"{pp['collectives_per_token']} messages/token ({pp['comm_ms_per_token']:.2f} ms), "
        f"~{pp['decode_tps']:.1f} tok/s (one rank works at a time)",
        f"  experts        {size(ex['memory_bytes_per_rank'])} per rank, "
        f"{size(ex['bytes_per_token_per_rank'])}/token per rank, "
        f"{ex['collectives_per_token']} all_sums/token of {size(ex['bytes_per_collective'])} "
        f"({ex['comm_ms_per_token']:.2f} ms), ~{ex['decode_tps']:.1f} tok/s",
        f"  (not built)    experts + dense parts sharded too: "
        f"{size(tp['bytes_per_token_per_rank'])}/token per rank, "
        f"{tp['collectives_per_token']} collectives/token ({tp['comm_ms_per_token']:.2f} ms), "
        f"~{tp['decode_tps']:.1f} tok/s",
        "  (estimate: weights read at full memory bandwidth plus the link's assumed latency "
        "and bandwidth; see docs/DISTRIBUTED.md)",
    ]
