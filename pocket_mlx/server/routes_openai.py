"""OpenAI's endpoints (/v1/models, /v1/chat/completions, /v1/completions) and the server's
own (/health, /metrics), as module-level handlers reading `request.app.state`.

Why here and not in openai.py: that module is the wire format only (bodies in, objects out,
no HTTP); this one puts it on the wire: a request's job, its reply whole or as OpenAI's chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pocket_mlx.server.jobs import Call, Done, Failed, Reasoning, ReplyEvent, Text, Whole
from pocket_mlx.server.openai import (
    Reply,
    finish_reason,
    parse_chat,
    parse_completion,
    tool_call_json,
    usage,
)
from pocket_mlx.server.replies import answer, check_model, names, read_json
from pocket_mlx.server.requests import GenRequest
from pocket_mlx.server.state import worker
from pocket_mlx.server.streaming import data


async def health(request: Request) -> Response:
    e = worker(request)
    return JSONResponse({"status": "ok", "model": e.model_id, "device": e.device, **e.load()})


async def metrics(request: Request) -> Response:
    e = worker(request)
    load = e.load()
    stats = getattr(e.prompt_cache, "stats", None)
    return PlainTextResponse(
        request.app.state.metrics.render(
            load["active"], load["queued"], stats() if stats else None
        ),
        media_type="text/plain; version=0.0.4; charset=utf-8",
    )


def model_card(request: Request, name: str) -> dict:
    e = worker(request)
    return {
        "id": name,
        "object": "model",
        "created": e.created,
        "owned_by": "pocket-mlx",
        "context_length": e.context,
    }


async def models(request: Request) -> Response:
    return JSONResponse(
        {"object": "list", "data": [model_card(request, n) for n in names(request)]}
    )


async def model(request: Request) -> Response:
    """GET /v1/models/{id}: OpenAI's clients' `models.retrieve`."""
    name = request.path_params["id"]
    check_model(request, name)
    return JSONResponse(model_card(request, name))


async def chat(request: Request) -> Response:
    return await generate(request, parse_chat)


async def completions(request: Request) -> Response:
    return await generate(request, parse_completion)


async def generate(request: Request, parse: Callable[[dict], GenRequest]) -> Response:
    req = parse(await read_json(request))
    reply = Reply(req.kind, worker(request).model_id)

    def full(whole: Whole) -> dict:
        ev = whole.done
        return reply.full(
            whole.text,
            finish_reason(ev.finish_reason, bool(whole.calls)),
            reply_usage(req, ev),
            whole.calls,
            whole.reasoning,
        )

    def stream(evs: AsyncIterator[ReplyEvent]) -> AsyncIterator[str]:
        return chunks(req, reply, evs)

    return await answer(request, req, "call_", full, stream)


def reply_usage(req: GenRequest, ev: Done) -> dict:
    """The usage object; reasoning tokens counted where the reply was parsed for them."""
    thought = ev.reasoning_tokens if req.reasoning_open is not None else None
    return usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, thought)


async def chunks(
    req: GenRequest, reply: Reply, evs: AsyncIterator[ReplyEvent]
) -> AsyncIterator[str]:
    """OpenAI's chunks; `data: [DONE]` ends them. With tools, text that may start a call is
    held back until it is known, and each call goes out whole once parsed."""
    inc = req.include_usage
    called = False
    if req.kind == "chat":
        yield data(reply.chunk(role=True, with_usage=inc))
    async for ev in evs:
        if isinstance(ev, Text):
            yield data(reply.chunk(ev.text, with_usage=inc))
        elif isinstance(ev, Reasoning):
            yield data(reply.chunk(with_usage=inc, reasoning=ev.text))
        elif isinstance(ev, Call):
            called = True
            yield data(reply.chunk(with_usage=inc, call=tool_call_json(ev.call, index=ev.index)))
        elif isinstance(ev, Failed):
            yield data(ev.error.body())
        elif isinstance(ev, Done):
            yield data(reply.chunk(None, finish_reason(ev.finish_reason, called), with_usage=inc))
            if inc:
                yield data(reply.usage_chunk(reply_usage(req, ev)))
            yield "data: [DONE]\n\n"
