"""The HTTP face of `pocket-mlx serve`: an ASGI app with OpenAI's endpoints.

Why Starlette under uvicorn: a small, standard ASGI stack (two pure-Python packages, no code
generation), whose `StreamingResponse` sends server-sent events and cancels the stream when the
client goes away, which is what stops a generation early. FastAPI would add pydantic models and
OpenAPI pages on top of the same Starlette; the request checking lives in `server/openai.py`
instead, in the shape of OpenAI's own errors, so nothing here needs it. `http.server` would
mean threads per connection and hand-written chunked streaming.

Endpoints: GET /health (no key needed), GET /metrics (Prometheus text), GET /v1/models,
POST /v1/chat/completions and POST /v1/completions (streamed with `"stream": true`). Requests run one at a time on the
engine thread (`server/engine.py`); extra requests wait in a bounded queue, then get 429 with
Retry-After. Every refusal is OpenAI's error object with a 4xx status and one line on stderr;
anything unexpected is a 500 with a generic message (the details go to the log only).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pocket_mlx.server.engine import Busy, Done, Engine, Failed, Job, Piece
from pocket_mlx.server.openai import (
    ApiError,
    GenRequest,
    Reply,
    finish_reason,
    parse_chat,
    parse_completion,
    usage,
)

DEFAULT_MAX_BODY = 8 * 2**20  # bytes; a 2,000-token prompt is ~10 kB of JSON
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_response(e: ApiError) -> Response:
    """The error object as ASCII JSON: a message may quote the request's own text, lone
    surrogates included, which UTF-8 cannot encode."""
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers,
                    media_type="application/json")


def create_app(engine: Engine, *, api_key: str | None = None, cors: str | None = None,
               max_body: int = DEFAULT_MAX_BODY,
               log: Callable[[str], object] | None = None) -> Starlette:
    """The ASGI app serving `engine`'s model. `api_key`: Bearer key required on every endpoint
    but /health; `cors`: the one origin allowed to call from a browser (None: no CORS)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    key = api_key.encode("utf-8") if api_key else None

    def check_key(request: Request) -> None:
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8"),
                                                                 key):
            raise ApiError(401, "invalid or missing API key: send Authorization: Bearer KEY",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def guarded(handler: Callable[[Request], Awaitable[Response]], *, auth: bool = True):
        """`handler` with the key check, and every failure as an error object plus one log
        line."""

        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    check_key(request)
                response = await handler(request)
            except ApiError as e:
                log(f"pocket-mlx serve: {e.status} {request.method} {request.url.path}: "
                    f"{one_line(e.message)}")
                response = error_response(e)
            except Exception as e:  # noqa: BLE001 - never a traceback to the client
                log(f"pocket-mlx serve: 500 {request.method} {request.url.path}: "
                    f"{type(e).__name__}: {one_line(e)}")
                response = error_response(ApiError(500, "internal server error; see the "
                                                        "server's log", type="server_error",
                                                   code="internal_error"))
            engine.metrics.request(request.url.path, response.status_code)
            return response

        return endpoint

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length", "")
        body = bytearray()
        over = length.isdigit() and int(length) > max_body
        async for chunk in request.stream():
            # Past the limit the rest is read and dropped, so the client sees the 413 and not
            # a connection reset.
            if not over and len(body) + len(chunk) > max_body:
                over, body = True, bytearray()
            if not over:
                body += chunk
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
        return PlainTextResponse(engine.metrics.render(load["active"], load["queued"]),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": engine.model_id, "object": "model", "created": engine.created,
            "owned_by": "pocket-mlx", "context_length": engine.context}]})

    async def generate(request: Request, parse: Callable[[dict], GenRequest]) -> Response:
        req = parse(await read_json(request))
        if req.model is not None and req.model != engine.model_id:
            raise ApiError(404, f"the model {req.model!r} does not exist here; this server "
                                f"serves {engine.model_id!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        ids = await run_in_threadpool(engine.encode, req)
        try:
            job = engine.submit(ids, req, asyncio.get_running_loop())
        except Busy as b:
            raise ApiError(429, "the server is busy: every slot and queue place is taken; "
                                "retry later", type="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(b.retry_after)}) from None
        reply = Reply(req.kind, engine.model_id)
        where = f"{request.method} {request.url.path}"
        if req.stream:
            return StreamingResponse(stream(job, reply, req, where), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        return await collect(request, job, reply, where)

    def done_line(where: str, ev: Done, t0: float, stream: bool) -> str:
        return (f"pocket-mlx serve: 200 {where}{' (stream)' if stream else ''}: "
                f"{ev.prompt_tokens} prompt tokens ({ev.cached_tokens} cached), "
                f"{ev.completion_tokens} completion tokens, {ev.finish_reason}, "
                f"{time.perf_counter() - t0:.2f} s")

    async def collect(request: Request, job: Job, reply: Reply, where: str) -> Response:
        t0 = time.perf_counter()
        pieces: list[str] = []
        finished = False
        checked = time.perf_counter()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    ev = None
                # Checked by the clock: while tokens flow, the wait above never times out.
                if time.perf_counter() - checked >= DISCONNECT_POLL_S:
                    checked = time.perf_counter()
                    if await request.is_disconnected():
                        log(f"pocket-mlx serve: {where}: the client went away; stopped")
                        return Response(status_code=499)
                if ev is None:
                    continue
                if isinstance(ev, Piece):
                    pieces.append(ev.text)
                elif isinstance(ev, Failed):
                    finished = True
                    raise ev.error
                elif isinstance(ev, Done):
                    finished = True
                    log(done_line(where, ev, t0, False))
                    return JSONResponse(reply.full(
                        "".join(pieces), finish_reason(ev.finish_reason),
                        usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)))
        finally:
            if not finished:
                job.cancel()

    async def stream(job: Job, reply: Reply, req: GenRequest, where: str) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format. When the client disconnects, Starlette
        cancels this generator at its `await`: `finally` then cancels the job."""
        t0 = time.perf_counter()
        inc = req.include_usage
        finished = False

        def data(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

        try:
            if req.kind == "chat":
                yield data(reply.chunk(role=True, with_usage=inc))
            while True:
                ev = await job.events.get()
                if isinstance(ev, Piece):
                    yield data(reply.chunk(ev.text, with_usage=inc))
                elif isinstance(ev, Failed):
                    finished = True
                    log(f"pocket-mlx serve: {ev.error.status} {where} (stream): "
                        f"{one_line(ev.error.message)}")
                    yield data(ev.error.body())
                    return
                elif isinstance(ev, Done):
                    finished = True
                    yield data(reply.chunk(None, finish_reason(ev.finish_reason),
                                           with_usage=inc))
                    if inc:
                        yield data(reply.usage_chunk(usage(ev.prompt_tokens, ev.completion_tokens,
                                                           ev.cached_tokens)))
                    yield "data: [DONE]\n\n"
                    log(done_line(where, ev, t0, True))
                    return
        finally:
            if not finished:
                job.cancel()
                log(f"pocket-mlx serve: {where} (stream): the client went away; stopped")

    async def chat(request: Request) -> Response:
        return await generate(request, parse_chat)

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

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
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
    ]
    middleware = []
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=[cors],
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: http_error})
