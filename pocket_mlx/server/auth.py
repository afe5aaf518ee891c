"""The API key (`--api-key`), checked by a Starlette middleware on each route that needs it.

Why per route and not around the whole app: the routes left open (/health, the chat page) are
then the ones built without it, not a list of paths to keep in step with the route table, and
an unknown path or a wrong method stays a 404 or 405 as without a key. The 401 is raised as an
`ApiError`, so the route's own error shape (OpenAI's or Anthropic's) and /metrics label apply
to it as to any other refusal (server/errors.py).
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pocket_mlx.server.requests import ApiError


def key_matches(headers: Headers, key: bytes) -> bool:
    """The Bearer key (OpenAI's clients), or `x-api-key` (Anthropic's)."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        given = headers.get("x-api-key", "")
    # compare_digest: the time taken does not tell how much of the key matched.
    return hmac.compare_digest(given.strip().encode("utf-8"), key)


class RequireApiKey:
    """Route middleware: the request carries the server's key (`app.state.settings.api_key`;
    None: no key asked), else a 401 with WWW-Authenticate."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope["app"].state.settings.api_key
        if key is not None and not key_matches(Headers(scope=scope), key):
            raise ApiError(
                401,
                "invalid or missing API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        await self.app(scope, receive, send)
