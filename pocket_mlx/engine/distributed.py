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
reuses the model's own `_combine_experts`, and sends other ranks' slots to an all-zero expert so
the experts held here see exactly the rows they see in one process. The cost: (k + 1) x D floats per MoE block instead of
D (72 KiB instead of 8 KiB for the 35B shape with k = 8 in float32), still far under the links'
bandwidth; the per-collective latency dominates (see `analysis/distributed_estimate.py`).

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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from pocket_mlx.models.accounting import module_costs
from pocket_mlx.engine import devices
from pocket_mlx.engine.generation import Response, SamplingParams, stream_generate
from pocket_mlx.errors import PocketError
from pocket_mlx.kernels import ops
from pocket_mlx.models.qwen3_5_moe import LanguageModel, SparseMoeBlock, _combine_experts

MODES = ("pipeline", "experts")
DEFAULT_TIMEOUT_S = 120.0
# Loading can take minutes on a big model, and the ranks finish at different times: the first
# collective after loading waits this much longer than the per-token watchdog.
LOAD_TIMEOUT_S = 900.0
_LAUNCH_ENV = ("MLX_HOSTFILE", "MLX_RANK", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_RANK",
               "NCCL_HOST_IP")


# The watchdog runs as a child process: MLX holds the GIL while `mx.distributed.init` waits for
# its peers (checked: no Python thread runs meanwhile), so a thread could never fire. The parent
# writes "SECONDS MESSAGE" lines to arm it and "-" to disarm; when a deadline passes it prints
# the message as one line and ends the parent; when the parent ends, its pipe closes and so
# does the child.
_WATCHDOG = r"""
import os, select, signal, sys, time
parent, deadline, what, buf = int(sys.argv[1]), None, "", b""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([0], [], [], wait)
    if ready:
        data = os.read(0, 65536)
        if not data:
            sys.exit(0)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line == b"-":
                deadline = None
            else:
                secs, _, msg = line.decode().partition(" ")
                deadline, what = time.monotonic() + float(secs), msg
    elif deadline is not None and time.monotonic() >= deadline:
        sys.stderr.write("error: " + what + "\n")
        sys.stderr.flush()
        try:
            os.kill(parent, signal.SIGTERM)
            time.sleep(2)
            os.kill(parent, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
"""


class Watchdog:
    """Ends this process with one line on stderr when a deadline passes without `disarm`: a
    peer that never connects, or hangs, would otherwise block a collective forever (MLX's ring
    has no timeout of its own). Killed by a signal, the process exits with 143 (SIGTERM)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid())],
                                      stdin=subprocess.PIPE, close_fds=True)

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def arm(self, seconds: float, what: str) -> None:
        self._send(f"{seconds} rank {self.rank}: {' '.join(what.split())}")

    def disarm(self) -> None:
        self._send("-")


@dataclass
class Group:
    """This process's place in the distributed run."""

    mode: str
    group: mx.distributed.Group
    timeout: float
    watchdog: Watchdog
    rank: int = 0
    size: int = 1
    info: dict = field(default_factory=dict)  # what the mode decided (ranges, experts)

    def barrier(self, seconds: float, what: str) -> None:
        """A tiny all_sum every rank must reach within `seconds`."""
        self.watchdog.arm(seconds, what)
        try:
            mx.eval(mx.distributed.all_sum(mx.ones(1), group=self.group, stream=mx.cpu))
        except RuntimeError as e:
            raise lost(self.rank, e) from None
        finally:
            self.watchdog.disarm()

    def broadcast_ints(self, values: list[int] | None) -> list[int]:
        """Rank 0's list of ints on every rank (the others pass None)."""
        n = mx.array([len(values) if self.rank == 0 else 0], mx.int32)
        n = int(mx.distributed.all_sum(n, group=self.group, stream=mx.cpu).item())
        a = (mx.array(values, mx.int32) if self.rank == 0 else mx.zeros((n,), mx.int32))
        return mx.distributed.all_sum(a, group=self.group, stream=mx.cpu).tolist()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's list (same length on all) on every rank, in rank order."""
        a = mx.array([values], mx.float64)  # byte counts above 2**24 stay exact
        out = mx.distributed.all_gather(a, group=self.group, stream=mx.cpu)
        return out.tolist()

    def share_token(self, y: mx.array) -> mx.array:
        """Rank 0's sampled token(s) on every rank: the ranks then feed, stop and detokenize
        alike with no further messages (in pipeline mode only rank 0 has real logits)."""
        mine = y if self.rank == 0 else mx.zeros_like(y) * y  # keeps y (and its sends) in the graph
        return mx.distributed.all_sum(mine.astype(mx.int32), group=self.group).astype(y.dtype)


