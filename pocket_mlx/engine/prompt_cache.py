"""A store of model-cache snapshots keyed by the exact tokens they hold, shared by all requests.

Why: on a CPU, prefill is the cost (a 4k-token prompt takes minutes). A request whose prompt
extends a stored sequence (the same system prompt, the previous turn of a conversation) copies
that snapshot and prefills only the rest.

What is stored: the cache as it holds exactly a token sequence, taken at reusable points (the
chat template's message boundaries and every SNAPSHOT_INTERVAL tokens inside a prompt, the end
of a prompt or reply). In RAM the KV positions are kept in segments that snapshots of the same
sequence share: a snapshot taken further along the prefill that stored a shorter one holds that
one's segments plus a copy of the positions past it, not a second copy of the whole prefix
(they are shared only where the arrays are equal, checked when stored). The hybrid model's Gated DeltaNet state cannot be
trimmed back to an earlier position, so a snapshot is only ever reused whole: `fetch` finds the
longest stored sequence that is a proper prefix of the prompt (hash of every prefix, one pass;
then the stored lengths are checked from the longest down).

Tiers: snapshots live in RAM (LRU within `ram_bytes`, counted as the arrays' bytes, KV trimmed
to its positions); the coldest are spilled to `disk_dir` as safetensors (token ids, layer kinds
and offsets in the file) and restored on demand. The disk tier has its own LRU budget and is
indexed again by a new process, so the cache survives a restart. Files live under a folder
named by the model's fingerprint (config + a sample of the weight files), so another model's
snapshots are never used; each file also records the activation dtype it was made in, and only
snapshots of the model's current dtype match (a bfloat16 GPU cache does not feed a float32 CPU
run, whose greedy output must equal a cold run's).

Threads: one lock guards the index, both tiers and the statistics (disk I/O included: simple,
and the server has one engine thread doing the model work). Snapshots are evaluated when
stored and arrays read from disk when restored, so what `fetch` hands out is materialized and
usable on any thread; `store` must run on the thread whose stream computed the cache (MLX
streams are per thread), which is the engine thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx

from pocket_mlx.config import safetensors_header, weight_files
from pocket_mlx.engine.params import PROMPT_CACHE_DISK_BYTES
from pocket_mlx.errors import PocketError
from pocket_mlx.paths import data_dir

log = logging.getLogger(__name__)

FORMAT = "pocket-prompt-cache/1"
SUFFIX = ".safetensors"
_TMP = ".tmp-"  # in the names of files still being written (never indexed)
_MOD = (1 << 61) - 1  # prefix hashes: polynomial, modulo a Mersenne prime
_BASE = 1_000_003
_SAMPLES = 8  # blocks of each weight file hashed into the fingerprint
_BLOCK = 1 << 12


# --- the state of a model cache -------------------------------------------------------------

@dataclass(frozen=True)
class LayerState:
    """One layer of a captured cache. `arrays` is (keys, values) for a KV layer, (conv_state,
    state) for a linear-attention layer; a KV layer captured without `detach` keeps only its
    offset (arrays None): the live cache's positions below it are never rewritten."""

    kind: str  # "kv" | "linear"
    offset: int
    arrays: tuple[mx.array | None, mx.array | None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


def layer_kind(c) -> str:
    return "linear" if hasattr(c, "conv_state") else "kv"


def _handle(a: mx.array | None) -> mx.array | None:
    # A new array object over the same (evaluated) data, so that an in-place update of one
    # (KVCache writes with `keys[...] = new`, which rebinds the object it is called on) never
    # reaches the other; MLX copies rather than reuse a buffer another array holds. Not
    # mx.array(a): that is a lazy copy, bound to this thread's stream.
    return None if a is None else a.reshape(a.shape)


def snapshot_bytes(cache: list) -> int:
    """What `capture(cache, detach=True)` will hold: the KV positions up to each layer's
    offset and the linear layers' states (known before the copy is made)."""
    n = 0
    for c in cache:
        if layer_kind(c) == "linear":
            n += sum(a.nbytes for a in (c.conv_state, c.state) if a is not None)
        elif c.keys is not None and c.offset:
            b, h, _, d = c.keys.shape
            n += c.offset * b * h * (d * c.keys.itemsize + c.values.shape[3] * c.values.itemsize)
    return n


def capture(cache: list, *, detach: bool = False) -> list[LayerState]:
    """The state of a live cache. Without `detach`: a rewind point for `restore` into the same
    cache (the chat's regenerate; KV layers by offset, linear layers by reference: the model
    rebinds new arrays rather than writing into them). With `detach`: an independent snapshot
    (KV positions copied out, compact, up to the offset), evaluated, that any cache of the same
    model can be set to (the prompt cache)."""
    out = []
    for c in cache:
        if layer_kind(c) == "linear":
            out.append(LayerState("linear", c.offset, (c.conv_state, c.state)))
        elif not detach or c.keys is None or c.offset == 0:
            out.append(LayerState("kv", c.offset, (None, None)))
        else:
            k, v = (a[..., :c.offset, :] for a in (c.keys, c.values))
            if c.offset < c.keys.shape[2]:
                k, v = mx.contiguous(k), mx.contiguous(v)  # do not pin the preallocated room
            out.append(LayerState("kv", c.offset, (k, v)))
    if detach:
        mx.eval([a for s in out for a in s.arrays if a is not None])
    return out


def restore(cache: list, states: list[LayerState]) -> list:
    """Set `cache` to captured `states` (in place; returns it): rewinds a live cache to a point
    `capture` took, or fills a fresh `model.make_cache()` from a detached snapshot, which stays
    unchanged whatever the cache does next."""
    if len(cache) != len(states):
        raise ValueError(f"a cache of {len(cache)} layers cannot take {len(states)} layer states")
    for c, s in zip(cache, states):
        if layer_kind(c) != s.kind:
            raise ValueError(f"a {layer_kind(c)} layer cannot take a {s.kind} state")
        if s.kind == "linear":
            c.conv_state, c.state = (_handle(a) for a in s.arrays)
            c.offset = s.offset
        elif s.arrays[0] is None:  # a rewind point (or an empty layer)
            if c.offset < s.offset:
                raise ValueError(f"cannot rewind a KV layer of {c.offset} positions to {s.offset}")
            c.trim(c.offset - s.offset)
        else:
            c.keys, c.values = (_handle(a) for a in s.arrays)
            c.offset = s.offset
    return cache


@dataclass(eq=False)
class _Segment:
    """KV positions [start, end) of every KV layer of a model cache, evaluated and compact: a
    piece of one or more RAM snapshots' KV (counted once in the RAM budget, however many
    snapshots hold it; `refs` counts them)."""

    start: int
    end: int
    kv: dict[int, tuple[mx.array, mx.array]]  # layer index -> (keys, values)
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv.values())


