"""Ollama's endpoints (GET /api/tags, /api/ps, /api/version, POST /api/show, /api/chat,
/api/generate; the model-management ones refused) as module-level handlers reading
`request.app.state`; their refusals are Ollama's {"error": ...} (`ollama.error_body`, given to
their routes in app.py).

Why apart from ollama.py: that module is the wire format only; this one runs the request on
the same worker as OpenAI's and Anthropic's endpoints and writes Ollama's NDJSON lines, with
the durations measured from the request's arrival (`ollama.Timings`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pocket_mlx.engine.reasoning import supports_thinking
from pocket_mlx.server import ollama
from pocket_mlx.server.jobs import Call, Done, Failed, Reasoning, ReplyEvent, Text, Whole
from pocket_mlx.server.replies import answer, names, read_json
from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.server.state import worker
from pocket_mlx.server.tools import format_for

NDJSON = "application/x-ndjson"


def served(request: Request, name) -> str:
    """The served model `name` means (the model's name or an alias, with or without
    `:latest`, in any case), or Ollama's 404."""
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"model is required (a model name), got {name!r}", param="model",
                       code="missing_required")
    want = ollama.base_name(name).casefold()
    for n in names(request):
        if ollama.base_name(n).casefold() == want:
            return n
    listed = ", ".join(repr(n + ollama.TAG) for n in names(request))
    raise ApiError(404, f"model {name!r} not found: this server serves {listed} "
                        "(GET /api/tags)", param="model", code="model_not_found")


def template(request: Request) -> str:
    t = getattr(worker(request).tokenizer, "chat_template", None)
    return t if isinstance(t, str) else ""


def capabilities(chat_template: str) -> list[str]:
    """What /api/show says the model can do: completion; tools when its template renders
    tools in a call format we parse; thinking when its template knows reasoning blocks."""
    caps = ["completion"]
    try:
        tools = format_for(chat_template) is not None
    except ImportError:  # mlx-lm's parsers are missing: tool requests would fail too
        tools = False
    if tools:
        caps.append("tools")
    if supports_thinking(chat_template):
        caps.append("thinking")
    return caps


async def version(request: Request) -> Response:
    return JSONResponse({"version": ollama.VERSION})


async def tags(request: Request) -> Response:
    w = worker(request)
    return JSONResponse(
        {"models": [ollama.model_entry(n, w.about, w.created) for n in names(request)]})


async def ps(request: Request) -> Response:
    w = worker(request)
    return JSONResponse({"models": [ollama.running_entry(n, w.about, w.created, w.context,
                                                         w.device) for n in names(request)]})


async def show(request: Request) -> Response:
    """POST /api/show {"model": NAME} (older clients: "name")."""
    body = await read_json(request)
    served(request, body.get("model", body.get("name")))
    w = worker(request)
    t = template(request)
    return JSONResponse(ollama.show(w.about, w.created, w.context, t, capabilities(t)))


async def managed_elsewhere(request: Request) -> Response:
    """/api/pull, /api/push, /api/create, /api/copy, /api/delete, /api/blobs: a 501 naming
    the one model served."""
    raise ollama.managed_elsewhere(request.url.path, worker(request).model_id)


async def chat(request: Request) -> Response:
    return await generation(request, ollama.parse_chat, chat=True)


async def generate(request: Request) -> Response:
    return await generation(request, ollama.parse_generate, chat=False)


async def generation(request: Request, parse: Callable[[dict, int], GenRequest],
                     chat: bool) -> Response:
    """One /api/chat or /api/generate request: streamed as NDJSON unless `stream` is false;
    no messages and no prompt is Ollama's load (or, with keep_alive 0, unload) request."""
    t0 = time.perf_counter()
    body = await read_json(request)
    req = parse(body, worker(request).context)
    reply = ollama.Reply(chat, req.model or "")
    req.model = served(request, req.model)
    if req.messages == []:
        return JSONResponse(reply.loaded(body.get("keep_alive") in (0, "0", "0s", "0m")))

    def full(whole: Whole) -> dict:
        return reply.whole(whole, ollama.Timings.of(t0, whole.done))

    def stream(evs: AsyncIterator[ReplyEvent]) -> AsyncIterator[str]:
        return lines(reply, evs, t0)

    response = await answer(request, req, "call_", full, stream)
    if isinstance(response, StreamingResponse):
        response.headers["content-type"] = NDJSON
    return response


async def lines(reply: ollama.Reply, evs: AsyncIterator[ReplyEvent], t0: float
                ) -> AsyncIterator[str]:
    """Ollama's NDJSON: a line per reasoning piece, text piece or tool call, then the last
    line (done, counts, durations), or an {"error": ...} line."""
    async for ev in evs:
        if isinstance(ev, (Reasoning, Text, Call)):
            yield ollama.line(reply.chunk(ev))
        elif isinstance(ev, Failed):
            yield ollama.line(ollama.error_body(ev.error))
        elif isinstance(ev, Done):
            yield ollama.line(reply.final(ev, ollama.Timings.of(t0, ev)))
