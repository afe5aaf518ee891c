"""Every refusal as the API's error object, one line in the log, one count in /metrics.

Why a route middleware (`RouteOutcome`) and not only an exception handler: the error's shape
(OpenAI's or Anthropic's) and the /metrics label are the route's, and an unexpected exception
must become a plain 500 there, never reach Starlette's ServerErrorMiddleware, which would print
a traceback. What no route answers (404, 405) goes to `http_error`, the app's handler.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pocket_mlx.errors import one_line
from pocket_mlx.server.requests import ApiError

log = logging.getLogger(__name__)


def error_response(e: ApiError, shape: Callable[[ApiError], dict] = ApiError.body) -> Response:
    """The error object as ASCII JSON: a message may quote the request's own text, lone
    surrogates included, which UTF-8 cannot encode."""
    return Response(
        json.dumps(shape(e)), status_code=e.status, headers=e.headers, media_type="application/json"
    )


def internal_error() -> ApiError:
    return ApiError(
        500,
        "internal server error; see the server's log",
        type="server_error",
        code="internal_error",
    )


class RouteOutcome:
    """Route middleware: the response's status counted under `label` (the route's path, one
    series per route, not per URL), and a failure before the response starts answered with
    the error object in `shape`, logged on one line."""

    def __init__(self, app: ASGIApp, shape: Callable[[ApiError], dict], label: str) -> None:
        self.app, self.shape, self.label = app, shape, label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                request.app.state.metrics.request(self.label, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except ApiError as e:
            if started:
                raise
            log.warning(f"{e.status} {request.method} {request.url.path}: {one_line(e.message)}")
            await error_response(e, self.shape)(scope, receive, counted)
        except Exception as e:  # noqa: BLE001 - never a traceback to the client
            if started:
                raise
            log.error(
                f"500 {request.method} {request.url.path}: {type(e).__name__}: {one_line(e)}",
            )
            await error_response(internal_error(), self.shape)(scope, receive, counted)


async def http_error(request: Request, exc: Exception) -> Response:
    """The app's handler for what no route answered: no such path (404), a method the path
    does not take (405), anything else (500, details in the log only)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        e = ApiError(404, f"no such endpoint: {request.url.path}", code="not_found")
    elif status == 405:
        e = ApiError(
            405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"
        )
    elif isinstance(exc, HTTPException):
        e = ApiError(status, one_line(exc.detail), code=None)
    else:
        log.error(
            f"500 {request.method} {request.url.path}: {type(exc).__name__}: {one_line(exc)}",
        )
        e = internal_error()
    if status != 500:
        log.warning(f"{e.status} {request.method} {request.url.path}: {e.message}")
    request.app.state.metrics.request("other", e.status)
    return error_response(e)