def _segment(cache: list, start: int, end: int) -> _Segment:
    """A copy of positions [start, end) of `cache`'s KV layers (lazy; the caller evaluates)."""
    kv = {}
    for i, c in enumerate(cache):
        if layer_kind(c) == "kv" and c.keys is not None:
            k, v = (a[..., start:end, :] for a in (c.keys, c.values))
            if start or end < c.keys.shape[2]:
                k, v = mx.contiguous(k), mx.contiguous(v)  # do not pin the live buffer
            kv[i] = (k, v)
    return _Segment(start, end, kv)


def _split(states: list[LayerState]) -> tuple[list[LayerState], list[_Segment]]:
    """Detached layer states -> (states with the KV layers' arrays left out, one segment)."""
    kv = {i: s.arrays for i, s in enumerate(states) if s.kind == "kv" and s.arrays[0] is not None}
    bare = [LayerState("kv", s.offset, (None, None)) if s.kind == "kv" else s for s in states]
    n = max((s.offset for s in states), default=0)
    return bare, ([_Segment(0, n, kv)] if kv else [])


def _join(states: list[LayerState], segments: list[_Segment]) -> list[LayerState]:
    """The inverse of `_split` (and of a chain of shared segments): whole detached states, the
    KV of several segments concatenated (lazy: the caller evaluates)."""
    out = []
    for i, s in enumerate(states):
        parts = [seg.kv[i] for seg in segments if i in seg.kv]
        if s.kind != "kv" or not parts:
            out.append(s)
        elif len(parts) == 1:
            out.append(LayerState("kv", s.offset, parts[0]))
        else:
            out.append(LayerState("kv", s.offset, tuple(
                mx.concatenate([p[j] for p in parts], axis=2) for j in (0, 1))))
    return out


