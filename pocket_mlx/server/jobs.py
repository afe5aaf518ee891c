"""What passes between the server's HTTP side and its engine thread (server/engine.py): a
request's `Job` and the events it receives (`Started`, `Piece`, then `Done` or `Failed`), the
`Busy` refusal, and the prompt-cache protocol the engine reads and writes.

Why apart from the engine: the HTTP handlers need these types, not the model's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pocket_mlx.server.requests import ApiError, GenRequest


class PrefixStore(Protocol):
    """A store of model caches keyed by token prefix, shared by all requests: what the engine
    needs of engine/prompt_cache.py's `PromptCache` (tests plug in their own)."""

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
