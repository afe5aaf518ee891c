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
from pocket_mlx.server.jobs import Call, Done, Failed, Reasoning, ReplyEvent, Started, Text, Whole
from pocket_mlx.server.replies import answer, check_model, read_json
from pocket_mlx.server.requests import ApiError
from pocket_mlx.server.state import worker
from pocket_mlx.server.streaming import event


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
    ids = await run_in_threadpool(worker(request).encode, req)
    return JSONResponse({"input_tokens": len(ids)})


async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    body = await read_json(request)
    req = anthropic.parse_messages(body)
    msg = anthropic.Message(worker(request).model_id, anthropic.settings(body).shown)

    def full(whole: Whole) -> dict:
        ev = whole.done
        return msg.full(
            whole.text,
            ev.finish_reason,
            ev.stop_string,
            msg.usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens),
            whole.calls,
            whole.reasoning,
        )

    def stream(evs: AsyncIterator[ReplyEvent]) -> AsyncIterator[str]:
        return message_events(msg, evs)

    return await answer(request, req, "toolu_", full, stream, event(*anthropic.PING))


async def message_events(msg: anthropic.Message, evs: AsyncIterator[ReplyEvent]
                         ) -> AsyncIterator[str]:
    """Anthropic's events: message_start (at `Started`, before the prompt is prefilled: the
    client then hears `ping`s while it waits, server/streaming.py), ping, each content block's
    start, deltas and stop (thinking_delta and a signature_delta for reasoning, text_delta for
    text, one input_json_delta per tool_use), message_delta (stop reason, output tokens),
    message_stop."""
    blocks = anthropic.Blocks(msg.shown)
    called = False
    async for ev in evs:
        if isinstance(ev, Started):
            out = msg.start(msg.usage(ev.prompt_tokens, ev.cached_tokens, 0))
        elif isinstance(ev, Reasoning):
            out = blocks.thinking(ev.text)
        elif isinstance(ev, Text):
            out = blocks.text(ev.text)
        elif isinstance(ev, Call):
            called = True
            out = blocks.call(ev.call)
        elif isinstance(ev, Failed):
            out = [("error", anthropic.error_body(ev.error))]
        elif isinstance(ev, Done):
            out = blocks.close() + msg.end(ev.finish_reason, ev.stop_string,
                                           {"output_tokens": ev.completion_tokens}, called)
        else:
            out = []
        for name, obj in out:
            yield event(name, obj)