# safetensors' names of the dtypes a cache holds.
_ST_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}


def _save_streaming(path: Path, arrays: dict[str, mx.array], meta: dict[str, str]) -> None:
    """A safetensors file of `arrays` (lazy ones welcome) evaluated and written one at a time.
    Why not `mx.save_safetensors`: it holds every array evaluated at once, and a spilled
    snapshot's KV layers are lazy joins of its shared segments, so a spill would make a whole
    second copy of the snapshot (0.5 GiB at 12k tokens of the 35B shape) beside the first,
    over what the memory planner counts. Here one layer's copy exists at a time (the layout
    is computed from the shapes, known before evaluation). convert's ShardWriter does the
    same for model shards, but sits a layer above (convert/) and writes an index."""
    header: dict = {"__metadata__": meta}
    start = 0
    for name, a in arrays.items():
        if a.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {a.dtype} has no safetensors type")
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [start, start + a.nbytes]}
        start += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in list(arrays):
            a = mx.contiguous(arrays.pop(name))  # dropped from the dict: freed once written
            mx.eval(a)
            f.write(memoryview(a))
            del a


def cache_offset(cache: list) -> int:
    return max((c.offset for c in cache), default=0)


# --- model identity -------------------------------------------------------------------------

def model_fingerprint(model) -> str:
    """A short hash of what makes a cache valid for a model: its config and its weights (each
    weight file's name, size, header and a few blocks of its data: hashing all of a 20 GB
    checkpoint at every start is not worth it). Models built in memory without a folder
    fall back to their config and parameter shapes."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "args"):
        config = vars(model.args)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    path = getattr(model, "path", None)
    folder = getattr(model, "folder", None)  # the loader's ModelFolder: its files, listed once
    files: list[Path] = []
    if path is not None:
        try:
            files = folder.weight_files if folder is not None else weight_files(Path(path))
        except (OSError, PocketError):
            files = []
    for f in files:
        st = f.stat()
        size = st.st_size
        # The modification time too: a fine-tune of the same shape (same config, sizes and
        # header) rewritten in place must not match caches of the weights it replaced.
        h.update(f"{f.name}:{size}:{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            # The whole header (a large MoE's is far over 16 KiB), then the first tensors.
            h.update(fh.read(min(header_len, 64 << 20) + _BLOCK * 4))
            for i in range(1, _SAMPLES + 1):
                fh.seek(max(0, size * i // (_SAMPLES + 1)))
                h.update(fh.read(_BLOCK))
    if not files:
        from mlx.utils import tree_flatten  # only for in-memory models (tests, tools)

        h.update(repr([(k, v.shape, str(v.dtype)) for k, v in
                       tree_flatten(model.parameters())]).encode())
    return h.hexdigest()[:20]


def run_dtype(model) -> str:
    """The activation dtype a cache of `model` is made in now (see loader.cast_model), and its
    KV cache's type where that is not the activations' (--cache-type-k f16: "float32+kv-f16")."""
    kv = getattr(model, "kv_cache_type", "f32")
    return str(getattr(model, "run_dtype", None) or "native") + ("" if kv == "f32" else f"+kv-{kv}")


def _prefix_hashes(tokens) -> list[int]:
    out = [0] * (len(tokens) + 1)
    h = 0
    for i, t in enumerate(tokens):
        h = (h * _BASE + int(t) + 1) % _MOD
        out[i + 1] = h
    return out


# --- the store ------------------------------------------------------------------------------

@dataclass(eq=False)
class _Entry:
    dtype: str
    tokens: tuple[int, ...]
    key: tuple[str, int, int]  # (dtype, length, prefix hash)
    used: int  # recency: larger is more recent
    states: list[LayerState] | None = None  # in RAM (KV layers: offsets only, see segments)
    segments: list[_Segment] | None = None  # in RAM: its KV, possibly shared with others
    nbytes: int = 0  # bytes of the arrays it holds alone (when in RAM): the linear states
    path: Path | None = None  # on disk
    disk_bytes: int = 0
    kind: str = "end"  # where it was taken: boundary | interval | end
    hits: int = 0  # fetches it answered: a shared prefix outlives one-off tails


#: Where a snapshot was taken: a chat-template message boundary inside a prompt, every N tokens
#: of a long prompt, or the end of a prompt/reply (see engine/batch.py's prefill).
SNAPSHOT_KINDS = ("boundary", "interval", "end")


class PrefixStore(Protocol):
    """A store of model caches keyed by token prefix, shared by all requests: what the server's
    engine (server/engine.py) and the batch (engine/batch.py) need of `PromptCache`, and what
    `NoPromptCache` and the tests' own stores offer too."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list | None, int]:
        """(a cache holding the first `n` tokens of `tokens`, n) for the longest stored prefix
        with n < len(tokens) (at least one token must be left to prefill), or (None, 0). The
        caller owns the returned cache and will extend it."""
        ...

    def store(self, tokens: Sequence[int], cache: list, kind: str = "end") -> None:
        """Keep `cache`, which holds exactly `tokens`, for later requests; `kind` says where it
        was taken (boundary | interval | end)."""
        ...


class NoPromptCache:
    """No reuse: every request prefills its whole prompt (cached_tokens is 0)."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list | None, int]:
        return None, 0

    def store(self, tokens: Sequence[int], cache: list, kind: str = "end") -> None:
        return None


#: Hits beyond this count no more in eviction: an old prefix hit often once still ages out.
_HIT_CAP = 4
#: Prefill stores an "interval" snapshot every this many prompt tokens (see docs/SERVE.md for
#: the measurement behind it: a snapshot costs a copy of the state, the prefill it saves is
#: this many tokens).
SNAPSHOT_INTERVAL = 1024


def _victim_key(e: _Entry) -> tuple[int, int]:
    # Why: a system prompt shared by many conversations is hit again and again; a reply's tail
    # is hit at most by its own next turn. Fewest hits go first, then least recently used.
    return (min(e.hits, _HIT_CAP), e.used)


class PromptCache:
    """Snapshots of `model`'s cache by token sequence: RAM (LRU within `ram_bytes`), then, with
    `disk_dir`, safetensors files (LRU within `disk_bytes`) that a later process finds again.
    `write_through` writes each snapshot to disk as it is stored (it survives a crash, at the
    cost of a write per store); otherwise they reach disk when spilled or on `flush()`."""

    def __init__(self, model, ram_bytes: int, disk_dir: str | os.PathLike | None = None, *,
                 disk_bytes: int = 16 << 30, write_through: bool = False,
                 fingerprint: str | None = None):
        if ram_bytes < 0 or disk_bytes < 0:
            raise PocketError("prompt cache budgets must be >= 0 bytes")
        self.model = model
        self.ram_budget = int(ram_bytes)
        self.disk_budget = int(disk_bytes) if disk_dir is not None else 0
        self.write_through = write_through
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.kinds = [layer_kind(c) for c in model.make_cache()]
        self.dir = Path(disk_dir).expanduser() / self.fingerprint if disk_dir is not None \
            else None
        self._lock = threading.RLock()
        self._entries: dict[tuple[str, int, int], _Entry] = {}
        self._lengths: dict[str, dict[int, int]] = {}  # dtype -> length -> entries of it
        self._clock = 0
        self._last_ns = 0
        self.ram_used = 0
        self.disk_used = 0
        self.hits = self.misses = self.tokens_served = 0
        self.spills = self.restores = self.evictions = self.stores = 0
        self.tokens_by_kind = dict.fromkeys(SNAPSHOT_KINDS, 0)
        self.last_kind: str | None = None  # the kind of the snapshot the last fetch returned
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PocketError(f"cannot use {self.dir} for the prompt cache: {e}") from None
            self._index_disk()

    # -- public -----------------------------------------------------------------------------

    def fetch(self, tokens) -> tuple[list, int]:
        """(cache, tokens it holds): a fresh copy of the longest stored snapshot whose tokens
        are a proper prefix of `tokens` (at least one token is left to feed: the model needs
        one to give the next logits), or `(model.make_cache(), 0)`. The caller may extend the
        copy; the stored snapshot does not change. So that a repeat of the same prompt hits
        too, store a prompt without its last token (what the prefill leaves in the cache before
        the first decoding step) rather than the whole prompt."""
        tokens = list(tokens)
        dtype = run_dtype(self.model)
        hashes = _prefix_hashes(tokens)
        with self._lock:
            self.last_kind = None
            lengths = sorted((n for n in self._lengths.get(dtype, {}) if n < len(tokens)),
                             reverse=True)
            for n in lengths:
                e = self._entries.get((dtype, n, hashes[n]))
                if e is None or list(e.tokens) != tokens[:n]:
                    continue
                if e.states is not None:
                    states = _join(e.states, e.segments)
                    mx.eval([a for st in states for a in st.arrays if a is not None])
                else:
                    states = self._read(e)
                    if states is None:
                        continue  # unreadable: dropped, try a shorter one
                    self.restores += 1
                self._touch(e)
                if e.states is None:
                    self._admit(e, *_split(states))
                self.hits += 1
                e.hits += 1
                self.tokens_served += n
                self.tokens_by_kind[e.kind] = self.tokens_by_kind.get(e.kind, 0) + n
                self.last_kind = e.kind
                return restore(self.model.make_cache(), states), n
            self.misses += 1
        return self.model.make_cache(), 0

    def store(self, tokens, cache: list, kind: str = "end") -> bool:
        """Snapshot `cache`, which holds exactly `tokens` (its offset must be len(tokens));
        `kind` says where it was taken (SNAPSHOT_KINDS, reported on reuse). Returns False when
        that sequence is already stored (then it only counts as used)."""
        if kind not in SNAPSHOT_KINDS:
            raise ValueError(f"snapshot kind must be one of {', '.join(SNAPSHOT_KINDS)}")
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            return False
        if len(cache) != len(self.kinds) or [layer_kind(c) for c in cache] != self.kinds:
            raise ValueError("the cache is not one of this store's model")
        if (off := cache_offset(cache)) != len(tokens):
            raise ValueError(f"the cache holds {off} positions, not the {len(tokens)} tokens given")
        dtype = run_dtype(self.model)
        hashes = _prefix_hashes(tokens)
        key = (dtype, len(tokens), hashes[-1])
        with self._lock:
            if (e := self._entries.get(key)) is not None and e.states is not None:
                self._touch(e)
                return False
            parent = self._parent(dtype, tokens, hashes)
            # Its segments as a list of their own: another thread may evict it meanwhile (the
            # arrays stay valid; `_admit` counts them again if they are no longer held).
            shareable = list(parent.segments) if parent is not None else []
            # Room first (colder entries spilled, not the parent whose KV the snapshot will
            # share), then the copy: the store's RAM stays within the larger of its budget and
            # one snapshot, the figure `serve`'s memory planner counts (system/wired.py
            # `serve_ram_bytes`), rather than the budget plus a snapshot.
            need = snapshot_bytes(cache) - sum(g.nbytes for g in shareable)
            self._evict_until(self.ram_budget - need, keep=parent)
        states, segments = self._capture(cache, shareable)  # outside the lock: it computes
        with self._lock:
            if (e := self._entries.get(key)) is not None:
                self._touch(e)
                if e.states is None and e.tokens == tokens:  # on disk only: back in RAM
                    self._admit(e, states, segments)
                return False
            self._clock += 1
            e = _Entry(dtype, tokens, key, self._clock, kind=kind)
            self._entries[key] = e
            by_len = self._lengths.setdefault(dtype, {})
            by_len[len(tokens)] = by_len.get(len(tokens), 0) + 1
            self.stores += 1
            self._admit(e, states, segments)
            if self.write_through and e.states is not None:
                self._write(e)
                self._shrink_disk()
            return True

    def _parent(self, dtype: str, tokens: tuple[int, ...], hashes: list[int]) -> _Entry | None:
        """The longest snapshot in RAM whose tokens are a proper prefix of `tokens` (the lock is
        held): the one whose KV segments a new snapshot of `tokens` may share."""
        for n in sorted((n for n in self._lengths.get(dtype, {}) if n < len(tokens)),
                        reverse=True):
            e = self._entries.get((dtype, n, hashes[n]))
            if e is not None and e.states is not None and e.tokens == tokens[:n]:
                return e
        return None

    @staticmethod
    def _capture(cache: list, shareable: list[_Segment]
                 ) -> tuple[list[LayerState], list[_Segment]]:
        """`cache` detached as (bare layer states, KV segments), evaluated: the `shareable`
        segments (a stored prefix's) plus a copy of the positions past them when the cache's KV
        up to there equals them (the same prefill went on from that snapshot, or one that
        rounded alike), else one copy of it all. The comparison reads the prefix once; a copy
        would read and write it."""
        n = cache_offset(cache)
        bare = [LayerState("linear", c.offset, (c.conv_state, c.state))
                if layer_kind(c) == "linear" else LayerState("kv", c.offset, (None, None))
                for c in cache]
        shared: list[_Segment] = []
        if shareable:
            checks = [mx.array_equal(c.keys[..., seg.start:seg.end, :], k)
                      & mx.array_equal(c.values[..., seg.start:seg.end, :], v)
                      for seg in shareable for i, (k, v) in seg.kv.items()
                      for c in (cache[i],)]
            if checks and all(mx.stack(checks).tolist()):
                shared = shareable
        start = shared[-1].end if shared else 0
        segments = shared + ([_segment(cache, start, n)] if n > start else [])
        mx.eval([a for st in bare for a in st.arrays if a is not None]
                + [a for seg in segments[len(shared):] for kv in seg.kv.values() for a in kv])
        return bare, [seg for seg in segments if seg.kv]

    def flush(self) -> int:
        """Write every snapshot held only in RAM to disk, the most recent first, within the disk
        budget (the server calls this when it stops). Returns the number written."""
        if self.dir is None:
            return 0
        written = 0
        with self._lock:
            for e in sorted((e for e in self._entries.values()
                             if e.states is not None and e.path is None),
                            key=lambda e: -e.used):
                if self._write(e):
                    written += 1
                    self._shrink_disk()
                    if e.path is None:  # itself the oldest on disk: older ones will not fit
                        break
        return written

    close = flush

    def clear(self) -> None:
        """Forget every snapshot, in RAM and on disk."""
        with self._lock:
            for e in list(self._entries.values()):
                self._forget(e)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict:
        """Counters and gauges for /metrics."""
        with self._lock:
            ram = sum(1 for e in self._entries.values() if e.states is not None)
            disk = sum(1 for e in self._entries.values() if e.path is not None)
            return {"hits": self.hits, "misses": self.misses,
                    "tokens_served": self.tokens_served, "stores": self.stores,
                    "spills": self.spills, "restores": self.restores,
                    "evictions": self.evictions,
                    "tokens_by_kind": dict(self.tokens_by_kind),
                    "ram_bytes": self.ram_used, "ram_budget_bytes": self.ram_budget,
                    "disk_bytes": self.disk_used, "disk_budget_bytes": self.disk_budget,
                    "entries": len(self._entries), "entries_ram": ram, "entries_disk": disk}

    # -- tiers (the lock is held) -----------------------------------------------------------

    def _touch(self, e: _Entry) -> None:
        self._clock += 1
        e.used = self._clock
        if e.path is not None:
            self._stamp(e.path)

    def _stamp(self, path: Path) -> None:
        """Set the file's time to now, strictly after the last one set: the disk tier's order
        of use survives a restart (the file system's own clock is coarse: two writes in one
        tick would tie)."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(path, ns=(self._last_ns, self._last_ns))
        except OSError:
            pass

    def _admit(self, e: _Entry, states: list[LayerState], segments: list[_Segment]) -> None:
        """Hold `states` and KV `segments` in RAM for `e` (a segment other snapshots hold
        already costs nothing more), then spill the coldest over the budget."""
        e.states, e.segments, e.nbytes = states, segments, sum(s.nbytes for s in states)
        self.ram_used += e.nbytes
        for seg in segments:
            if not seg.refs:
                self.ram_used += seg.nbytes
            seg.refs += 1
        self._evict_until(self.ram_budget)

    def _evict_until(self, limit: int, keep: _Entry | None = None) -> None:
        """Spill (or drop) the coldest entries held in RAM, `keep` aside, until they take at
        most `limit`."""
        while self.ram_used > max(limit, 0):
            held = [x for x in self._entries.values() if x.states is not None and x is not keep]
            if not held:
                return
            victim = min(held, key=_victim_key)
            if victim.path is None and self._write(victim):
                self.spills += 1
            self._release_ram(victim)
            if victim.path is None:
                self._forget(victim)
            else:
                self._shrink_disk()

    def _release_ram(self, e: _Entry) -> None:
        """Drop `e`'s RAM copy; its segments' bytes go when no other snapshot holds them."""
        self.ram_used -= e.nbytes
        for seg in e.segments or ():
            seg.refs -= 1
            if not seg.refs:
                self.ram_used -= seg.nbytes
        e.states, e.segments, e.nbytes = None, None, 0

    def _shrink_disk(self) -> None:
        while self.disk_used > self.disk_budget:
            victim = min((x for x in self._entries.values() if x.path is not None),
                         key=_victim_key)
            self._unlink(victim)
            if victim.states is None:
                self._forget(victim)

    def _forget(self, e: _Entry) -> None:
        if e.states is not None:
            self._release_ram(e)
        if e.path is not None:
            self._unlink(e)
        if self._entries.pop(e.key, None) is not None:
            by_len = self._lengths[e.dtype]
            by_len[len(e.tokens)] -= 1
            if not by_len[len(e.tokens)]:
                del by_len[len(e.tokens)]
            self.evictions += 1

    def _unlink(self, e: _Entry) -> None:
        try:
            e.path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("prompt cache: cannot remove %s: %s", e.path, err)
        self.disk_used -= e.disk_bytes
        e.path, e.disk_bytes = None, 0

    def _file(self, e: _Entry) -> Path:
        name = hashlib.sha256(f"{e.dtype}:{','.join(map(str, e.tokens))}".encode()).hexdigest()
        return self.dir / (name[:32] + SUFFIX)

    def _write(self, e: _Entry) -> bool:
        """Write `e`'s snapshot to the disk tier (temp name, then rename). False when there is
        no disk tier, it cannot fit, or the write fails (logged)."""
        if self.dir is None or e.states is None:
            return False
        if e.nbytes + sum(g.nbytes for g in e.segments) + 4 * len(e.tokens) > self.disk_budget:
            return False
        states = _join(e.states, e.segments)  # each file whole: read back alone
        arrays = {"tokens": mx.array(e.tokens, mx.uint32)}
        for i, s in enumerate(states):
            names = ("k", "v") if s.kind == "kv" else ("conv", "state")
            for name, a in zip(names, s.arrays):
                if a is not None:
                    arrays[f"{i}.{name}"] = a
        meta = {"format": FORMAT, "model": self.fingerprint, "dtype": e.dtype, "kind": e.kind,
                "layers": json.dumps([[s.kind, s.offset] for s in states])}
        del states  # the joined layers live in `arrays` only, each freed once written
        final = self._file(e)
        tmp = final.with_name(f"{final.stem}{_TMP}{os.getpid()}-{threading.get_ident()}{SUFFIX}")
        try:
            _save_streaming(tmp, arrays, meta)
            os.replace(tmp, final)
        except (OSError, RuntimeError, ValueError) as err:
            log.warning("prompt cache: cannot write %s: %s", final, err)
            tmp.unlink(missing_ok=True)
            return False
        self._stamp(final)
        e.path, e.disk_bytes = final, final.stat().st_size
        self.disk_used += e.disk_bytes
        return True

    def _read(self, e: _Entry) -> list[LayerState] | None:
        """`e`'s snapshot from its file, evaluated; None (and the entry's file dropped, with a
        warning) when the file is gone, damaged or not what the index says."""
        try:
            arrays, meta = mx.load(str(e.path), return_metadata=True)
            layers = json.loads(meta["layers"])
            if meta.get("format") != FORMAT or meta.get("model") != self.fingerprint:
                raise ValueError("made for another model or format")
            if [k for k, _ in layers] != self.kinds:
                raise ValueError("layer kinds differ from the model's")
            if arrays["tokens"].tolist() != list(e.tokens):
                raise ValueError("token ids differ from the index")
            states = []
            for i, (kind, offset) in enumerate(layers):
                names = ("k", "v") if kind == "kv" else ("conv", "state")
                pair = tuple(arrays.get(f"{i}.{n}") for n in names)
                if offset and any(a is None for a in pair):
                    raise ValueError(f"layer {i} lacks its arrays")
                if kind == "kv" and offset and pair[0].shape[2] != offset:
                    raise ValueError(f"layer {i} does not hold {offset} positions")
                states.append(LayerState(kind, int(offset), pair))
            mx.eval([a for s in states for a in s.arrays if a is not None])
        except Exception as err:  # noqa: BLE001 - any damage to a cache file is a miss
            log.warning("prompt cache: skipping %s: %s", e.path, err)
            self._unlink(e)
            if e.states is None:
                self._forget(e)
            return None
        return states

    def _index_disk(self) -> None:
        """Index the snapshots a previous process left in this model's folder (their order of
        use from the files' times); files that are not ours or are damaged are skipped."""
        found = []
        for f in self.dir.iterdir():
            if _TMP in f.name:
                continue
            try:
                if f.suffix != SUFFIX or not f.is_file():
                    raise ValueError("not a prompt-cache file")
                found.append((f.stat().st_mtime_ns, f,
                              *_read_index(f, self.fingerprint, self.kinds)))
            except (OSError, ValueError, KeyError, TypeError, PocketError) as err:
                log.warning("prompt cache: skipping %s: %s", f, err)
        for _, f, dtype, tokens, size, kind in sorted(found, key=lambda x: x[0]):
            key = (dtype, len(tokens), _prefix_hashes(tokens)[-1])
            if key in self._entries:
                continue
            self._clock += 1
            self._entries[key] = _Entry(dtype, tokens, key, self._clock, path=f, disk_bytes=size,
                                        kind=kind)
            by_len = self._lengths.setdefault(dtype, {})
            by_len[len(tokens)] = by_len.get(len(tokens), 0) + 1
            self.disk_used += size
        self._shrink_disk()



def _read_index(f: Path, fingerprint: str, kinds: list[str]
                ) -> tuple[str, tuple[int, ...], int, str]:
    """(dtype, token ids, bytes, snapshot kind) of a cache file, from its header and its
    token array only (a file from before kinds were recorded counts as "end")."""
    n, header = safetensors_header(f)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise ValueError("not a prompt-cache file")
    if meta.get("model") != fingerprint:
        raise ValueError("made for another model")
    layer_kinds = [k for k, _ in json.loads(meta["layers"])]
    if layer_kinds != kinds:
        raise ValueError("layer kinds differ from the model's")
    info = header["tokens"]
    if info["dtype"] != "U32" or len(info["shape"]) != 1:
        raise ValueError("bad token array")
    start, end = info["data_offsets"]
    with open(f, "rb") as fh:
        fh.seek(8 + n + start)
        raw = fh.read(end - start)
    if len(raw) != 4 * info["shape"][0] or not raw:
        raise ValueError("bad token array")
    ids = array("I")  # 4-byte items on every platform MLX runs on
    ids.frombytes(raw)
    if sys.byteorder == "big":  # pragma: no cover - safetensors is little-endian
        ids.byteswap()
    kind = meta.get("kind", "end")
    return str(meta["dtype"]), tuple(ids), f.stat().st_size, \
        kind if kind in SNAPSHOT_KINDS else "end"


def open_store(model, ram_mb: int, folder: Path | None = None, *,
               write_through: bool = False) -> PromptCache | None:
    """The prompt cache of `chat` and `serve`: `ram_mb` MiB in RAM (0: none at all), colder
    entries in `folder` (default `prompt-cache/` in the data folder, which both share; each
    process keeps its own index and budget over it)."""
    if ram_mb <= 0:
        return None
    folder = Path(folder) if folder is not None else data_dir() / "prompt-cache"
    return PromptCache(model, ram_mb << 20, folder, disk_bytes=PROMPT_CACHE_DISK_BYTES,
                       write_through=write_through)
