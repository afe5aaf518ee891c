"""From a request to a job and back, the same for both APIs: the body read, the model name
checked, the job admitted (or a 429), and the one non-streaming path (`answer`).

Why shared: OpenAI's and Anthropic's endpoints differ only in how they parse a body and how
they shape a reply and its events; what happens between is here once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pocket_mlx.errors import one_line
from pocket_mlx.server.events import ReplyParts
from pocket_mlx.server.jobs import Busy, Job, ReplyEvent, Whole
from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.server.state import settings, worker
from pocket_mlx.server.streaming import COMMENT, collect, log_calls, reply_events, sse

log = logging.getLogger(__name__)

TOOLS_OMITTED = "X-Pocket-Tools-Omitted"  # header: how many tools the prompt left out
FIELDS_IGNORED = "X-Pocket-Fields-Ignored"  # header: request fields left out (not honoured)

# The whole reply as the API's JSON object.
Full = Callable[[Whole], dict]
# The reply event stream (server/jobs.py) as the API's events, in SSE text.
Stream = Callable[[AsyncIterator[ReplyEvent]], AsyncIterator[str]]


async def read_json(request: Request) -> dict:
    """The body as a JSON object, at most `max_body` bytes (413 past it)."""
    max_body = settings(request).max_body
    length = request.headers.get("content-length", "")
    body = bytearray()
    over = length.isdigit() and int(length) > max_body
    dropped = 0
    async for chunk in request.stream():
        # Past the limit the rest is read and dropped, so the client sees the 413 and not a
        # connection reset; a body that goes on much longer (an endless chunked upload) is
        # cut off.
        if not over and len(body) + len(chunk) > max_body:
            over, body = True, bytearray()
        if not over:
            body += chunk
        else:
            dropped += len(chunk)
            if dropped > 2 * max_body:
                break
    if over:
        raise ApiError(413, f"request body over {max_body} bytes", code="body_too_large")
    try:
        data = json.loads(body)
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"the body is not UTF-8 (byte {e.start})", code="invalid_json"
        ) from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def names(request: Request) -> list[str]:
    """The model's own name, then its `--alias` names: clients configured for another name
    (an agent's "gpt-4o-mini" setting renamed to "my-model") reach it by those."""
    return list(dict.fromkeys([worker(request).model_id, *settings(request).aliases]))


def check_model(request: Request, name: str | None) -> None:
    """A 404 naming the served models when a request names another (None: any)."""
    if name is None or name in names(request):
        return
    served = ", ".join(repr(n) for n in names(request))
    raise ApiError(
        404,
        f"the model {name!r} does not exist here; this server serves {served} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


async def admit(request: Request, req: GenRequest) -> Job:
    """The checked request's model, prompt and slot: a queued job, or an ApiError."""
    check_model(request, req.model)
    ids = await run_in_threadpool(worker(request).encode, req)
    try:
        return worker(request).submit(ids, req, asyncio.get_running_loop())
    except Busy as b:
        raise ApiError(
            429,
            "the server is busy: every slot and queue place is taken; retry later",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(b.retry_after)},
        ) from None


def where(request: Request, req: GenRequest) -> str:
    return f"{request.method} {request.url.path}{' (stream)' if req.stream else ''}"


def omitted(request: Request, req: GenRequest) -> dict[str, str]:
    """The reply's extra headers, each also logged: request fields left out (features this
    server or model lacks), and the tools left out of the prompt (the template renders none,
    tool_choice was auto), so the client can tell why none was called."""
    out = {}
    if req.ignored:  # fields for features this server or model lacks (server/openai.py)
        fields = ",".join(ascii(f)[1:-1].replace(",", "%2C") for f in req.ignored)
        log.warning(
            f"{where(request, req)}: fields this server does not honour were ignored: "
            f"{one_line(fields)}",
        )
        out[FIELDS_IGNORED] = fields
    if not req.tools_omitted:
        return out
    tools = ", ".join(t["function"]["name"] for t in req.tools or [])
    log.warning(
        f"{where(request, req)}: this model's chat template renders no tools; "
        f"answered without the {len(req.tools or [])} tool(s) sent ({one_line(tools)})",
    )
    return {**out, TOOLS_OMITTED: str(len(req.tools or []))}


async def answer(
    request: Request, req: GenRequest, id_prefix: str, full: Full, stream: Stream,
    beat: str = COMMENT,
) -> Response:
    """A parsed generation request answered: the job admitted, then its reply events as a
    stream (`stream`) or the whole reply as one object (`full`); 499 when the client left
    first. `id_prefix`: how the API's tool-call ids start; `beat`: the stream's keep-alive
    (server/streaming.py `sse`)."""
    job = await admit(request, req)
    parts = ReplyParts.for_request(req, id_prefix)
    extra = omitted(request, req)
    if req.stream:
        return sse(stream(reply_events(request, job, where(request, req), parts)), extra,
                   beat)
    got = await collect(request, job, where(request, req))
    if got is None:
        return Response(status_code=499)
    whole = parts.whole(*got)
    log_calls(request, parts.split, where(request, req))
    return JSONResponse(full(whole), headers=extra)
