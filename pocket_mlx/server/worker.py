"""The serve worker (`ServeWorker`): one thread owns the model and runs every request of the
server, decoding the active ones together (continuous batching).

Why one thread: MLX streams belong to the thread that made them (engine/devices.py), and the
model's caches and the `mx.random` state are not safe to share between threads. The HTTP side
(asyncio) never touches MLX: it tokenizes, then hands a `Job` to this thread through a bounded
queue and reads the job's events (text pieces, then the end) from an asyncio queue.

Continuous batching: up to `max_concurrency` jobs hold a slot; beyond them up to `max_queue`
wait in order, and beyond that `submit` raises `Busy` (HTTP 429 with Retry-After). Each turn of
the loop admits waiting jobs into free slots, then runs one step of engine/batch.py's
`BatchDecoder` (a prefill chunk of the oldest prompt, one decode step of all the others) and
hands its events to their jobs. The thread itself is engine/worker.py's `ModelWorker`.

Cancelling: a job's `cancel()` (the client went away) is checked after every prefill chunk and
every token it receives, so a generation stops within one step and frees its slot; a job still
waiting is dropped from the queue at once.

Prompt cache: engine/prompt_cache.py's store (built once the model is loaded, from
`prompt_cache_mb` / `prompt_cache_dir`), or any object with its `fetch` / `store` (the
`PrefixStore` protocol in engine/prompt_cache.py; tests plug in their own). `fetch` gives the longest cached
prefix of a prompt, `store` keeps the cache after a reply; `cached_tokens` in the usage is
what `fetch` returned. `NoPromptCache` when it is off.

Distributed (`serve --distributed`, engine/distributed/): `distributed` is rank 0's
`Lockstep`; loading takes this rank's share, each reply runs on every rank at once (from this
thread, which owns the generation stream: engine/batch.py's `decode_lockstep`, whose events
are handled as the batch's), and stopping tells the other ranks to end. No prompt cache then (each reply starts from a fresh cache on every rank).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import mlx.core as mx

from pocket_mlx import kernels
from pocket_mlx.config import checkpoint_dtype, dtype_bytes, text_config
from pocket_mlx.engine import batch as batch_events
from pocket_mlx.engine import devices
from pocket_mlx.engine.batch import BatchDecoder, decode_lockstep
from pocket_mlx.engine.devices import policy_dtype
from pocket_mlx.engine.drafters import DEFAULT_NUM_DRAFT_TOKENS, make_drafter
from pocket_mlx.engine.embedding import mean_pooled
from pocket_mlx.engine.generation import SamplingParams, context_limit
from pocket_mlx.engine.loader import (
    load,
    model_weight_stats,
    open_folder,
    resolve_model_path,
    use_device,
)
from pocket_mlx.engine.params import DEFAULT_PREFILL_STEP, SERVE_MAX_CONCURRENCY
from pocket_mlx.engine.prompt_cache import NoPromptCache, PrefixStore, open_store
from pocket_mlx.engine.worker import EMPTY, ModelWorker
from pocket_mlx.errors import PocketError, one_line
from pocket_mlx.server.jobs import (
    Busy,
    Done,
    Embedding,
    Failed,
    Job,
    Piece,
    Started,
)
from pocket_mlx.server.metrics import Metrics
from pocket_mlx.server.prompts import encode_request
from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.system.host import total_ram_bytes
from pocket_mlx.system.memory import release_free_memory, resident_bytes, wired_limit
from pocket_mlx.system.wired import planned_context, serve_ram_bytes

log = logging.getLogger(__name__)


class ServeWorker:
    """The loaded model, the request queue and the thread that generates."""

    def __init__(self, model: str | None = None, device: str | None = None, *,
                 max_concurrency: int = SERVE_MAX_CONCURRENCY, max_queue: int = 8,
                 default_max_tokens: int | None = None, prompt_cache: PrefixStore | None = None,
                 prompt_cache_mb: int = 0, prompt_cache_dir: Path | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, distributed=None,
                 ctx_size: int | None = None, speculative: str = "off",
                 num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
                 reasoning: bool | None = None, reasoning_budget: int | None = None,
                 sampling: dict | None = None) -> None:
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
        # `serve --speculative`: greedy requests decode by speculation while alone in the
        # batch (engine/batch.py); not under --distributed (the lockstep loop decodes plainly).
        self.speculative = "off" if distributed is not None else speculative
        self.num_draft_tokens = num_draft_tokens
        # `serve --reasoning on|off|auto` (None: the template's default) and
        # `--reasoning-budget`: what a request that sets neither gets.
        self.reasoning, self.reasoning_budget = reasoning, reasoning_budget
        # `serve --temp/--top-p/...`: what a request that does not set them gets.
        self.sampling_defaults = sampling or {}
        self.prompt_cache: PrefixStore = (prompt_cache if prompt_cache is not None
                                          else NoPromptCache())
        # Without a store given, one is built once the model is loaded (it fingerprints it):
        # RAM up to prompt_cache_mb, spilled to and restored from prompt_cache_dir.
        self._store_args = (prompt_cache_mb, prompt_cache_dir) if prompt_cache is None else None
        self.dist = distributed  # rank 0's distributed.Lockstep, or None
        if distributed is not None:
            self.prompt_cache, self._store_args = NoPromptCache(), None
        self._worker = ModelWorker(self._load, lockstep=distributed)
        self._lock = threading.Lock()
        self._admitted = 0  # running + queued
        self._submitted = 0  # jobs ever queued (their ids)
        self._running = 0
        self._avg_s = 5.0  # running mean of a job's time, for Retry-After
        self._path: Path | None = None
        self._active: set[Job] = set()  # the jobs holding a slot
        self.model = self.tokenizer = None
        self.model_id = ""
        self.about: dict = {}  # the served build, for Ollama's /api/tags and /api/show
        self.context = 0
        self.device = ""
        self.created = int(time.time())
        self.metrics = Metrics()

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model on the engine thread and wait for it; a load error is raised here."""
        self._worker.start(self._serve_all, self._setup)

    def stop(self) -> None:
        """Finish the running jobs' current step, drop the rest, end the thread."""
        with self._lock:
            pending = self._worker.drain()
            active = list(self._active)
        for job in pending + active:
            if job is not None:
                job.cancelled.set()
        self._worker.put(None)
        self._worker.join(timeout=30)

    def _load(self) -> tuple:
        # The loader resolves the device and creates this thread's stream on first use.
        # The folder is resolved and read once here; the rest of the load is handed it.
        self._path = resolve_model_path(self.model_ref)
        shard = self.dist.shard if self.dist else None
        folder = open_folder(self._path, getattr(shard, "group", None))
        return load(folder, device=self.device_name, fuse=True, shard=shard)

    def _setup(self, model, tokenizer) -> int:
        """After loading: the window, the metrics' weights, the prompt-cache store."""
        self.model, self.tokenizer = model, tokenizer
        make_drafter(self.speculative, model)  # `mtp` without a head: one line, before serving
        self.model_id = Path(self._path).name
        self.device = self.model.device
        weights = model_weight_stats(self.model)
        self.about = _about(model, weights, Path(self._path))
        self.context, self.context_source = self._window(model.config, weights.bytes_total)
        self.metrics.bytes_per_token = weights.bytes_per_token
        if self._store_args:
            store = open_store(self.model, *self._store_args)  # (empty: len() is 0)
            if store is not None:
                self.prompt_cache = store
        use_device(self.model, self.device)
        release_free_memory()  # what loading freed (unfused projections, file buffers)
        # The planner's figure plus what this process holds besides the weights once loaded
        # (Python, MLX, the tokenizer, the web server), measured here rather than guessed.
        rss = resident_bytes()
        base = max(0, rss - weights.bytes_total) if rss is not None else 0
        self.metrics.planned_ram_bytes = self._planned_ram(model.config, weights.bytes_total) + base
        return weights.bytes_total

    def _planned_ram(self, config: dict, weight_bytes: int) -> int:
        """What the memory planner says this server holds with one sequence at a full window
        (system/wired.py `serve_ram_bytes`: the weights as loaded, the cache, the prompt
        cache's share), for /metrics (with the process's own base added by the caller):
        compared with the measured peak by bench_serve.py."""
        act = policy_dtype(self.device) or checkpoint_dtype(config)
        budget = (self._store_args[0] << 20) if self._store_args else 0
        return serve_ram_bytes(config, self.context, weight_bytes, dtype_bytes(act), budget)

    def _window(self, config: dict, weight_bytes: int) -> tuple[int, str]:
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
        act = policy_dtype(self.device) or checkpoint_dtype(config)
        budget = (self._store_args[0] << 20) if self._store_args else 0
        n = planned_context(config, own, weight_bytes, total_ram_bytes(), dtype_bytes(act),
                            budget)
        if n == own:
            return own, "the model's window"
        return n, f"what fits in RAM beside the weights; the model's own is {own}"

    def _serve_all(self, weight_bytes: int) -> None:
        stream = devices.stream_for(self.device)
        try:
            with ExitStack() as wired:
                if self.device == "gpu":  # wire the model's memory while serving
                    wired.enter_context(wired_limit(weight_bytes, self.device,
                                                    streams=[stream], warn=log.warning))
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

    # ---- the loop ----------------------------------------------------------------------------
    def _serve(self, stream: mx.Stream) -> None:
        """Admit waiting jobs into free slots (blocking only when there is nothing to do),
        then one step of the batch (engine/batch.py), its events to their jobs."""
        batch = BatchDecoder(self.model, self.tokenizer, stream=stream, store=self.prompt_cache,
                             prefill_step=self.prefill_step, speculative=self.speculative,
                             num_draft_tokens=self.num_draft_tokens)
        jobs: dict[int, Job] = {}  # uid -> job
        stopping = False
        while True:
            while not stopping and len(batch) < self.max_concurrency:
                job = self._worker.get(block=not batch)
                if job is EMPTY:
                    break
                if job is None:
                    stopping = True
                    break
                if isinstance(job, Embedding):  # between batch steps, without a slot
                    self._embed(job, stream)
                    continue
                if not self._claim(job):
                    continue
                try:
                    with mx.stream(stream):
                        jobs[self._begin(batch, job)] = job
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    self._release(job, self._failure(e))
            if stopping and not batch:
                return
            self.metrics.prefill_pending(*batch.pending())
            events = batch.step()
            self.metrics.prefill_pending(*batch.pending())
            if batch.prefill_s is not None:
                self.metrics.prefill(batch.prefill_s)
            if batch.batch_size:
                self.metrics.step(batch.batch_size)
            if batch.drafted:
                self.metrics.speculative(batch.drafted, batch.accepted)
            for ev in events:
                self._on_event(jobs, ev)

    def _begin(self, batch: BatchDecoder, job: Job) -> int:
        """A slot's job into the batch: its prompt-cache prefix, its sampling state."""
        ids, req = job.ids, job.request
        # Checked where the request was parsed (server/requests.py `Sampling.checked`).
        sampling = SamplingParams(**req.sampling.keywords())
        cache, n_cached = self._fetch(ids)
        use_device(self.model, self.device, cache)  # a restored cache in the model's dtypes
        uid = batch.insert(ids, cache=cache, n_cached=n_cached, sampling=sampling,
                           max_tokens=req.max_tokens or self.default_max_tokens,
                           room=self.context - len(ids), stop=req.stop or [],
                           boundaries=req.boundaries, cancelled=job.cancelled.is_set,
                           thinking=req.reasoning_open, reasoning_budget=req.reasoning_budget)
        job.emit(Started(len(ids), n_cached))
        if len(ids) - n_cached > self.prefill_step:
            log.info(f"prefill req {job.id}: {len(ids) - n_cached} of {len(ids)} prompt tokens "
                     f"to prefill ({n_cached} cached), in chunks of up to {self.prefill_step}")
        return uid

    def _on_event(self, jobs: dict[int, Job], ev: batch_events.Event) -> None:
        """A batch event to its job: text, metrics, and at the end the slot and `Done`."""
        if isinstance(ev, batch_events.Prefilled):
            self._progress(jobs[ev.uid], ev)
            return
        if isinstance(ev, batch_events.Token):
            if ev.first:
                self.metrics.first_token(ev.seconds)
            else:
                self.metrics.token(ev.seconds)
            if ev.text or ev.reasoning:
                jobs[ev.uid].emit(Piece(ev.text, ev.reasoning))
            return
        job = jobs.pop(ev.uid)
        if isinstance(ev, batch_events.Failed):
            self._release(job, self._failure(ev.error))
            return
        if ev.text or ev.reasoning:
            job.emit(Piece(ev.text, ev.reasoning))
        self.metrics.reply(ev.prompt_tokens, ev.completion_tokens, ev.tps,
                           ev.reason == "cancelled")
        self._release(job, Done(ev.reason, ev.prompt_tokens, ev.completion_tokens,
                                ev.cached_tokens, ev.stop_string, ev.reasoning_tokens),
                      ev.seconds)

    def _fetch(self, ids: list[int]) -> tuple[list, int]:
        """The prompt cache's longest prefix of `ids` (else a fresh cache), counted in /metrics
        and logged when it hits."""
        cache, n_cached = self.prompt_cache.fetch(ids)
        if cache is None or not 0 <= n_cached < len(ids):
            cache, n_cached = self.model.make_cache(), 0
        self._reused(len(ids), n_cached)
        return cache, n_cached

    def _progress(self, job: Job, ev: batch_events.Prefilled) -> None:
        """/metrics' prefill counters, and for a prompt longer than one chunk a log line per
        chunk (done/total, rate, ETA), so a prefill of minutes on a CPU shows it is moving.
        The rate is the prompt's own wall rate, interleaved decode steps included: the ETA a
        client will see."""
        self.metrics.prefill_chunk(ev.tokens, ev.seconds)
        todo = ev.total - ev.cached
        if todo <= self.prefill_step:
            return
        prefilled = ev.done - ev.cached
        rate = prefilled / ev.wall_s if ev.wall_s > 0 else 0.0
        left = todo - prefilled
        eta = f", ETA {_duration(left / rate)}" if left and rate else ", done"
        log.info(f"prefill req {job.id}: {ev.done}/{ev.total} tokens, chunk {ev.tokens} in "
                 f"{ev.seconds:.2f} s, {rate:.1f} tok/s{eta}")

    def _reused(self, n_prompt: int, n_cached: int) -> None:
        """Count a prompt-cache lookup in /metrics, and log a hit with the kind of snapshot."""
        kind = getattr(self.prompt_cache, "last_kind", None) if n_cached else None
        self.metrics.cache_lookup(n_cached, kind)
        if n_cached:
            log.info(f"prompt cache: reused {n_cached} of {n_prompt} prompt tokens "
                     f"({kind or 'unknown'} snapshot)")

    def _failure(self, e: Exception) -> Failed:
        if isinstance(e, PocketError):
            return Failed(ApiError(400, str(e), code="invalid_value"))
        log.error(f"generation failed: {type(e).__name__}: {one_line(e)}")
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
        while (job := self._worker.get()) is not None:
            if not self._claim(job):
                continue
            jobs, t0 = {0: job}, time.perf_counter()
            try:
                ids, req = job.ids, job.request
                cache, n_cached = self._fetch(ids)
                job.emit(Started(len(ids), n_cached))
                for ev in decode_lockstep(
                        self.dist, self.model, self.tokenizer, ids, uid=0, cache=cache,
                        n_cached=n_cached, sampling=SamplingParams(**req.sampling.keywords()),
                        max_tokens=(req.max_tokens or self.default_max_tokens
                                    or max(1, self.context - len(ids))),
                        stop=req.stop, device=self.device, cancelled=job.cancelled.is_set,
                        store=self.prompt_cache):
                    self._on_event(jobs, ev)
            except Exception as e:  # noqa: BLE001 - one request failed, the server goes on
                if jobs:  # (not yet released)
                    self._release(job, self._failure(e), time.perf_counter() - t0)

    # ---- requests --------------------------------------------------------------------------
    def encode(self, request: GenRequest) -> list[int]:
        """The prompt's token ids (server/prompts.py); a 400 `ApiError` when it cannot be
        served. Safe off the engine thread: it only reads the tokenizer."""
        vocab = min(self.tokenizer.vocab_size, int(self.model.args.vocab_size))
        if request.thinking is None:
            request.thinking = self.reasoning
        if request.reasoning_budget is None:
            request.reasoning_budget = self.reasoning_budget
        if self.sampling_defaults:
            request.sampling = request.sampling.under(self.sampling_defaults)
        return encode_request(self.tokenizer, request, self.context, vocab)

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
            self._worker.put(job)
        return job

    def embed(self, inputs: list[list[int]], loop: asyncio.AbstractEventLoop) -> Embedding:
        """Queue an embedding request (engine/embedding.py): it waits its turn with the
        generation requests, then runs between two batch steps."""
        if self.dist is not None:
            raise ApiError(501, "embeddings are not available under --distributed",
                           code="not_implemented")
        job = Embedding(inputs, loop)
        self._worker.put(job)
        return job

    def _embed(self, job: Embedding, stream: mx.Stream) -> None:
        if job.cancelled.is_set():
            return
        t0 = time.perf_counter()
        try:
            with mx.stream(stream):
                vectors = [mean_pooled(self.model, ids, self.model.make_cache(),
                                       self.prefill_step) for ids in job.inputs]
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            job.finish(None, self._failure(e).error)
            return
        job.finish(vectors, seconds=time.perf_counter() - t0)

    def drop_if_queued(self, job: Job) -> None:
        """`job`'s client left while it waited: its place in the queue is free."""
        with self._lock:
            if job.state == "queued":
                job.state = "dropped"
                self._admitted -= 1

    def load(self) -> dict:
        """Active and waiting requests, for /health."""
        with self._lock:
            return {"active": self._running, "queued": self._admitted - self._running,
                    "max_concurrency": self.max_concurrency, "max_queue": self.max_queue}


def _duration(seconds: float) -> str:
    """A log line's ETA: seconds below two minutes, else minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _about(model, weights, path: Path) -> dict:
    """The served build as Ollama's /api/tags and /api/show describe it."""
    config = getattr(model, "config", {}) or {}
    folder = getattr(model, "folder", None)
    try:
        modified = (path / "config.json").stat().st_mtime
    except OSError:
        modified = None
    return {"modified": modified, "name": path.name, "path": str(path), "family": config.get("model_type", ""),
            "parameters": weights.params_total, "bytes": weights.bytes_total,
            "quantization": folder.recipe_label if folder is not None else "",
            "hidden_size": text_config(config).get("hidden_size")}
