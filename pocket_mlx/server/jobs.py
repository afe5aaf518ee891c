"""What passes between the server's HTTP side and its engine thread (server/engine.py): a
request's `Job` and the events it receives (`Started`, `Piece`, then `Done` or `Failed`), the
`Busy` refusal. (The prompt-cache protocol the engine reads and writes, `PrefixStore`, is
engine/prompt_cache.py's.)

Why apart from the engine: the HTTP handlers need these types, not the model's thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from pocket_mlx.server.requests import ApiError, GenRequest


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

    def __init__(self, engine, ids: list[int], request: GenRequest,
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
        self.engine.drop_if_queued(self)
