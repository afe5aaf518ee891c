"""The generation worker behind the server: one thread owns the model and runs every request,
decoding the active ones together (continuous batching).

Why one thread: MLX streams belong to the thread that made them (engine/devices.py), and the
model's caches and the `mx.random` state are not safe to share between threads. The HTTP side
(asyncio) never touches MLX: it tokenizes, then hands a `Job` to this thread through a bounded
queue and reads the job's events (text pieces, then the end) from an asyncio queue.

Continuous batching: up to `max_concurrency` jobs hold a slot; beyond them up to `max_queue`
wait in order, and beyond that `submit` raises `Busy` (HTTP 429 with Retry-After). Each turn of
the loop (1) admits waiting jobs into free slots, (2) runs one prefill chunk of the oldest job
still prefilling (so a long prompt delays the others by a chunk per step, never by its whole
prefill), then its first token alone, exactly as `generate` does, and (3) runs ONE decode step
for every sequence past its first token: one forward of [B, 1] tokens (models/batched.py), in
which every weight matrix is read once for all B. Sequences join after their first token and
leave when they finish, between steps. Each keeps its own sampling parameters, repetition
history and random key (`seed`), so its tokens are those it would get alone: greedy outputs
equal sequential runs bit for bit (tests/test_batched.py, tests/test_server_batch.py).

Decoding is pipelined as in `generation.generate_step`: the next step is queued from the
still-lazy sampled tokens before they are read, so building a step's graph in Python overlaps
the previous step's compute.

Cancelling: a job's `cancel()` (the client went away) is checked after every prefill chunk and
every token it receives, so a generation stops within one step and frees its slot; a job still
waiting is dropped from the queue at once.

Prompt cache: engine/prompt_cache.py's store (built once the model is loaded, from
`prompt_cache_mb` / `prompt_cache_dir`), or any object with its `fetch` / `store` (the
`PromptCache` protocol below; tests plug in their own). `fetch` gives the longest cached
prefix of a prompt, `store` keeps the cache after a reply; `cached_tokens` in the usage is
what `fetch` returned. `NoPromptCache` when it is off.

Distributed (`serve --distributed`, engine/distributed.py): `distributed` is rank 0's
`Lockstep`; loading takes this rank's share, each reply runs on every rank at once (from this
thread, which owns the generation stream), and stopping tells the other ranks to end. No
prompt cache then (each reply starts from a fresh cache on every rank).
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx

from pocket_mlx import kernels
from pocket_mlx.config import checkpoint_dtype, dtype_bytes, read_config
from pocket_mlx.engine import devices
from pocket_mlx.engine.devices import policy_dtype
from pocket_mlx.engine.generation import (
    SamplingParams,
    _cache_arrays,
    _StopText,
    context_limit,
    make_logits_processors,
)
from pocket_mlx.engine.loader import load, model_weight_stats, resolve_model_path, use_device
from pocket_mlx.engine.params import DEFAULT_PREFILL_STEP, SERVE_MAX_CONCURRENCY
from pocket_mlx.engine.prompt_cache import open_store
from pocket_mlx.engine.sampling import KeyedSampler, greedy
from pocket_mlx.engine.snapshot_points import chunk_size, snapshot_points
from pocket_mlx.errors import PocketError
from pocket_mlx.models.batched import DecodeBatch
from pocket_mlx.server.metrics import Metrics
from pocket_mlx.server.openai import ApiError, GenRequest
from pocket_mlx.server.tools import message_boundaries, render_chat
from pocket_mlx.system.host import total_ram_bytes
from pocket_mlx.system.memory import release_free_memory, wired_limit
from pocket_mlx.system.wired import planned_context, serve_ram_bytes


class PromptCache(Protocol):
    """A store of model caches keyed by token prefix, shared by all requests."""

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


@dataclass
class Piece:
    text: str


@dataclass
class Started:
    """Generation began: the prompt's size and how much of it the prompt cache supplied."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Done:
    finish_reason: str | None  # the engine's: eos, stop, length, context, cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_string: str | None = None  # which stop string ended it (finish_reason "stop")


@dataclass
class Failed:
    error: ApiError


