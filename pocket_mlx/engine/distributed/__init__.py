"""One model across several processes (machines) with MLX's own distributed engine.

`pocket-mlx generate --distributed pipeline|experts`, started by `mlx.launch` (ring backend over
TCP: Thunderbolt or Ethernet; JACCL, MPI or NCCL where MLX has them): MLX's `mx.distributed`
carries every byte, no sockets of ours. Rank 0 does all I/O (reads the prompt, prints the reply);
the other ranks compute their share and print nothing.

- pipeline: each rank holds a contiguous range of layers (the last layers, the final norm and
  lm_head on rank 0, the first layers and the embedding on the last rank: as in mlx-lm, so the
  logits end up where the output is written). Ranges are cut so each rank's share of the
  weight bytes is proportional to its RAM (equal machines: equal bytes). Layers a rank does not
  run are never read from the safetensors files: `mx.load` maps them lazily and they are
  dropped before anything is evaluated. One send/recv of the hidden state per rank boundary.
  Memory per rank ~1/N; decode is not faster (one rank works at a time).
- experts: each rank holds 1/N of every layer's routed experts (a contiguous block of expert
  ids); everything else (attention, Gated DeltaNet, router, shared expert, embedding, lm_head)
  is replicated. Routing is computed identically on every rank; each rank computes only its
  experts' outputs and one `all_sum` per MoE block combines them. The shared expert of layer i
  is computed by rank i mod N only (it rides in the same all_sum), so its reads are split too.

Exactness. A plain `all_sum` of per-rank partial sums would add the experts in another order than
one process does, so floats would differ in the last bits (and greedy decoding can then differ).
Instead every rank contributes the *unweighted per-slot* outputs (`[..., k + 1, D]`: the gated
shared expert, then each routed slot; a slot is nonzero on exactly one rank, and x + 0 == x
exactly), and after the all_sum every rank runs the one-process combine on identical inputs. On
the CPU the extension's `moe_block` is itself `moe_combine(moe_block_parts(...))`, so decode is
bit-identical to one process by construction; the MLX-ops path (prefill, GPU, no extension)
reuses the model's own `combine_experts`, and sends other ranks' slots to an all-zero expert so
the experts held here see exactly the rows they see in one process (models/parallel.py). The
cost: (k + 1) x D floats per MoE block instead of D (72 KiB instead of 8 KiB for the 35B shape
with k = 8 in float32), still far under the links' bandwidth; the per-collective latency
dominates (see `analysis/distributed_estimate.py`).

Dense parts are replicated by design: sharding a dense projection needs one more collective per
projection (~3-4 per layer), and at batch 1 a collective's latency over Thunderbolt or Ethernet
(tens of microseconds to ~0.1 ms) costs more than reading those bytes locally on an M4
(`pocket-mlx info --ranks N --link ...` prints both sides).

Serving (`serve --distributed`): `Lockstep`. Rank 0 owns the HTTP side; before each reply it
broadcasts one command (kind, sampling, max tokens, stop strings, the prompt's ids) and every rank
then runs the same `stream_generate` from a fresh cache, taking rank 0's token at each step, so
all ranks stop at the same token (EOS, stop string, length). Cancelling (the client left) is
known only on rank 0: every `should_stop` check (after each prefill chunk and each token) is one
tiny all_sum of rank 0's flag, so every rank stops at the same step. A "stop" command ends the
followers when rank 0 shuts down. `chat --distributed` uses the same loop, its ranks started by
hand (`use_hostfile`: mlx.launch would give rank 0 pipes, and the chat app needs a terminal).

Failures: a rank that never connects makes the others exit after `--distributed-timeout`
seconds with one line; a rank that dies makes MLX's ring raise ("connection to a peer was
lost"), reported as one line; a rank that hangs trips the same watchdog between tokens.

The modules, by idea: `launch` (joining the group), `group` (this rank's place, its
collectives and errors), `watchdog` (deadlines), `shard` (this rank's share: decided here,
cut by the model itself, `Model.pipeline` / `Model.shard_experts` in models/parallel.py),
`lockstep` (serve and chat on every rank). This package re-exports what the commands use.
"""

from __future__ import annotations

from pocket_mlx.engine.distributed.group import (
    DEFAULT_TIMEOUT_S,
    LOAD_TIMEOUT_S,
    MODES,
    DistributedError,
    Group,
    RankLost,
    lost,
)
from pocket_mlx.engine.distributed.launch import RING_PORT, init, launch_rank, use_hostfile
from pocket_mlx.engine.distributed.lockstep import BEAT_S, Lockstep
from pocket_mlx.engine.distributed.shard import (
    Sharder,
    attach,
    rank_bytes_per_token,
    rank_report,
    shard_for,
)
from pocket_mlx.engine.distributed.watchdog import Watchdog
from pocket_mlx.models.parallel import pipeline_ranges, split_evenly

__all__ = [
    "BEAT_S", "DEFAULT_TIMEOUT_S", "LOAD_TIMEOUT_S", "MODES", "RING_PORT", "DistributedError",
    "Group", "Lockstep", "RankLost", "Sharder", "Watchdog", "attach", "init", "launch_rank",
    "lost", "pipeline_ranges", "rank_bytes_per_token", "rank_report", "shard_for",
    "split_evenly", "use_hostfile",
]
