"""The browser chat page at / and /chat: one HTML file (static/chat.html) with its CSS and
JavaScript inline, so it works offline and sends nothing to another host.

Why a static page and not a template: it reads the model's name and window from GET /v1/models
and talks to POST /v1/chat/completions like any other client, so it needs nothing from the
server but its bytes. It is served without the API key (it holds no secret; its API calls carry
the key, which it asks for once on a 401). Its Content-Security-Policy lets it reach this server
only and run only its own script (pinned by hash), so a reply rendered as HTML could not run
code or fetch from elsewhere even if the page's Markdown escaping missed something.

GET / is also Ollama's liveness probe (its clients send HEAD / or GET / and want 200 with
"Ollama is running"): a browser, which asks for text/html, gets the page; HEAD and any other
GET get the probe's line.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

PATHS = ("/", "/chat")
PROBE = "Ollama is running"


def page_bytes() -> bytes:
    """The page as shipped in the package (package data, so a non-editable install has it)."""
    return files("pocket_mlx.server").joinpath("static", "chat.html").read_bytes()


def content_policy(html: bytes) -> str:
    """This page's own inline script (by its SHA-256) and styles, and requests to this origin
    only."""
    scripts = re.findall(rb"<script>(.*?)</script>", html, re.S)
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(s).digest()).decode() + "'" for s in scripts
    )
    return (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; form-action 'none'; base-uri 'none'; "
        "frame-ancestors 'none'"
    )


def routes(public: Callable[[str, Callable, str], Route]) -> list[Route]:
    """GET / and /chat, made by `public` (app.py): outside the API key like /health."""
    html = page_bytes()
    headers = {
        "Content-Security-Policy": content_policy(html),
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    async def page(request: Request) -> Response:
        if request.url.path == "/" and (request.method == "HEAD" or "text/html" not in
                                        request.headers.get("accept", "")):
            return PlainTextResponse(PROBE)
        return Response(html, media_type="text/html; charset=utf-8", headers=headers)

    return [public(p, page, "GET") for p in PATHS]