def lost(rank: int, e: Exception) -> PocketError:
    return PocketError(f"rank {rank}: lost the connection to another rank ({e}); "
                       "check that every rank is running and the hosts can reach each other")


RING_PORT = 32323  # mlx.launch's default --starting-port


def use_hostfile(path: str, rank: int) -> str | None:
    """Join a ring without mlx.launch (`chat --distributed --hostfile F --rank R`): set the two
    variables MLX's ring backend reads, as mlx.launch would (MLX_RANK, and MLX_HOSTFILE: a JSON
    list, one entry per rank, of that rank's "ip:port" strings). `path` holds either that list
    or mlx.launch's own hostfile ([{"ssh": ..., "ips": [...]}, ...]), whose ports are numbered
    as mlx.launch numbers them (from 32323, one per host in order). Returns the temporary
    file written for the latter (remove it once `init` has joined), else None."""
    import tempfile
    from pathlib import Path

    try:
        hosts = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise PocketError(f"--hostfile {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise PocketError(f"--hostfile {path} is not valid JSON: {e}") from None
    ring = None
    if isinstance(hosts, list) and len(hosts) >= 2:
        if all(isinstance(h, list) and h and all(isinstance(a, str) and ":" in a for a in h)
               for h in hosts):
            ring = hosts
        elif all(isinstance(h, dict) and h.get("ips") for h in hosts):
            ring = [[f"{h['ips'][0]}:{RING_PORT + i}"] for i, h in enumerate(hosts)]
    if ring is None:
        raise PocketError(f"--hostfile {path}: expected a list of 2 or more hosts, either "
                          '[["10.10.0.1:32323"], ["10.10.0.2:32323"]] (the ring\'s own) or '
                          '[{"ssh": "mini1.local", "ips": ["10.10.0.1"]}, ...] (mlx.launch\'s)')
    if not 0 <= rank < len(ring):
        raise PocketError(f"--rank {rank}: the hostfile has {len(ring)} hosts, so 0 to "
                          f"{len(ring) - 1}")
    temp = None
    if ring is hosts:
        target = os.path.abspath(path)
    else:  # MLX reads the file when the group starts; a temporary copy in the ring's format
        fd, target = tempfile.mkstemp(prefix="pocket-mlx-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(ring, f)
        temp = target
    os.environ["MLX_HOSTFILE"] = target
    os.environ["MLX_RANK"] = str(rank)
    return temp


def launch_rank() -> int | None:
    """This process's rank as its launcher set it (None: not launched for a distributed run)."""
    if not any(os.environ.get(k) for k in _LAUNCH_ENV):
        return None
    for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(k, "").strip().isdigit():
            return int(os.environ[k])
    return 0


def init(mode: str, timeout: float = DEFAULT_TIMEOUT_S) -> Group:
    """Join the group `mlx.launch` started (its environment says where the peers are). Exits
    with one line after `timeout` seconds when a peer never connects."""
    if mode not in MODES:
        raise PocketError(f"unknown --distributed mode {mode!r}: use pipeline or experts")
    if timeout <= 0:
        raise PocketError(f"--distributed-timeout must be > 0 seconds, got {timeout}")
    if not any(os.environ.get(k) for k in _LAUNCH_ENV):
        raise PocketError("--distributed runs under mlx.launch, e.g. `mlx.launch -n 2 --backend "
                          "ring -- $(which python) -m pocket_mlx generate --distributed "
                          f"{mode} ...` (see docs/DISTRIBUTED.md)")
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    dog = Watchdog(rank)
    dog.arm(timeout, f"the other ranks did not connect within {timeout:g} s (--distributed-"
                     "timeout); is every rank started, with the same hostfile?")
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise PocketError(f"rank {rank}: cannot join the distributed group: {e}") from None
    finally:
        dog.disarm()
    g = Group(mode, group, timeout, dog, group.rank(), group.size())
    dog.rank = g.rank
    if g.size < 2:
        raise PocketError("--distributed needs at least 2 ranks (mlx.launch -n 2 or a hostfile "
                          "with 2 hosts)")
    return g


def split_evenly(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of `parts` contiguous ranges of range(n), sizes differing by at most 1."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


def _nbytes(module: nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


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


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1


class RemoteLayer(nn.Module):
    """A layer another rank runs: no weights here, only what `make_cache` asks of a layer."""

    def __init__(self, is_linear: bool):
        super().__init__()
        self.is_linear = is_linear

    def __call__(self, x, cache=None):
        raise RuntimeError("this layer runs on another rank")


@dataclass
class _Pipe:
    group: Group
    lo: int
    hi: int
    in_dtype: mx.Dtype


class PipelineLanguageModel(LanguageModel):
    """LanguageModel whose forward runs only this rank's layers: receive the hidden state from
    the rank before (the last rank embeds instead), run the layers, send it on (rank 0 applies
    the final norm and lm_head instead). Other ranks return placeholder logits that depend on
    the send, so evaluating a step (or the cache) performs it."""

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        pipe: _Pipe = self._pipe
        g = pipe.group
        m = self.model
        cache = cache or [None] * len(m.layers)
        B, L = inputs.shape[:2]
        if g.rank == g.size - 1:
            h = m.embed_tokens(inputs)
        else:
            h = mx.distributed.recv((B, L, self.args.hidden_size), pipe.in_dtype, g.rank + 1,
                                    group=g.group)
        for i in range(pipe.lo, pipe.hi):
            h = m.layers[i](h, cache[i])
        if g.rank == 0:
            h = m.norm(h)
            if self.args.tie_word_embeddings:
                return m.embed_tokens.as_linear(h)
            return self.lm_head(h)
        sent = mx.distributed.send(h, g.rank - 1, group=g.group)
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


def _layer_input_dtypes(model) -> list[mx.Dtype]:
    """The dtype of the hidden state entering each layer (and, last, leaving the last one),
    traced lazily (a graph only, nothing is read or computed): what each rank receives."""
    m = model.language_model.model
    h = m.embed_tokens(mx.zeros((1, 1), mx.uint32))
    out = []
    for layer in m.layers:
        out.append(h.dtype)
        h = layer(h, None)
    out.append(h.dtype)
    return out


def setup_pipeline(model, g: Group) -> None:
    """Keep only this rank's layers (before anything is evaluated: the others are never read)."""
    lm = model.language_model
    m = lm.model
    layers = m.layers
    tail = _nbytes(m.norm) + _nbytes(lm.get("lm_head"))
    head = _nbytes(m.embed_tokens)
    rank = getattr(model, "rank_shard", None)
    if rank is not None:  # per-rank shards: the ranges they were written for (rank_shards.py)
        ranges = [tuple(r) for r in rank["layers_all"]]
        if len(ranges) != g.size or ranges[-1][0] != 0 or ranges[0][1] != len(layers):
            raise PocketError(f"rank {g.rank}: the shards' layer ranges {ranges} do not fit "
                              f"{g.size} ranks and {len(layers)} layers; write them again")
    else:
        shares = [row[0] for row in g.gather_floats([float(_ram_bytes())])]
        ranges = pipeline_ranges([_nbytes(la) for la in layers], head, tail, shares)
    lo, hi = ranges[g.rank]
    dtypes = _layer_input_dtypes(model)
    for i in range(len(layers)):
        if not lo <= i < hi:
            layers[i] = RemoteLayer(layers[i].is_linear)
    if g.rank != g.size - 1 and not (g.rank == 0 and lm.args.tie_word_embeddings):
        m.pop("embed_tokens")
    if g.rank != 0:
        m.pop("norm")
        if "lm_head" in lm:
            lm.pop("lm_head")
    lm.__class__ = PipelineLanguageModel
    object.__setattr__(lm, "_pipe", _Pipe(g, lo, hi, dtypes[lo]))
    g.info = {"layers": [list(r) for r in ranges]}


class ExpertParallelMoe(SparseMoeBlock):
    """SparseMoeBlock holding experts [lo, hi) of `num_experts` (plus one all-zero expert, see
    `setup_experts`): routing as in one process, this rank's experts' outputs, one all_sum, then
    the one-process combine (exact; see the module's docstring)."""

    def __call__(self, x: mx.array) -> mx.array:
        ep: _Experts = self._ep
        group = ep.group.group
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
                return ops.moe_combine(mx.distributed.all_sum(parts, group=group), scores)
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
            group=group)
        experts, shared = both[..., :-1, :], both[..., -1, :].astype(shared.dtype)
        return _combine_experts(experts, scores, self.shared_expert_gate(x), shared)


@dataclass
class _Experts:
    group: Group
    lo: int
    hi: int
    shared: bool  # this rank computes the layer's shared expert
    views: list | None = None  # the held experts' (weight, scales, biases) without the zero one


def setup_experts(model, g: Group) -> None:
    """Keep this rank's block of every layer's routed experts, plus one all-zero expert that
    other ranks' slots are sent to on the MLX-ops path (copies: a slice of a mapped tensor would
    keep the whole tensor alive once evaluated)."""
    E = model.args.num_experts
    if E < g.size:
        raise PocketError(f"experts mode over {g.size} ranks needs at least {g.size} experts per "
                          f"layer; the model has {E}")
    lo, hi = split_evenly(E, g.size, g.rank)
    rank = getattr(model, "rank_shard", None)  # per-rank shards: only [lo, hi) were loaded
    if rank is not None and list(rank["experts"]) != [lo, hi]:
        raise PocketError(f"rank {g.rank}: its shard holds experts {rank['experts']}, this run "
                          f"gives it [{lo}, {hi}); write the shards again")
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sw = mlp.switch_mlp[proj]
            for name in ("weight", "scales", "biases"):
                if name in sw:
                    a = sw[name]
                    held = a if rank is not None else a[lo:hi]
                    sw[name] = mx.concatenate([held, mx.zeros((1, *a.shape[1:]), a.dtype)])
            object.__setattr__(sw, "experts_global", E)
        mlp.__class__ = ExpertParallelMoe
        object.__setattr__(mlp, "_ep", _Experts(g, lo, hi, i % g.size == g.rank))
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
            ep = getattr(mlp, "_ep", None)
            if ep is not None and not ep.shared and not c.path.endswith("shared_expert_gate"):
                continue
        total += c.bytes_per_token
    return total


def rank_report(model, g: Group) -> dict:
    """What each rank holds, measured from its loaded arrays, gathered on every rank."""
    mine = [float(_nbytes(model)), float(rank_bytes_per_token(model)),
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


_STOP, _GENERATE, _IDLE = 0, 1, 2
# Commands go out only on a beat of this period: a rank waiting in MLX's ring receive spins
# (measured here: an idle follower took ~1.6 cores), so between commands every rank sleeps
# until the next beat and arrives at the collective when the others do. An idle rank 0 sends
# IDLE on each beat; a request waits at most one beat to start.
BEAT_S = 0.1


class Lockstep:
    """Replies generated by every rank at once, asked for on rank 0 (`serve --distributed`).

    Rank 0 calls `stream_generate` (same arguments as the engine's) for each reply and `finish`
    when it shuts down; every other rank calls `follow`, which waits for rank 0's commands.
    Every collective (commands, stop flags, the steps' own) runs on the generation stream of the
    thread that generates, so it queues behind a step still in flight and the ranks see the same
    order of collectives. No prompt cache: each reply starts from a fresh cache on every rank
    (a shared cache would have to make the same decisions on every rank; not built)."""

    def __init__(self, g: Group) -> None:
        self.g = g
        self.shard = shard_for(g)  # the loader hook: keep this rank's share
        self._last = time.monotonic()  # when the ranks last met

    def until_beat(self) -> float:
        """Seconds to the next beat (rank 0's engine waits for a request this long, then
        calls `idle`)."""
        return max(0.0, self._last + BEAT_S - time.monotonic())

    def _pace(self) -> None:
        time.sleep(self.until_beat())

    def idle(self, model, exit_on_lost: bool = True) -> None:
        """Rank 0 has no request this beat: tell the others so (they sleep to the next one).
        A rank gone ends the server here, with one line: it cannot answer without it
        (`exit_on_lost=False`: raise the PocketError instead, for the chat app, which must
        restore the terminal before it exits)."""
        try:
            self._command(devices.stream_for(model.device), _IDLE)
        except PocketError as e:
            if not exit_on_lost:
                raise
            sys.stderr.write(f"pocket-mlx serve: error: {e}\n")
            sys.stderr.flush()
            os._exit(2)

    def ready(self, model) -> None:
        """After loading: wait for every rank, then take rank 0's token when generating."""
        load_s = max(LOAD_TIMEOUT_S, self.g.timeout)
        self.g.barrier(load_s, "the other ranks did not finish loading in time")
        attach(model, self.g)

    # ---- the messages ----------------------------------------------------------------------
    def _collective(self, a: mx.array, stream: mx.Stream) -> mx.array:
        try:
            out = mx.distributed.all_sum(a, group=self.g.group, stream=stream)
            mx.eval(out)
        except RuntimeError as e:  # MLX's ring: a peer closed its connection
            raise lost(self.g.rank, e) from None
        return out

    def _command(self, stream: mx.Stream, kind: int = _STOP, spec: dict | None = None,
                 ids: list[int] | None = None) -> tuple[int, dict, list[int]]:
        """Rank 0's (kind, spec, ids) on every rank: a fixed int32 header [kind, spec bytes,
        ids], then the spec as UTF-8 JSON bytes (stop strings are text of any length; JSON
        floats round-trip exactly) followed by the ids, in one int32 array. The other ranks
        contribute zeros."""
        self._pace()
        lead = self.g.rank == 0
        blob = json.dumps(spec or {}).encode() if lead else b""
        ids = list(ids or []) if lead else []
        head = self._collective(mx.array([kind, len(blob), len(ids)] if lead else [0, 0, 0],
                                         mx.int32), stream).tolist()
        kind, nb, ni = head
        body = (mx.array([*blob, *ids], mx.int32) if lead else mx.zeros((nb + ni,), mx.int32))
        got = self._collective(body, stream).tolist() if nb + ni else []
        self._last = time.monotonic()
        return kind, json.loads(bytes(got[:nb]).decode() or "{}"), got[nb:]

    def _agree(self, stream: mx.Stream, stop_here: bool) -> bool:
        """Rank 0's cancel flag on every rank (others pass False)."""
        flag = mx.array([int(stop_here and self.g.rank == 0)], mx.int32)
        return bool(self._collective(flag, stream).item())

    def _beat(self) -> None:
        self.g.watchdog.arm(self.g.timeout, f"no answer from the other ranks for "
                                            f"{self.g.timeout:g} s (--distributed-timeout)")

    def _run(self, model, tokenizer, ids: list[int], spec: dict, stream: mx.Stream,
             should_stop: Callable[[], bool] | None, warn) -> Iterator[Response]:
        self._beat()
        try:
            for r in stream_generate(
                    model, tokenizer, ids, max_tokens=spec["max_tokens"],
                    sampling=SamplingParams(**spec["sampling"]), stop=spec["stop"],
                    device=spec["device"], cache=model.make_cache(), warn=warn,
                    should_stop=lambda: self._agree(stream, bool(should_stop and should_stop()))):
                self._beat()
                yield r
        except RuntimeError as e:
            raise lost(self.g.rank, e) from None
        finally:
            self.g.watchdog.disarm()
            self._last = time.monotonic()

    # ---- rank 0 ----------------------------------------------------------------------------
    def stream_generate(self, model, tokenizer, ids: list[int], *, max_tokens: int,
                        sampling: SamplingParams, stop: list[str] | None = None,
                        device: str | None = None, cache: list | None = None,
                        should_stop: Callable[[], bool] | None = None,
                        warn=None) -> Iterator[Response]:
        """`generation.stream_generate` on every rank (rank 0 only). `cache` must be a fresh
        one or None: there is no prompt cache under --distributed."""
        if cache is not None and any(getattr(c, "offset", 0) for c in cache):
            raise RuntimeError("no prompt cache under --distributed: pass a fresh cache")
        sampling.validate()  # a bad request fails here, before the other ranks hear of it
        dev = devices.resolve_device(device or model.device)
        stream = devices.stream_for(dev)
        spec = {"max_tokens": max_tokens, "sampling": asdict(sampling),
                "stop": list(stop or []), "device": dev}
        self._command(stream, _GENERATE, spec, ids)
        yield from self._run(model, tokenizer, ids, spec, stream, should_stop, warn)

    def finish(self, model) -> None:
        """Rank 0 is shutting down: the followers return from `follow`."""
        self._command(devices.stream_for(model.device), _STOP)

    # ---- the other ranks -------------------------------------------------------------------
    def follow(self, model, tokenizer) -> None:
        """Run rank 0's replies until it says stop. Rank 0 sends a command every beat, so a
        rank 0 silent for --distributed-timeout is an error, as one that dies is (`lost`)."""
        stream = devices.stream_for(model.device)
        while True:
            self.g.watchdog.arm(self.g.timeout, f"rank 0 sent nothing for {self.g.timeout:g} "
                                                "s (--distributed-timeout)")
            kind, spec, ids = self._command(stream)
            self.g.watchdog.disarm()
            if kind == _STOP:
                return
            if kind == _IDLE:
                continue
            try:
                for _ in self._run(model, tokenizer, ids, spec, stream, None, None):
                    pass
            except PocketError:
                pass  # rank 0 met the same refusal on the same input and goes on too
