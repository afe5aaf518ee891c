"""Anthropic's endpoints (POST /v1/messages, /v1/messages/count_tokens) as module-level
handlers reading `request.app.state`; their refusals are in Anthropic's error shape
(`anthropic.error_body`, given to their routes in app.py).

Why apart from anthropic.py: that module is the wire format only; this one runs the request
and sends Anthropic's named events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pocket_mlx.server import anthropic
from pocket_mlx.server.engine import Done, Failed, Job, Piece, Started
from pocket_mlx.server.replies import answer, check_model, log_calls, read_json, where
from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.server.state import engine
from pocket_mlx.server.streaming import event, events
from pocket_mlx.server.tools import CallSplitter, ToolCall


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's size as this model's template and
    tokenizer make it (max_tokens is not part of this request)."""
    body = await read_json(request)
    if "max_tokens" in body:
        raise ApiError(
            400,
            "max_tokens: Extra inputs are not permitted",
            param="max_tokens",
            code="unknown_parameter",
        )
    req = anthropic.parse_messages({**body, "max_tokens": 1})
    check_model(request, req.model)
    ids = await run_in_threadpool(engine(request).encode, req)
    return JSONResponse({"input_tokens": len(ids)})


async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    req = anthropic.parse_messages(await read_json(request))
    msg = anthropic.Message(engine(request).model_id)

    def full(text: str, calls: list[ToolCall], ev: Done) -> dict:
        return msg.full(
            text,
            ev.finish_reason,
            ev.stop_string,
            msg.usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens),
            calls,
        )

    def stream(job: Job, split: CallSplitter | None) -> AsyncIterator[str]:
        return message_events(request, req, msg, job, split)

    return await answer(request, req, "toolu_", full, stream)


def content(blocks: anthropic.Blocks, parts: list[str | ToolCall]) -> list[str]:
    """Text and whole tool calls as content-block events."""
    return [
        event(name, obj)
        for p in parts
        for name, obj in (blocks.text(p) if isinstance(p, str) else blocks.call(p))
    ]


async def message_events(
    request: Request, req: GenRequest, msg: anthropic.Message, job: Job, split: CallSplitter | None
) -> AsyncIterator[str]:
    """Anthropic's events: message_start, ping, each content block's start, deltas and stop
    (text_delta for text, one input_json_delta per tool_use), message_delta (stop reason,
    output tokens), message_stop."""
    blocks = anthropic.Blocks()
    async for ev in events(request, job, where(request, req)):
        if isinstance(ev, Started):
            for name, obj in msg.start(msg.usage(ev.prompt_tokens, ev.cached_tokens, 0)):
                yield event(name, obj)
        elif isinstance(ev, Piece):
            for e in content(blocks, split.feed(ev.text) if split is not None else [ev.text]):
                yield e
        elif isinstance(ev, Failed):
            yield event("error", anthropic.error_body(ev.error))
        elif isinstance(ev, Done):
            if split is not None:
                for e in content(blocks, split.close()):
                    yield e
                log_calls(request, split, where(request, req))
            for name, obj in blocks.close():
                yield event(name, obj)
            called = split is not None and bool(split.calls)
            for name, obj in msg.end(
                ev.finish_reason, ev.stop_string, {"output_tokens": ev.completion_tokens}, called
            ):
                yield event(name, obj)
