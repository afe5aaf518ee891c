"""OpenAI's endpoints (/v1/models, /v1/chat/completions, /v1/completions) and the server's
own (/health, /metrics), as module-level handlers reading `request.app.state`.

Why here and not in openai.py: that module is the wire format only (bodies in, objects out,
no HTTP); this one puts it on the wire: a request's job, its reply whole or as OpenAI's chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pocket_mlx.server.engine import Done, Failed, Job, Piece
from pocket_mlx.server.openai import (
    Reply,
    finish_reason,
    parse_chat,
    parse_completion,
    tool_call_json,
    usage,
)
from pocket_mlx.server.replies import (
    answer,
    check_model,
    log_calls,
    names,
    read_json,
    where,
)
from pocket_mlx.server.requests import GenRequest
from pocket_mlx.server.state import engine
from pocket_mlx.server.streaming import data, events
from pocket_mlx.server.tools import CallSplitter, ToolCall


async def health(request: Request) -> Response:
    e = engine(request)
    return JSONResponse({"status": "ok", "model": e.model_id, "device": e.device, **e.load()})


async def metrics(request: Request) -> Response:
    e = engine(request)
    load = e.load()
    stats = getattr(e.prompt_cache, "stats", None)
    return PlainTextResponse(
        request.app.state.metrics.render(
            load["active"], load["queued"], stats() if stats else None
        ),
        media_type="text/plain; version=0.0.4; charset=utf-8",
    )


def model_card(request: Request, name: str) -> dict:
    e = engine(request)
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
    reply = Reply(req.kind, engine(request).model_id)

    def full(text: str, calls: list[ToolCall], ev: Done) -> dict:
        return reply.full(
            text,
            finish_reason(ev.finish_reason, bool(calls)),
            usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens),
            calls,
        )

    def stream(job: Job, split: CallSplitter | None) -> AsyncIterator[str]:
        return chunks(request, req, reply, job, split)

    return await answer(request, req, "call_", full, stream)


def pieces(reply: Reply, split: CallSplitter, parts: list[str | ToolCall], inc: bool) -> list[str]:
    """Text and whole tool calls (each with its index among the reply's calls) as chunks."""
    out = []
    for p in parts:
        if isinstance(p, str):
            out.append(data(reply.chunk(p, with_usage=inc)))
        else:
            index = next(i for i, c in enumerate(split.calls) if c is p)
            out.append(data(reply.chunk(with_usage=inc, call=tool_call_json(p, index=index))))
    return out


async def chunks(
    request: Request, req: GenRequest, reply: Reply, job: Job, split: CallSplitter | None
) -> AsyncIterator[str]:
    """OpenAI's chunks; `data: [DONE]` ends them. With tools, text that may start a call is
    held back until it is known, and each call goes out whole once parsed."""
    inc = req.include_usage
    if req.kind == "chat":
        yield data(reply.chunk(role=True, with_usage=inc))
    async for ev in events(request, job, where(request, req)):
        if isinstance(ev, Piece):
            if split is None:
                yield data(reply.chunk(ev.text, with_usage=inc))
            else:
                for chunk in pieces(reply, split, split.feed(ev.text), inc):
                    yield chunk
        elif isinstance(ev, Failed):
            yield data(ev.error.body())
        elif isinstance(ev, Done):
            if split is not None:
                for chunk in pieces(reply, split, split.close(), inc):
                    yield chunk
                log_calls(request, split, where(request, req))
            called = split is not None and bool(split.calls)
            yield data(reply.chunk(None, finish_reason(ev.finish_reason, called), with_usage=inc))
            if inc:
                yield data(
                    reply.usage_chunk(
                        usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                    )
                )
            yield "data: [DONE]\n\n"
