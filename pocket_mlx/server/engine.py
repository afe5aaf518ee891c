"""The generation worker behind the server: one thread owns the model and runs every request.

Why one thread: MLX streams belong to the thread that made them (engine/devices.py), and the
model's caches and the `mx.random` state are not safe to share between threads. The HTTP side
(asyncio) never touches MLX: it tokenizes, then hands a `Job` to this thread through a bounded
queue and reads the job's events (text pieces, then the end) from an asyncio queue.

This slice decodes ONE sequence at a time: `max_concurrency` must be 1, and up to `max_queue`
more requests wait their turn in order; beyond that `submit` raises `Busy` (HTTP 429).
Batched decode of several sequences per step is later work.

Cancelling: a job's `cancel()` (the client went away) is checked by `stream_generate` after
every prefill chunk and every token, so a generation stops within one step and frees its slot;
a job still waiting is dropped from the queue at once.

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
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pocket_mlx.engine.generation import SamplingParams, context_limit, stream_generate
from pocket_mlx.engine.loader import load, model_weight_stats, resolve_model_path
from pocket_mlx.engine.prompt_cache import open_store
from pocket_mlx.errors import PocketError
from pocket_mlx.server.metrics import Metrics
from pocket_mlx.server.openai import ApiError, GenRequest
from pocket_mlx.server.tools import render_chat


class PromptCache(Protocol):
    """A store of model caches keyed by token prefix, shared by all requests."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list | None, int]:
        """(a cache holding the first `n` tokens of `tokens`, n) for the longest stored prefix
        with n < len(tokens) (at least one token must be left to prefill), or (None, 0). The
        caller owns the returned cache and will extend it."""
        ...

    def store(self, tokens: Sequence[int], cache: list) -> None:
        """Keep `cache`, which holds exactly `tokens`, for later requests."""
        ...


class NoPromptCache:
    """No reuse: every request prefills its whole prompt (cached_tokens is 0)."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list | None, int]:
        return None, 0

    def store(self, tokens: Sequence[int], cache: list) -> None:
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


class Engine:
    """The loaded model, the request queue and the thread that generates."""

    def __init__(self, model: str | None = None, device: str | None = None, *,
                 max_concurrency: int = 1, max_queue: int = 8, default_max_tokens: int = 512,
                 prompt_cache: PromptCache | None = None, prompt_cache_mb: int = 0,
                 prompt_cache_dir: Path | None = None, log=None, distributed=None) -> None:
        if max_concurrency != 1:
            raise PocketError(f"--max-concurrency {max_concurrency}: this version generates "
                              "one request at a time (batched decode is not built yet); use 1, "
                              "and --max-queue for the requests that wait")
        if max_queue < 0:
            raise PocketError(f"--max-queue {max_queue}: must be 0 or more")
        self.model_ref, self.device_name = model, device
        self.max_concurrency, self.max_queue = max_concurrency, max_queue
        self.default_max_tokens = default_max_tokens
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
        self._running = 0
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._avg_s = 5.0  # running mean of a job's time, for Retry-After
        self._thread: threading.Thread | None = None
        self._current: Job | None = None  # the job generating now
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
        """Finish the running job's current step, drop the rest, end the thread."""
        with self._lock:
            pending = []
            while True:
                try:
                    pending.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
        for job in pending:
            if job is not None:
                job.cancelled.set()
        if self._current is not None:
            self._current.cancelled.set()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _main(self) -> None:
        try:
            # The loader resolves the device and creates this thread's stream on first use.
            path = resolve_model_path(self.model_ref)
            self.model, self.tokenizer = load(str(path), device=self.device_name, fuse=True,
                                              shard=self.dist.shard if self.dist else None)
            if self.dist is not None:
                self.dist.ready(self.model)
            self.model_id = Path(path).name
            self.context = context_limit(self.model)
            self.device = self.model.device
            self.metrics.bytes_per_token = model_weight_stats(self.model).bytes_per_token
            if self._store_args:
                store = open_store(self.model, *self._store_args)  # (empty: len() is 0)
                if store is not None:
                    self.prompt_cache = store
        except BaseException as e:  # noqa: BLE001 - handed to start(), which raises it
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
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

    def _serve(self) -> None:
        while (job := self._take()) is not None:
            with self._lock:
                if job.state == "dropped":
                    continue
                job.state = "running"
                self._running += 1
                self._current = job
            t0 = time.perf_counter()
            final: Done | Failed
            try:
                final = self._run(job)
            except PocketError as e:
                final = Failed(ApiError(400, str(e), code="invalid_value"))
            except Exception as e:  # noqa: BLE001 - one request failed, the server goes on
                self.log(f"pocket-mlx serve: generation failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}")
                final = Failed(ApiError(500, "internal error while generating; see the "
                                             "server's log", type="server_error",
                                        code="internal_error"))
            self._avg_s = 0.8 * self._avg_s + 0.2 * (time.perf_counter() - t0)
            # The slot is free before the client hears the end: its next request finds it so.
            with self._lock:
                job.state = "done"
                self._current = None
                self._running -= 1
                self._admitted -= 1
            job.emit(final)

    def _take(self) -> Job | None:
        """The next job (None: stop). Distributed: wait at most to the ranks' next beat, and
        tell them when there is nothing (see distributed.BEAT_S)."""
        if self.dist is None:
            return self._jobs.get()
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
                raise Busy(max(1, round(self._avg_s * (waiting + 1))))
            self._admitted += 1
            job = Job(self, ids, request, loop)
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

    def _run(self, job: Job) -> Done:
        """Generate `job`'s reply, emitting its pieces; returns the closing event."""
        ids, req = job.ids, job.request
        cache, n_cached = self.prompt_cache.fetch(ids)
        if cache is None or not 0 <= n_cached < len(ids):
            cache, n_cached = self.model.make_cache(), 0
        self.metrics.cache_lookup(n_cached)
        job.emit(Started(len(ids), n_cached))
        sampling = SamplingParams(**req.sampling)
        last, t_token = None, None
        generate = self.dist.stream_generate if self.dist is not None else stream_generate
        for r in generate(self.model, self.tokenizer, ids[n_cached:], cache=cache,
                          max_tokens=req.max_tokens or self.default_max_tokens,
                          sampling=sampling, stop=req.stop, device=self.device,
                          should_stop=job.cancelled.is_set, warn=self.log):
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


def _utf8(text: str, where: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate, which is not "
                            "valid Unicode", param=where, code="invalid_value") from None
    return text
