"""The HTTP face of `pocket-mlx serve`: an ASGI app with OpenAI's and Anthropic's endpoints.

Why Starlette under uvicorn: a small, standard ASGI stack (two pure-Python packages, no code
generation), whose `StreamingResponse` sends server-sent events and cancels the stream when the
client goes away, which is what stops a generation early. FastAPI would add pydantic models and
OpenAPI pages on top of the same Starlette; the request checking lives in `server/openai.py`
and `server/anthropic.py` instead (making server/requests.py's `GenRequest`, refusing with its
`ApiError`), in the shape of each API's own errors, so nothing here needs it. `http.server`
would mean threads per connection and hand-written chunked streaming.

Endpoints: GET /health (no key needed), GET /metrics (Prometheus text), GET /v1/models (and
/v1/models/{id}), POST /v1/chat/completions and POST /v1/completions (streamed with
`"stream": true`; server/routes_openai.py), POST /v1/responses (OpenAI's Responses API,
stateless; server/routes_responses.py), Anthropic's POST /v1/messages and
/v1/messages/count_tokens (server/routes_anthropic.py), Ollama's /api/tags, /api/show, /api/chat,
/api/generate, /api/ps, /api/version (server/routes_ollama.py), the embeddings (POST /api/embed,
/api/embeddings, /v1/embeddings: server/routes_embeddings.py), and the browser chat page at GET /
and /chat (server/page.py, no key needed; GET / without text/html and HEAD / answer Ollama's
liveness probe). Tool calls: server/tools.py. Requests run on the model's
thread (server/worker.py's `ServeWorker`, on engine/worker.py's `ModelWorker`), up to
--max-concurrency decoded together (engine/batch.py); extra requests wait in a bounded queue,
then get 429 with Retry-After. Every refusal is the API's error object with a 4xx status and
one line in the server's log (server/errors.py); anything unexpected is a 500 with a generic
message (the details go to the log only).

This module only assembles the app: the route table, each route's key check (server/auth.py)
and error shape, CORS, and `app.state` (worker, metrics, settings) that the handlers read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, compile_path

from pocket_mlx.server import (
    anthropic,
    ollama,
    page,
    routes_anthropic,
    routes_embeddings,
    routes_ollama,
    routes_openai,
    routes_responses,
)
from pocket_mlx.server.auth import RequireApiKey
from pocket_mlx.server.errors import RouteOutcome, http_error
from pocket_mlx.server.jobs import Worker
from pocket_mlx.server.requests import ApiError
from pocket_mlx.server.state import Settings

DEFAULT_MAX_BODY = 8 * 2**20  # bytes; a 2,000-token prompt is ~10 kB of JSON

Handler = Callable[[Request], Awaitable[Response]]


def route(
    path: str,
    handler: Handler,
    method: str,
    *,
    auth: bool = True,
    shape: Callable[[ApiError], dict] = ApiError.body,
) -> Route:
    """A route whose failures are error objects in `shape` (OpenAI's unless told), counted in
    /metrics under its path with parameters unfilled ("/v1/models/{id}"), behind the key
    unless `auth` is false."""
    label = compile_path(path)[1]
    middleware = [Middleware(RouteOutcome, shape=shape, label=label)]
    if auth:
        middleware.append(Middleware(RequireApiKey))
    return Route(path, handler, methods=[method], middleware=middleware)


def public(path: str, handler: Handler, method: str) -> Route:
    return route(path, handler, method, auth=False)


def ollama_route(path: str, handler: Handler, method: str, *, auth: bool = True) -> Route:
    """An Ollama endpoint: its refusals are Ollama's {"error": ...}."""
    return route(path, handler, method, auth=auth, shape=ollama.error_body)


def ollama_routes() -> list[Route]:
    """Ollama's API (server/routes_ollama.py; GET / and HEAD / answer its probe, page.py)
    and the embedding endpoints (server/routes_embeddings.py)."""
    ol, e = routes_ollama, routes_embeddings
    return [
        route("/v1/embeddings", e.openai_embeddings, "POST"),
        ollama_route("/api/version", ol.version, "GET", auth=False),
        ollama_route("/api/tags", ol.tags, "GET"),
        ollama_route("/api/ps", ol.ps, "GET"),
        ollama_route("/api/show", ol.show, "POST"),
        ollama_route("/api/chat", ol.chat, "POST"),
        ollama_route("/api/generate", ol.generate, "POST"),
        ollama_route("/api/embed", e.embed, "POST"),
        ollama_route("/api/embeddings", e.embeddings, "POST"),
        *[ollama_route(p, ol.managed_elsewhere, m) for p, m in (
            ("/api/pull", "POST"), ("/api/push", "POST"), ("/api/create", "POST"),
            ("/api/copy", "POST"), ("/api/delete", "DELETE"), ("/api/blobs/{digest}", "POST"),
            ("/api/blobs/{digest}", "HEAD"))],
    ]


def routes() -> list[Route]:
    o, a = routes_openai, routes_anthropic
    return [
        public("/health", o.health, "GET"),
        route("/metrics", o.metrics, "GET"),
        route("/v1/models", o.models, "GET"),
        route("/v1/models/{id:path}", o.model, "GET"),
        route("/v1/chat/completions", o.chat, "POST"),
        route("/v1/completions", o.completions, "POST"),
        route("/v1/responses", routes_responses.create, "POST"),
        route("/v1/messages", a.messages, "POST", shape=anthropic.error_body),
        route("/v1/messages/count_tokens", a.count_tokens, "POST", shape=anthropic.error_body),
        *ollama_routes(),
        *page.routes(public),  # the browser chat page: GET / and /chat
    ]


def create_app(
    worker: Worker,
    *,
    api_key: str | None = None,
    cors: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    aliases: Sequence[str] = (),
) -> Starlette:
    """The ASGI app serving `worker`'s model. `api_key`: Bearer key required on every endpoint
    but /health and the chat page; `cors`: the one origin allowed to call from a browser
    (None: no CORS)."""
    middleware = []
    if cors:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=[cors],
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
            )
        )
    handlers: dict = {HTTPException: http_error, Exception: http_error}
    app = Starlette(routes=routes(), middleware=middleware, exception_handlers=handlers)
    app.state.worker = worker
    app.state.metrics = worker.metrics
    app.state.settings = Settings(
        api_key=api_key.encode("utf-8") if api_key else None,
        max_body=max_body,
        aliases=tuple(aliases),
    )
    return app
