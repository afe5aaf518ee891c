"""What passes between the server's HTTP side and the serve worker (server/worker.py): a
request's `Job`, the worker's events (`Started`, `Piece`, then `Done` or `Failed`), the `Busy`
refusal; the one reply event stream every wire format renders (`Started`, `Reasoning`,
`Text`, `Call`, then `Done` — usage and finish — or `Failed`); `Worker`, what the HTTP side
may ask of the worker; and `Embedding`, an embedding request for the model's thread (run
between two batch steps: server/routes_embeddings.py).

Why apart from the worker: the HTTP handlers need these types, not the model's thread (whose
module loads MLX). (The prompt-cache protocol the worker reads and writes, `PrefixStore`, is
engine/prompt_cache.py's.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.server.tools import ToolCall


@dataclass
class Piece:
    """Reply text as the engine read it: the answer's (tool calls not yet apart) and, for a
    thinking model, the reasoning's (the engine splits the block off: engine/reasoning.py)."""

    text: str
    reasoning: str = ""


@dataclass
class Started:
    """Generation began: the prompt's size and how much of it the prompt cache supplied."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Done:
    """The end: why, and the usage."""

    finish_reason: str | None  # the engine's: eos, stop, length, context, cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_string: str | None = None  # which stop string ended it (finish_reason "stop")
    reasoning_tokens: int = 0  # of completion_tokens, those inside the reasoning block
    # Measured on the model's thread (`Job.emit`): seconds from `Started` to the first reply
    # text (the prompt's evaluation and the first token) and to this end.
    first_s: float | None = None
    seconds: float | None = None


@dataclass
class Failed:
    error: ApiError


@dataclass
class Text:
    """Answer text, with reasoning and tool calls taken out."""

    text: str


@dataclass
class Reasoning:
    """Reasoning text (a thinking model's block), without its tags."""

    text: str


@dataclass
class Call:
    """One whole tool call, `index` its place among the reply's calls."""

    call: ToolCall
    index: int


ReplyEvent = Started | Reasoning | Text | Call | Done | Failed


@dataclass
class Whole:
    """A reply read to its end: what a non-streaming response is made of."""

    text: str
    calls: list[ToolCall]
    done: Done
    reasoning: str = ""
    parts: list = field(default_factory=list)  # the Reasoning / Text / Call events in order


class Busy(Exception):
    """No slot and no room in the queue; `retry_after` is a guess in seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("busy")
        self.retry_after = retry_after


class Worker(Protocol):
    """What the HTTP side reads of and asks from the serve worker."""

    model_id: str
    device: str
    context: int
    created: int
    tokenizer: object
    prompt_cache: object
    metrics: object

    about: dict  # the served build: name, family, parameters, bytes, quantization, ...

    def encode(self, request: GenRequest) -> list[int]: ...

    def embed(self, inputs: list[list[int]], loop: asyncio.AbstractEventLoop) -> Embedding: ...

    def submit(self, ids: list[int], request: GenRequest,
               loop: asyncio.AbstractEventLoop) -> Job: ...

    def drop_if_queued(self, job: Job) -> None: ...

    def load(self) -> dict: ...


class Job:
    """One request's life on the worker's thread; its events arrive on `events` (asyncio)."""

    def __init__(self, worker: Worker, ids: list[int], request: GenRequest,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.worker, self.ids, self.request, self.loop = worker, ids, request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.state = "queued"  # queued | running | done | dropped (guarded by worker._lock)
        self.id = 0  # numbered by `submit`, for the log's prefill progress lines
        self.started_at: float | None = None  # when `Started` was emitted (perf_counter)
        self.first_at: float | None = None  # when the first reply text was

    def emit(self, event: Started | Piece | Done | Failed) -> None:
        """From the worker's thread: hand `event` to the request's coroutine (a `Done` with
        the job's measured durations)."""
        now = time.perf_counter()
        if isinstance(event, Started):
            self.started_at = now
        elif isinstance(event, Piece) and self.first_at is None:
            self.first_at = now
        elif isinstance(event, Done) and self.started_at is not None:
            event.seconds = now - self.started_at
            event.first_s = (self.first_at or now) - self.started_at
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def cancel(self) -> None:
        """The client is gone: stop within one step, or leave the queue now."""
        self.cancelled.set()
        self.worker.drop_if_queued(self)


class Embedding:
    """An embedding request for the model's thread: each input's token ids in, one vector
    each out, on `result` (an asyncio future of the event loop that asked)."""

    def __init__(self, inputs: list[list[int]], loop: asyncio.AbstractEventLoop) -> None:
        self.inputs, self.loop = inputs, loop
        self.result: asyncio.Future = loop.create_future()
        self.cancelled = threading.Event()  # (set by the worker's `stop` on what is queued)
        self.seconds = 0.0  # the forward passes' time, measured on the model's thread

    def finish(self, vectors: list[list[float]] | None, error: ApiError | None = None,
               seconds: float = 0.0) -> None:
        """From the worker's thread: the vectors, or the request's error."""
        self.seconds = seconds

        def settle() -> None:
            if self.result.done():  # the client went away (cancelled)
                return
            if error is not None:
                self.result.set_exception(error)
            else:
                self.result.set_result(vectors)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass
