"""A job's events as the HTTP side reads them: whole (`collect`) or as a stream of reply events
(`reply_events`: server/events.py's parts) for server-sent events.

Why in one place: both APIs read a job the same two ways, and both ways must cancel the job
when the client goes away, or the engine goes on decoding for nobody. A stream learns it from
Starlette, which cancels the response's iteration (`events`); a plain request has to ask,
every `DISCONNECT_POLL_S` (`collect`).

Keep-alive (`kept_alive`, used by `sse`): while a long prompt prefills (minutes on a CPU) or a
request waits for a slot, a stream would carry nothing, and clients or proxies with an idle
timeout give up. Every stream sends its format's beat (an SSE comment, Anthropic's `ping`
event) whenever nothing else was sent for `keepalive_s()` seconds (POCKET_MLX_KEEPALIVE_S,
default 10; 0 turns it off).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from pocket_mlx.errors import one_line
from pocket_mlx.server.events import ReplyParts
from pocket_mlx.server.jobs import Done, Failed, Job, Piece, ReplyEvent, Started
from pocket_mlx.server.tools import CallSplitter

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
KEEPALIVE_ENV = "POCKET_MLX_KEEPALIVE_S"
DEFAULT_KEEPALIVE_S = 10.0  # a beat at least this often: clients' idle timeouts are 15 s and up
COMMENT = ": keep-alive\n\n"  # an SSE comment: every SSE parser skips it


def done_line(where: str, ev: Done, t0: float) -> str:
    return (
        f"200 {where}: {ev.prompt_tokens} prompt tokens ({ev.cached_tokens} cached), "
        f"{ev.completion_tokens} completion tokens, {ev.finish_reason}, "
        f"{time.perf_counter() - t0:.2f} s"
        + (f" (first token after {ev.first_s:.2f} s)" if ev.first_s is not None else "")
    )


async def collect(request: Request, job: Job, where: str) -> tuple[str, Done, str] | None:
    """The whole reply, its closing event and its reasoning; None when the client went away
    first."""
    t0 = time.perf_counter()
    pieces: list[str] = []
    thoughts: list[str] = []
    finished = False
    checked = time.perf_counter()
    try:
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
                ev = None
            # Checked by the clock: while tokens flow, the wait above never times out.
            if time.perf_counter() - checked >= DISCONNECT_POLL_S:
                checked = time.perf_counter()
                if await request.is_disconnected():
                    log.info(f"{where}: the client went away; stopped")
                    return None
            if isinstance(ev, Piece):
                pieces.append(ev.text)
                thoughts.append(ev.reasoning)
            elif isinstance(ev, Failed):
                finished = True
                raise ev.error
            elif isinstance(ev, Done):
                finished = True
                log.info(done_line(where, ev, t0))
                return "".join(pieces), ev, "".join(thoughts)
    finally:
        if not finished:
            job.cancel()


async def events(
    request: Request, job: Job, where: str
) -> AsyncIterator[Started | Piece | Done | Failed]:
    """The job's events up to its end, for a stream. When the client disconnects, Starlette
    cancels the response's iteration at its `await`: `finally` then cancels the job, which
    stops within one token."""
    t0 = time.perf_counter()
    finished = False
    try:
        while True:
            ev = await job.events.get()
            if isinstance(ev, Failed):
                finished = True
                log.warning(f"{ev.error.status} {where}: {one_line(ev.error.message)}")
            elif isinstance(ev, Done):
                finished = True
                log.info(done_line(where, ev, t0))
            yield ev
            if finished:
                return
    finally:
        if not finished:
            job.cancel()
            log.info(f"{where}: the client went away; stopped")


def log_calls(request: Request, split: CallSplitter | None, where: str) -> None:
    """One line for each call the model wrote that could not be read (given back as text)
    and for calls dropped by parallel_tool_calls false."""
    if split is None:
        return
    for why in split.failed:
        log.warning(f"{where}: a tool call could not be parsed ({one_line(why)}); returned as text")
    if split.dropped:
        log.warning(
            f"{where}: {split.dropped} tool call(s) past the first dropped "
            "(parallel_tool_calls is false)",
        )


async def reply_events(
    request: Request, job: Job, where: str, parts: ReplyParts
) -> AsyncIterator[ReplyEvent]:
    """The job's events as the reply event stream: `Started`, then `Reasoning`, `Text` and
    `Call` events as the text arrives, the splitters' last parts, then `Done` or `Failed`."""
    async for ev in events(request, job, where):
        if isinstance(ev, Piece):
            for part in parts.feed(ev.text, ev.reasoning):
                yield part
            continue
        if isinstance(ev, Done):
            for part in parts.close():
                yield part
            log_calls(request, parts.split, where)
        yield ev


def keepalive_s() -> float:
    """Seconds of silence before a stream sends a beat (0: never)."""
    try:
        return max(0.0, float(os.environ.get(KEEPALIVE_ENV, DEFAULT_KEEPALIVE_S)))
    except ValueError:
        return DEFAULT_KEEPALIVE_S


async def kept_alive(stream: AsyncIterator[str], beat: str, every: float
                     ) -> AsyncIterator[str]:
    """`stream`, with `beat` sent whenever it gave nothing for `every` seconds. The next item
    is awaited in a task of its own that a beat does not disturb; when the client goes away
    (Starlette cancels this iteration) that task is cancelled too, which runs the stream's
    `finally` (`events` cancels the job)."""
    if every <= 0:
        async for item in stream:
            yield item
        return
    it = stream.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield beat
                continue
            got, pending = pending, None
            try:
                item = got.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        elif hasattr(it, "aclose"):
            asyncio.get_running_loop().create_task(it.aclose())


def sse(stream: AsyncIterator[str], extra: dict[str, str] | None = None,
        beat: str = COMMENT) -> StreamingResponse:
    """Server-sent events, unbuffered by proxies (X-Accel-Buffering) and caches, with `beat`
    (the format's keep-alive: an SSE comment unless told) in every silence of
    `keepalive_s()`."""
    return StreamingResponse(
        kept_alive(stream, beat, keepalive_s()),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(extra or {})},
    )


def data(obj: dict) -> str:
    """One `data:` event (OpenAI's streams are only these)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event(name: str, obj: dict) -> str:
    """One named event (Anthropic's streams name each)."""
    return f"event: {name}\n{data(obj)}"
