"""The HTTP face of `pocket-mlx serve`: an ASGI app with OpenAI's endpoints.

Why Starlette under uvicorn: a small, standard ASGI stack (two pure-Python packages, no code
generation), whose `StreamingResponse` sends server-sent events and cancels the stream when the
client goes away, which is what stops a generation early. FastAPI would add pydantic models and
OpenAPI pages on top of the same Starlette; the request checking lives in `server/openai.py`
instead, in the shape of OpenAI's own errors, so nothing here needs it. `http.server` would
mean threads per connection and hand-written chunked streaming.

Endpoints: GET /health (no key needed), GET /metrics (Prometheus text), GET /v1/models (and
/v1/models/{id}), POST /v1/chat/completions and POST /v1/completions (streamed with
`"stream": true`), and Anthropic's POST /v1/messages and /v1/messages/count_tokens
(server/anthropic.py), and the browser chat page at GET / and /chat (server/page.py,
no key needed). Tool calls: server/tools.py. Requests run on the engine thread
(`server/engine.py`), up to --max-concurrency decoded together; extra requests wait in a
bounded queue, then get 429 with Retry-After. Every refusal is OpenAI's error object with a
4xx status and one line on stderr;
anything unexpected is a 500 with a generic message (the details go to the log only).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pocket_mlx.server import anthropic, page
from pocket_mlx.server.engine import Busy, Done, Engine, Failed, Job, Piece, Started
from pocket_mlx.server.openai import (
    ApiError,
    GenRequest,
    Reply,
    finish_reason,
    parse_chat,
    parse_completion,
    tool_call_json,
    usage,
)
from pocket_mlx.server.tools import CallSplitter, ToolCall, splitter_for

DEFAULT_MAX_BODY = 8 * 2**20  # bytes; a 2,000-token prompt is ~10 kB of JSON
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
TOOLS_OMITTED = "X-Pocket-Tools-Omitted"  # header: how many tools the prompt left out
FIELDS_IGNORED = "X-Pocket-Fields-Ignored"  # header: request fields left out (not honoured)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_response(e: ApiError) -> Response:
    """The error object as ASCII JSON: a message may quote the request's own text, lone
    surrogates included, which UTF-8 cannot encode."""
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers,
                    media_type="application/json")


def create_app(engine: Engine, *, api_key: str | None = None, cors: str | None = None,
               max_body: int = DEFAULT_MAX_BODY,
               log: Callable[[str], object] | None = None,
               aliases: Sequence[str] = ()) -> Starlette:
    """The ASGI app serving `engine`'s model. `api_key`: Bearer key required on every endpoint
    but /health; `cors`: the one origin allowed to call from a browser (None: no CORS)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    key = api_key.encode("utf-8") if api_key else None

    def check_key(request: Request) -> None:
        """The Bearer key (OpenAI's clients), or `x-api-key` (Anthropic's)."""
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")
        # compare_digest: the time taken does not tell how much of the key matched.
        if not hmac.compare_digest(given.strip().encode("utf-8"), key):
            raise ApiError(401, "invalid or missing API key: send Authorization: Bearer KEY "
                                "(or x-api-key: KEY)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def guarded(handler: Callable[[Request], Awaitable[Response]], *, auth: bool = True,
                errors: Callable[[ApiError], dict] = ApiError.body, label: str | None = None):
        """`handler` with the key check, and every failure as an error object (shaped by
        `errors`: OpenAI's by default) plus one log line. `label`: the endpoint's name in
        /metrics when its path has parameters (one series per route, not per URL)."""

        def refuse(e: ApiError) -> Response:
            return Response(json.dumps(errors(e)), status_code=e.status, headers=e.headers,
                            media_type="application/json")

        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    check_key(request)
                response = await handler(request)
            except ApiError as e:
                log(f"pocket-mlx serve: {e.status} {request.method} {request.url.path}: "
                    f"{one_line(e.message)}")
                response = refuse(e)
            except Exception as e:  # noqa: BLE001 - never a traceback to the client
                log(f"pocket-mlx serve: 500 {request.method} {request.url.path}: "
                    f"{type(e).__name__}: {one_line(e)}")
                response = refuse(ApiError(500, "internal server error; see the server's log",
                                           type="server_error", code="internal_error"))
            engine.metrics.request(label or request.url.path, response.status_code)
            return response

        return endpoint

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length", "")
        body = bytearray()
        over = length.isdigit() and int(length) > max_body
        dropped = 0
        async for chunk in request.stream():
            # Past the limit the rest is read and dropped, so the client sees the 413 and not
            # a connection reset; a body that goes on much longer (an endless chunked upload)
            # is cut off.
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
            raise ApiError(400, f"the body is not UTF-8 (byte {e.start})",
                           code="invalid_json") from None
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return data

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": engine.model_id, "device": engine.device,
                             **engine.load()})

    async def metrics(request: Request) -> Response:
        load = engine.load()
        stats = getattr(engine.prompt_cache, "stats", None)
        return PlainTextResponse(engine.metrics.render(load["active"], load["queued"],
                                                       stats() if stats else None),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def names() -> list[str]:
        """The model's own name, then its `--alias` names: clients configured for another
        name (an agent's "gpt-4o-mini" setting renamed to "my-model") reach it by those."""
        return list(dict.fromkeys([engine.model_id, *aliases]))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": engine.created,
                "owned_by": "pocket-mlx", "context_length": engine.context}

    def unknown_model(name: str) -> ApiError:
        served = ", ".join(repr(n) for n in names())
        return ApiError(404, f"the model {name!r} does not exist here; this server serves "
                             f"{served} (GET /v1/models)", param="model",
                        code="model_not_found")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in names()]})

    async def model(request: Request) -> Response:
        """GET /v1/models/{id}: OpenAI's clients' `models.retrieve`."""
        if request.path_params["model"] not in names():
            raise unknown_model(request.path_params["model"])
        return JSONResponse(model_card(request.path_params["model"]))

    async def count_tokens(request: Request) -> Response:
        """Anthropic's POST /v1/messages/count_tokens: the prompt's size as this model's
        template and tokenizer make it (max_tokens is not part of this request)."""
        body = await read_json(request)
        if "max_tokens" in body:
            raise ApiError(400, "max_tokens: Extra inputs are not permitted",
                           param="max_tokens", code="unknown_parameter")
        req = anthropic.parse_messages({**body, "max_tokens": 1})
        if req.model is not None and req.model not in names():
            raise unknown_model(req.model)
        ids = await run_in_threadpool(engine.encode, req)
        return JSONResponse({"input_tokens": len(ids)})

    async def admit(request: Request, req: GenRequest) -> Job:
        """The checked request's model, prompt and slot: a queued job, or an ApiError."""
        if req.model is not None and req.model not in names():
            raise unknown_model(req.model)
        ids = await run_in_threadpool(engine.encode, req)
        try:
            return engine.submit(ids, req, asyncio.get_running_loop())
        except Busy as b:
            raise ApiError(429, "the server is busy: every slot and queue place is taken; "
                                "retry later", type="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(b.retry_after)}) from None

    def where(request: Request, req: GenRequest) -> str:
        return f"{request.method} {request.url.path}{' (stream)' if req.stream else ''}"

    def done_line(where: str, ev: Done, t0: float) -> str:
        return (f"pocket-mlx serve: 200 {where}: {ev.prompt_tokens} prompt tokens "
                f"({ev.cached_tokens} cached), {ev.completion_tokens} completion tokens, "
                f"{ev.finish_reason}, {time.perf_counter() - t0:.2f} s")

    async def collect(request: Request, job: Job, where: str) -> tuple[str, Done] | None:
        """The whole reply and its closing event; None when the client went away first."""
        t0 = time.perf_counter()
        pieces: list[str] = []
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
                        log(f"pocket-mlx serve: {where}: the client went away; stopped")
                        return None
                if isinstance(ev, Piece):
                    pieces.append(ev.text)
                elif isinstance(ev, Failed):
                    finished = True
                    raise ev.error
                elif isinstance(ev, Done):
                    finished = True
                    log(done_line(where, ev, t0))
                    return "".join(pieces), ev
        finally:
            if not finished:
                job.cancel()

    async def events(job: Job, where: str) -> AsyncIterator[Started | Piece | Done | Failed]:
        """The job's events up to its end, for a stream. When the client disconnects,
        Starlette cancels the response's iteration at its `await`: `finally` then cancels the
        job, which stops within one token."""
        t0 = time.perf_counter()
        finished = False
        try:
            while True:
                ev = await job.events.get()
                if isinstance(ev, Failed):
                    finished = True
                    log(f"pocket-mlx serve: {ev.error.status} {where}: "
                        f"{one_line(ev.error.message)}")
                elif isinstance(ev, Done):
                    finished = True
                    log(done_line(where, ev, t0))
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                job.cancel()
                log(f"pocket-mlx serve: {where}: the client went away; stopped")

    def sse(stream: AsyncIterator[str], extra: dict[str, str] | None = None
            ) -> StreamingResponse:
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **(extra or {})})

    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def split_all(split: CallSplitter | None, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply as its text and tool calls (no tools: the text as it is)."""
        if split is None:
            return text, []
        parts = split.feed(text) + split.close()
        return "".join(p for p in parts if isinstance(p, str)), split.calls

    def log_calls(split: CallSplitter | None, where: str) -> None:
        """One line for each call the model wrote that could not be read (given back as text)
        and for calls dropped by parallel_tool_calls false."""
        if split is None:
            return
        for why in split.failed:
            log(f"pocket-mlx serve: {where}: a tool call could not be parsed ({one_line(why)}); "
                "returned as text")
        if split.dropped:
            log(f"pocket-mlx serve: {where}: {split.dropped} tool call(s) past the first "
                "dropped (parallel_tool_calls is false)")

    def omitted(request: Request, req: GenRequest) -> dict[str, str]:
        """The reply's extra headers, each also logged: request fields left out (features this
        server or model lacks), and the tools left out of the prompt (the template renders
        none, tool_choice was auto), so the client can tell why none was called."""
        out = {}
        if req.ignored:  # fields for features this server or model lacks (server/openai.py)
            fields = ",".join(ascii(f)[1:-1].replace(",", "%2C") for f in req.ignored)
            log(f"pocket-mlx serve: {where(request, req)}: fields this server does not honour "
                f"were ignored: {one_line(fields)}")
            out[FIELDS_IGNORED] = fields
        if not req.tools_omitted:
            return out
        names = ", ".join(t["function"]["name"] for t in req.tools or [])
        log(f"pocket-mlx serve: {where(request, req)}: this model's chat template renders no "
            f"tools; answered without the {len(req.tools or [])} tool(s) sent ({one_line(names)})")
        return {**out, TOOLS_OMITTED: str(len(req.tools or []))}

    async def openai_endpoint(request: Request, parse: Callable[[dict], GenRequest]) -> Response:
        req = parse(await read_json(request))
        job = await admit(request, req)
        reply = Reply(req.kind, engine.model_id)
        split = splitter_for(req, "call_")
        extra = omitted(request, req)
        if not req.stream:
            got = await collect(request, job, where(request, req))
            if got is None:
                return Response(status_code=499)
            text, ev = got
            text, calls = split_all(split, text)
            log_calls(split, where(request, req))
            return JSONResponse(reply.full(text, finish_reason(ev.finish_reason, bool(calls)),
                                           usage(ev.prompt_tokens, ev.completion_tokens,
                                                 ev.cached_tokens), calls), headers=extra)

        def pieces(parts: list[str | ToolCall], inc: bool) -> list[str]:
            out = []
            for p in parts:
                if isinstance(p, str):
                    out.append(data(reply.chunk(p, with_usage=inc)))
                else:
                    index = next(i for i, c in enumerate(split.calls) if c is p)
                    out.append(data(reply.chunk(with_usage=inc,
                                                call=tool_call_json(p, index=index))))
            return out

        async def stream() -> AsyncIterator[str]:
            """OpenAI's chunks; `data: [DONE]` ends them. With tools, text that may start a
            call is held back until it is known, and each call goes out whole once parsed."""
            inc = req.include_usage
            if req.kind == "chat":
                yield data(reply.chunk(role=True, with_usage=inc))
            async for ev in events(job, where(request, req)):
                if isinstance(ev, Piece):
                    if split is None:
                        yield data(reply.chunk(ev.text, with_usage=inc))
                    else:
                        for chunk in pieces(split.feed(ev.text), inc):
                            yield chunk
                elif isinstance(ev, Failed):
                    yield data(ev.error.body())
                elif isinstance(ev, Done):
                    if split is not None:
                        for chunk in pieces(split.close(), inc):
                            yield chunk
                        log_calls(split, where(request, req))
                    called = split is not None and bool(split.calls)
                    yield data(reply.chunk(None, finish_reason(ev.finish_reason, called),
                                           with_usage=inc))
                    if inc:
                        yield data(reply.usage_chunk(usage(ev.prompt_tokens, ev.completion_tokens,
                                                           ev.cached_tokens)))
                    yield "data: [DONE]\n\n"

        return sse(stream(), extra)

    async def anthropic_endpoint(request: Request) -> Response:
        req = anthropic.parse_messages(await read_json(request))
        job = await admit(request, req)
        msg = anthropic.Message(engine.model_id)
        split = splitter_for(req, "toolu_")
        extra = omitted(request, req)
        if not req.stream:
            got = await collect(request, job, where(request, req))
            if got is None:
                return Response(status_code=499)
            text, ev = got
            text, calls = split_all(split, text)
            log_calls(split, where(request, req))
            return JSONResponse(msg.full(text, ev.finish_reason, ev.stop_string, msg.usage(
                ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens), calls),
                                headers=extra)

        def event(name: str, obj: dict) -> str:
            return f"event: {name}\n{data(obj)}"

        blocks = anthropic.Blocks()

        def content(parts: list[str | ToolCall]) -> list[str]:
            out = []
            for p in parts:
                for name, obj in (blocks.text(p) if isinstance(p, str) else blocks.call(p)):
                    out.append(event(name, obj))
            return out

        async def stream() -> AsyncIterator[str]:
            """Anthropic's events: message_start, ping, each content block's start, deltas
            and stop (text_delta for text, one input_json_delta per tool_use), message_delta
            (stop reason, output tokens), message_stop."""
            async for ev in events(job, where(request, req)):
                if isinstance(ev, Started):
                    for name, obj in msg.start(msg.usage(ev.prompt_tokens, ev.cached_tokens, 0)):
                        yield event(name, obj)
                elif isinstance(ev, Piece):
                    for e in content(split.feed(ev.text) if split is not None else [ev.text]):
                        yield e
                elif isinstance(ev, Failed):
                    yield event("error", anthropic.error_body(ev.error))
                elif isinstance(ev, Done):
                    if split is not None:
                        for e in content(split.close()):
                            yield e
                        log_calls(split, where(request, req))
                    for name, obj in blocks.close():
                        yield event(name, obj)
                    called = split is not None and bool(split.calls)
                    for name, obj in msg.end(ev.finish_reason, ev.stop_string,
                                             {"output_tokens": ev.completion_tokens}, called):
                        yield event(name, obj)

        return sse(stream(), extra)

    async def chat(request: Request) -> Response:
        return await openai_endpoint(request, parse_chat)

    async def completions(request: Request) -> Response:
        return await openai_endpoint(request, parse_completion)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 404:
            e = ApiError(404, f"no such endpoint: {request.url.path}", code="not_found")
        elif status == 405:
            e = ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                         code="method_not_allowed")
        elif isinstance(exc, HTTPException):
            e = ApiError(status, one_line(exc.detail), code=None)
        else:
            log(f"pocket-mlx serve: 500 {request.method} {request.url.path}: "
                f"{type(exc).__name__}: {one_line(exc)}")
            e = ApiError(500, "internal server error; see the server's log", type="server_error",
                         code="internal_error")
        if status != 500:
            log(f"pocket-mlx serve: {e.status} {request.method} {request.url.path}: {e.message}")
        engine.metrics.request("other", e.status)
        return error_response(e)

    routes = [
        Route("/health", guarded(health, auth=False), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model, label="/v1/models/{id}"),
              methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/messages", guarded(anthropic_endpoint, errors=anthropic.error_body),
              methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(count_tokens, errors=anthropic.error_body),
              methods=["POST"]),
        *page.routes(guarded),  # the browser chat page: GET / and /chat
    ]
    middleware = []
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=[cors],
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type",
                                                    "x-api-key", "anthropic-version"]))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: http_error})