class Busy(Exception):
    """No slot and no room in the queue; `retry_after` is a guess in seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("busy")
        self.retry_after = retry_after


class Job:
    """One request's life on the engine thread; its events arrive on `events` (asyncio)."""

    def __init__(self, engine: Engine, ids: list[int], request: GenRequest,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.ids, self.request, self.loop = engine, ids, request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.state = "queued"  # queued | running | done | dropped (guarded by engine._lock)
        self.id = 0  # numbered by `submit`, for the log's prefill progress lines

    def emit(self, event: Started | Piece | Done | Failed) -> None:
        """From the engine thread: hand `event` to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def cancel(self) -> None:
        """The client is gone: stop within one step, or leave the queue now."""
        self.cancelled.set()
        self.engine._drop_if_queued(self)



class _Seq:
    """A running job on the engine thread: its cache, sampling state and reply so far."""

    def __init__(self, job: Job, cache: list, n_cached: int, sampling: SamplingParams,
                 max_tokens: int | None, room: int, tokenizer) -> None:
        ids = job.ids
        self.job, self.ids, self.cache, self.n_cached = job, ids, cache, n_cached
        self.rest = mx.array(ids[n_cached:], mx.uint32)  # prompt tokens not yet fed
        self.fed: list[int] | None = list(ids[n_cached:])  # what the cache consumed
        # Each sequence draws from its own key, as `generate --seed` draws from a freshly seeded
        # global one: the same seed gives the same tokens alone or batched. Greedy draws nothing.
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else \
                int.from_bytes(os.urandom(8), "little") >> 1
            self.sampler = KeyedSampler(seed, sampling.temperature, sampling.top_p,
                                        sampling.min_p, sampling.top_k)
        else:
            self.sampler = greedy
        self.processors = make_logits_processors(sampling)
        self.keep = sampling.repetition_context
        self.history = mx.array(ids[n_cached:][-self.keep:], mx.uint32)
        self.max_tokens = max_tokens  # None: no cap but the window (agents send none)
        self.limit = room if max_tokens is None else min(max_tokens, room)  # may be sampled
        self.text = _StopText(tokenizer, [s for s in (job.request.stop or []) if s])
        self.eos = set(tokenizer.eos_token_ids)
        self.read = 0  # sampled tokens read so far (an EOS included)
        self.n = 0  # reply tokens (no EOS)
        self.unread: mx.array | None = None  # sampled, not yet read
        self.next: mx.array | None = None  # sampled in the step just queued
        self.fed_now = False  # `unread` was fed to the step just queued
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.prefilled = 0  # prompt tokens fed so far (past the cached prefix)
        self.t_prev = 0.0
        # Positions past the cached prefix where prefill stops a chunk and stores a snapshot.
        self.points = deque(snapshot_points(len(ids), job.request.boundaries, n_cached))

    def sample(self, logits: mx.array) -> mx.array:
        """The next token [1] from logits [1, vocab] (lazy), as `generate_step` samples."""
        for proc in self.processors:
            logits = proc(self.history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs)


class Engine:
    """The loaded model, the request queue and the thread that generates."""

    def __init__(self, model: str | None = None, device: str | None = None, *,
                 max_concurrency: int = SERVE_MAX_CONCURRENCY, max_queue: int = 8,
                 default_max_tokens: int | None = None, prompt_cache: PromptCache | None = None,
                 prompt_cache_mb: int = 0, prompt_cache_dir: Path | None = None, log=None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, distributed=None,
                 ctx_size: int | None = None) -> None:
        if max_concurrency < 1:
            raise PocketError(f"--max-concurrency {max_concurrency}: must be 1 or more")
        if distributed is not None and max_concurrency != 1:
            raise PocketError(f"--max-concurrency {max_concurrency}: under --distributed the "
                              "ranks generate one request at a time in lockstep; use 1")
        if max_queue < 0:
            raise PocketError(f"--max-queue {max_queue}: must be 0 or more")
        self.model_ref, self.device_name = model, device
        self.max_concurrency, self.max_queue = max_concurrency, max_queue
        kernels.keep_rows_independent(max_concurrency)
        # None: a request without max_tokens runs to the end of text, a stop or a full window
        # (as llama.cpp's server and Ollama do); a number caps such requests (`--max-tokens`).
        self.default_max_tokens = default_max_tokens
        self.ctx_size = ctx_size  # None: the model's window, capped by the memory planner
        self.context_source = ""
        self.prefill_step = prefill_step
        self.prompt_cache: PromptCache = (prompt_cache if prompt_cache is not None
                                          else NoPromptCache())
        # Without a store given, one is built once the model is loaded (it fingerprints it):
        # RAM up to prompt_cache_mb, spilled to and restored from prompt_cache_dir.
        self._store_args = (prompt_cache_mb, prompt_cache_dir) if prompt_cache is None else None
        self.dist = distributed  # rank 0's distributed.Lockstep, or None
        if distributed is not None:
            self.prompt_cache, self._store_args = NoPromptCache(), None
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0  # running + queued
        self._submitted = 0  # jobs ever queued (their ids)
        self._running = 0
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._avg_s = 5.0  # running mean of a job's time, for Retry-After
        self._thread: threading.Thread | None = None
        self._active: set[Job] = set()  # the jobs holding a slot
        self.model = self.tokenizer = None
        self.model_id = ""
        self.context = 0
        self.device = ""
        self.created = int(time.time())
        self.metrics = Metrics()

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model on the engine thread and wait for it; a load error is raised here."""
        self._thread = threading.Thread(target=self._main, name="pocket-mlx-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def stop(self) -> None:
        """Finish the running jobs' current step, drop the rest, end the thread."""
        with self._lock:
            pending = []
            while True:
                try:
                    pending.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            active = list(self._active)
        for job in pending + active:
            if job is not None:
                job.cancelled.set()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _window(self, path: Path, weight_bytes: int) -> tuple[int, str]:
        """The window served and why: --ctx-size (never past the model's own), else the
        model's own capped by what the memory planner says fits beside the weights (a full
        window must not swap; see system/wired.py `planned_context`)."""
        own = context_limit(self.model)
        if self.ctx_size is not None:
            if self.ctx_size > own:
                raise PocketError(f"--ctx-size {self.ctx_size}: beyond this model's window of "
                                  f"{own} tokens")
            return self.ctx_size, "--ctx-size"
        if self.dist is not None:  # each rank holds a share: this rank's RAM says little
            return own, "the model's window"
        config = read_config(path)
        act = policy_dtype(self.device) or checkpoint_dtype(config)
        budget = (self._store_args[0] << 20) if self._store_args else 0
        n = planned_context(config, own, weight_bytes, total_ram_bytes(), dtype_bytes(act),
                            budget)
        if n == own:
            return own, "the model's window"
        return n, f"what fits in RAM beside the weights; the model's own is {own}"

    def _planned_ram(self, path: Path, weight_bytes: int) -> int:
        """What the memory planner says this server holds with one sequence at a full window
        (system/wired.py `serve_ram_bytes`: the weights as loaded, the cache, the prompt
        cache's share), for /metrics: compared with the measured peak by bench_serve.py."""
        config = read_config(path)
        act = policy_dtype(self.device) or checkpoint_dtype(config)
        budget = (self._store_args[0] << 20) if self._store_args else 0
        return serve_ram_bytes(config, self.context, weight_bytes, dtype_bytes(act), budget)

    def _main(self) -> None:
        try:
            # The loader resolves the device and creates this thread's stream on first use.
            path = resolve_model_path(self.model_ref)
            self.model, self.tokenizer = load(str(path), device=self.device_name, fuse=True,
                                              shard=self.dist.shard if self.dist else None)
            if self.dist is not None:
                self.dist.ready(self.model)
            self.model_id = Path(path).name
            self.device = self.model.device
            weights = model_weight_stats(self.model)
            self.context, self.context_source = self._window(path, weights.bytes_total)
            self.metrics.planned_ram_bytes = self._planned_ram(path, weights.bytes_total)
            self.metrics.bytes_per_token = weights.bytes_per_token
            if self._store_args:
                store = open_store(self.model, *self._store_args)  # (empty: len() is 0)
                if store is not None:
                    self.prompt_cache = store
            use_device(self.model, self.device)
            release_free_memory()  # what loading freed (unfused projections, file buffers)
        except BaseException as e:  # noqa: BLE001 - handed to start(), which raises it
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        stream = devices.stream_for(self.device)
        try:
            with ExitStack() as wired:
                if self.device == "gpu":  # wire the model's memory while serving
                    wired.enter_context(wired_limit(weights.bytes_total, self.device,
                                                    streams=[stream], warn=self.log))
                if self.dist is not None:
                    self._serve_lockstep()
                else:
                    self._serve(stream)
        finally:
            # Entries still only in RAM go to disk (on this thread, which made them), so a
            # restarted server finds them.
            flush = getattr(self.prompt_cache, "flush", None)
            if flush is not None:
                flush()
            if self.dist is not None:
                try:
                    self.dist.finish(self.model)  # the other ranks end too
                except PocketError as e:  # a rank already gone: nothing left to tell
                    self.log(f"pocket-mlx serve: {e}")

    # ---- the loop ----------------------------------------------------------------------------
    def _serve(self, stream: mx.Stream) -> None:
        prefilling: deque[_Seq] = deque()  # in arrival order; the first one prefills
        decoding: list[_Seq] = []  # past their first token
        batch = DecodeBatch(self.model)
        stopping = False
        while True:
            # 1. Waiting jobs take the free slots (blocking only when there is nothing to do).
            while not stopping and len(prefilling) + len(decoding) < self.max_concurrency:
                idle = not prefilling and not decoding
                try:
                    job = self._jobs.get() if idle else self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                if not self._claim(job):
                    continue
                try:
                    with mx.stream(stream):
                        prefilling.append(self._begin(job))
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    self._release(job, self._failure(e))
            if stopping and not prefilling and not decoding:
                return
            self.metrics.prefill_pending(len(prefilling),
                                         sum(int(s.rest.size) for s in prefilling))

            # 2. Prefill: cancelled ones leave; the oldest runs one chunk, or its first token.
            for s in [s for s in prefilling if s.job.cancelled.is_set()]:
                prefilling.remove(s)
                s.fed = None  # the cache is part-way: never stored
                self._finish(s, "cancelled", batch)
            if prefilling:
                s = prefilling[0]
                try:
                    with mx.stream(stream):
                        # The step in flight first, so the time below is the prefill's alone
                        # (/metrics' prefill_seconds_total: decode time = the rest).
                        mx.eval([d.unread for d in decoding])
                        t = time.perf_counter()
                        ready = self._prefill(s)
                        self.metrics.prefill(time.perf_counter() - t)
                except Exception as e:  # noqa: BLE001
                    prefilling.popleft()
                    self._release(s.job, self._failure(e))
                    ready = False
                if ready:
                    prefilling.popleft()
                    decoding.append(s)
                self.metrics.prefill_pending(len(prefilling),
                                             sum(int(s.rest.size) for s in prefilling))

            # 3. One decode step for every sequence that needs another token (pipelined: from
            # the tokens sampled last step, not yet read).
            feed = [s for s in decoding if s.read + 1 < s.limit]
            try:
                with mx.stream(stream):
                    members = batch.set_members(feed)
                    if members:
                        for s in members:
                            if s.processors:
                                s.history = mx.concatenate(
                                    [s.history, s.unread.astype(mx.uint32)])[-s.keep:]
                        logits = batch.step(mx.concatenate(
                            [s.unread.astype(mx.uint32) for s in members]))
                        for i, s in enumerate(members):
                            s.next, s.fed_now = s.sample(logits[i:i + 1]), True
                        mx.async_eval([s.next for s in members])
                        self.metrics.step(len(members))
            except Exception as e:  # noqa: BLE001 - the step failed: so do its sequences
                failure = self._failure(e)
                for s in decoding:
                    self._release(s.job, failure)
                decoding, batch = [], DecodeBatch(self.model)
                continue

            # 4. Read what the previous step sampled; finished sequences leave.
            for s in list(decoding):
                try:
                    reason = self._take(s, s.unread.item())
                    if reason is not None:
                        decoding.remove(s)
                        self._finish(s, reason, batch)
                        continue
                except Exception as e:  # noqa: BLE001
                    decoding.remove(s)
                    if s.fed_now:
                        batch.release(s)
                    self._release(s.job, self._failure(e))
                    continue
                s.unread, s.next, s.fed_now = s.next, None, False

    def _begin(self, job: Job) -> _Seq:
        """A slot's job made ready to prefill: its prompt-cache prefix, its sampling state."""
        ids, req = job.ids, job.request
        sampling = SamplingParams(**req.sampling)
        sampling.validate()
        cache, n_cached = self.prompt_cache.fetch(ids)
        if cache is None or not 0 <= n_cached < len(ids):
            cache, n_cached = self.model.make_cache(), 0
        use_device(self.model, self.device, cache)  # a restored cache in the model's dtypes
        self._reused(len(ids), n_cached)
        s = _Seq(job, cache, n_cached, sampling, req.max_tokens or self.default_max_tokens,
                 self.context - len(ids), self.tokenizer)
        job.emit(Started(len(ids), n_cached))
        if len(ids) - n_cached > self.prefill_step:
            self.log(f"pocket-mlx serve: prefill req {job.id}: {len(ids) - n_cached} of "
                     f"{len(ids)} prompt tokens to prefill ({n_cached} cached), in chunks of "
                     f"up to {self.prefill_step}")
        return s

    def _reused(self, n_prompt: int, n_cached: int) -> None:
        """Count a prompt-cache lookup in /metrics, and log a hit with the kind of snapshot."""
        kind = getattr(self.prompt_cache, "last_kind", None) if n_cached else None
        self.metrics.cache_lookup(n_cached, kind)
        if n_cached:
            self.log(f"pocket-mlx serve: prompt cache: reused {n_cached} of {n_prompt} prompt "
                     f"tokens ({kind or 'unknown'} snapshot)")

    def _prefill(self, s: _Seq) -> bool:
        """One chunk of `s`'s prompt into its cache (all but the last token, as
        `generate_step`), or, once only the last is left, that token alone: its first sampled
        token is then queued and True returned (it joins the batch). A chunk ends at the next
        snapshot point, where the cache is stored (no extra pass: the chunk was due anyway)."""
        if s.rest.size > 1:
            pos = len(s.ids) - s.rest.size
            n = chunk_size(pos, s.rest.size - 1, self.prefill_step,
                           s.points[0][0] if s.points else None)
            t = time.perf_counter()
            self.model(s.rest[:n][None], cache=s.cache)
            mx.eval([a for c in s.cache for a in _cache_arrays(c)])
            s.rest = s.rest[n:]
            if s.points and s.points[0][0] == pos + n:
                _, kind = s.points.popleft()
                try:
                    self.prompt_cache.store(s.ids[:pos + n], s.cache, kind=kind)
                except Exception as e:  # noqa: BLE001 - a snapshot is an optimisation
                    self.log(f"pocket-mlx serve: prompt cache: not stored: "
                             f"{type(e).__name__}: {' '.join(str(e).split())}")
            release_free_memory()  # the chunk's scratch, not kept mapped (system/memory.py)
            # The chunk's time as the other streams wait for it: its snapshot (a copy, maybe
            # a spill to disk) included.
            self._progress(s, n, time.perf_counter() - t)
            return False
        t = time.perf_counter()
        logits = self.model(s.rest[None], cache=s.cache)[:, -1, :]
        s.unread = s.sample(logits)
        mx.eval(s.unread)
        self._progress(s, int(s.rest.size), time.perf_counter() - t)
        return True

    def _progress(self, s: _Seq, n: int, seconds: float) -> None:
        """Account for `n` more prompt tokens of `s` fed in `seconds`: /metrics' counters, and
        for a prompt longer than one chunk a log line per chunk (done/total, rate, ETA), so a
        prefill of minutes on a CPU shows it is moving. The rate is the prompt's own wall
        rate, interleaved decode steps included: the ETA a client will see."""
        s.prefilled += n
        todo = len(s.ids) - s.n_cached
        self.metrics.prefill_chunk(n, seconds)
        if todo <= self.prefill_step:
            return
        wall = time.perf_counter() - s.t0
        rate = s.prefilled / wall if wall > 0 else 0.0
        left = todo - s.prefilled
        eta = f", ETA {_duration(left / rate)}" if left and rate else ", done"
        self.log(f"pocket-mlx serve: prefill req {s.job.id}: {s.n_cached + s.prefilled}/"
                 f"{len(s.ids)} tokens, chunk {n} in {seconds:.2f} s, {rate:.1f} tok/s{eta}")

    def _take(self, s: _Seq, token: int) -> str | None:
        """Account for `s`'s next sampled token (emit its text); the finish reason when this
        token ends the reply (as `stream_generate` decides), else None."""
        s.read += 1
        if s.fed_now:
            s.fed.append(token)
        if token in s.eos:
            return "eos"
        now = time.perf_counter()
        if s.t_first is None:
            s.t_first = now
            self.metrics.first_token(now - s.t0)
        else:
            self.metrics.token(now - s.t_prev)
        s.t_prev = now
        s.n += 1
        piece, stopped = s.text.add(token)
        if piece:
            s.job.emit(Piece(piece))
        if stopped:
            return "stop"
        if s.read >= s.limit:
            capped = s.max_tokens is not None and s.n >= s.max_tokens
            return "length" if capped else "context"
        if s.job.cancelled.is_set():
            return "cancelled"
        return None

    def _finish(self, s: _Seq, reason: str, batch: DecodeBatch) -> None:
        """Close `s`: the held-back text, the metrics, its cache into the prompt cache (before
        the client hears the end, so its next turn finds it), the slot, then `Done`."""
        job = s.job
        if reason != "stop" and s.fed is not None and (tail := s.text.flush()):
            job.emit(Piece(tail))
        tps = (s.n - 1) / (time.perf_counter() - s.t_first) if s.n > 1 else 0.0
        self.metrics.reply(len(s.ids), s.n, tps, reason == "cancelled")
        # fed is None only when the cache was left part-way (cancelled in prefill); a reply
        # cancelled while decoding still leaves a cache worth keeping for a retry.
        if s.fed is not None:
            if s.fed_now:
                batch.release(s)  # its linear states, this last step included
            try:
                self.prompt_cache.store(s.ids[:s.n_cached] + s.fed, s.cache)
            except Exception as e:  # noqa: BLE001 - the reply is complete: a cache that
                # could not be kept costs a later prefill, not this answer
                self.log(f"pocket-mlx serve: prompt cache: not stored: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}")
        stop_string = s.text.hit if reason == "stop" else None
        self._release(job, Done(reason, len(s.ids), s.n, s.n_cached, stop_string),
                      time.perf_counter() - s.t0)

    def _failure(self, e: Exception) -> Failed:
        if isinstance(e, PocketError):
            return Failed(ApiError(400, str(e), code="invalid_value"))
        self.log(f"pocket-mlx serve: generation failed: {type(e).__name__}: "
                 f"{' '.join(str(e).split())}")
        return Failed(ApiError(500, "internal error while generating; see the server's log",
                               type="server_error", code="internal_error"))

    def _release(self, job: Job, final: Done | Failed, seconds: float | None = None) -> None:
        """Free `job`'s slot, then send its last event: its next request finds the slot free."""
        if seconds is not None:
            self._avg_s = 0.8 * self._avg_s + 0.2 * seconds
        with self._lock:
            job.state = "done"
            self._active.discard(job)
            self._running -= 1
            self._admitted -= 1
        job.emit(final)

    def _claim(self, job: Job) -> bool:
        """Give `job` a slot; False when its client left while it waited (dropped)."""
        with self._lock:
            if job.state == "dropped":
                return False
            job.state = "running"
            self._running += 1
            self._active.add(job)
        return True

    # ---- distributed: one request at a time, the other ranks in lockstep ----------------------
    def _serve_lockstep(self) -> None:
        """Under --distributed every forward is collective, so the ranks must run the same
        requests step for step: one at a time (the batched loop above stays one-process)."""
        while (job := self._next_job()) is not None:
            if not self._claim(job):
                continue
            t0 = time.perf_counter()
            final: Done | Failed
            try:
                final = self._run_lockstep(job)
            except Exception as e:  # noqa: BLE001 - one request failed, the server goes on
                final = self._failure(e)
            self._release(job, final, time.perf_counter() - t0)

    def _next_job(self) -> Job | None:
        """The next job (None: stop): wait at most to the ranks' next beat, and tell them when
        there is nothing (see distributed.BEAT_S)."""
        while True:
            try:
                return self._jobs.get(timeout=self.dist.until_beat())
            except queue.Empty:
                self.dist.idle(self.model)

    # ---- requests --------------------------------------------------------------------------
    def encode(self, request: GenRequest) -> list[int]:
        """The prompt's token ids (chat template for chat, plain text or ids for completions);
        a prompt that leaves no room in the context is a 400. Safe off the engine thread: it
        only reads the tokenizer."""
        tok = self.tokenizer
        try:
            if request.kind == "chat":
                for m in request.messages or []:
                    _utf8(m["content"], "messages")
                ids = tok.encode(render_chat(tok, request), add_special_tokens=False)
                # Computed with the cache off too: prefill chunks end at these points, and the
                # same chunks with and without the cache give bit-identical states (a chunk
                # split elsewhere rounds differently, and can change a greedy reply).
                request.boundaries = message_boundaries(tok, request, ids)
            elif isinstance(request.prompt, str):
                ids = tok.encode(_utf8(request.prompt, "prompt"))
            else:
                ids = list(request.prompt or [])
                # Both bounds: an id past the model's embedding table would read out of it.
                vocab = min(tok.vocab_size, int(self.model.args.vocab_size))
                if any(t >= vocab for t in ids):
                    raise ApiError(400, f"prompt: token ids must be below the vocabulary size "
                                        f"{vocab}", param="prompt", code="invalid_value")
        except PocketError as e:  # the chat template refused the conversation
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", code="invalid_value")
        if len(ids) >= self.context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is "
                                f"{self.context} tokens, and the reply needs at least one: "
                                "shorten the prompt", code="context_length_exceeded")
        return ids

    def submit(self, ids: list[int], request: GenRequest,
               loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job, or raise `Busy` when `max_concurrency + max_queue` are taken."""
        with self._lock:
            if self._admitted >= self.max_concurrency + self.max_queue:
                waiting = self._admitted - self._running
                # Slots free up max_concurrency at a time, a job's mean time apart.
                raise Busy(max(1, round(self._avg_s * (waiting + 1) / self.max_concurrency)))
            self._admitted += 1
            job = Job(self, ids, request, loop)
            self._submitted += 1
            job.id = self._submitted
            self._jobs.put(job)
        return job

    def _drop_if_queued(self, job: Job) -> None:
        with self._lock:
            if job.state == "queued":
                job.state = "dropped"
                self._admitted -= 1

    def load(self) -> dict:
        """Active and waiting requests, for /health."""
        with self._lock:
            return {"active": self._running, "queued": self._admitted - self._running,
                    "max_concurrency": self.max_concurrency, "max_queue": self.max_queue}

    def _run_lockstep(self, job: Job) -> Done:
        """Generate `job`'s reply, emitting its pieces; returns the closing event."""
        ids, req = job.ids, job.request
        cache, n_cached = self.prompt_cache.fetch(ids)
        if cache is None or not 0 <= n_cached < len(ids):
            cache, n_cached = self.model.make_cache(), 0
        self._reused(len(ids), n_cached)
        job.emit(Started(len(ids), n_cached))
        sampling = SamplingParams(**req.sampling)
        last, t_token = None, None
        for r in self.dist.stream_generate(
                self.model, self.tokenizer, ids[n_cached:], cache=cache,
                max_tokens=(req.max_tokens or self.default_max_tokens
                            or max(1, self.context - len(ids))), sampling=sampling,
                stop=req.stop, device=self.device, should_stop=job.cancelled.is_set,
                warn=self.log):
            if r.token is not None:
                now = time.perf_counter()
                if t_token is None:
                    self.metrics.first_token(r.stats.ttft_s)
                else:
                    self.metrics.token(now - t_token)
                t_token = now
            if r.text:
                job.emit(Piece(r.text))
            last = r
        stats = last.stats
        self.metrics.reply(len(ids), stats.generation_tokens, stats.generation_tps,
                           stats.finish_reason == "cancelled")
        # fed_tokens is None only when the cache was left part-way (cancelled in prefill); a
        # reply cancelled while decoding still leaves a cache worth keeping for a retry.
        if last.fed_tokens is not None:
            try:
                self.prompt_cache.store(ids[:n_cached] + last.fed_tokens, cache)
            except Exception as e:  # noqa: BLE001 - the reply is complete: a cache that
                # could not be kept costs a later prefill, not this answer
                self.log(f"pocket-mlx serve: prompt cache: not stored: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}")
        return Done(stats.finish_reason, len(ids), stats.generation_tokens, n_cached,
                    stats.stop_string)


def _duration(seconds: float) -> str:
    """A log line's ETA: seconds below two minutes, else minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _utf8(text: str, where: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate, which is not "
                            "valid Unicode", param=where, code="invalid_value") from None
    return text
