"""What `create_app` was told, kept on `app.state` for the module-level handlers.

Why not a closure: handlers, middleware and exception handlers each read `request.app.state`
(`worker`, `metrics`, `settings`), Starlette's own way to share app-wide objects, so each lives
in the module of its idea and can be read on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from pocket_mlx.server.jobs import Worker


@dataclass(frozen=True)
class Settings:
    """`api_key`: the key as bytes (None: no key asked); `max_body`: the largest request body
    read, in bytes; `aliases`: other model names answered to."""

    api_key: bytes | None
    max_body: int
    aliases: tuple[str, ...]


def worker(conn: HTTPConnection) -> Worker:
    """The serve worker (server/worker.py), as server/jobs.py's `Worker` protocol: the HTTP
    side never imports the worker's module, which loads MLX."""
    return conn.app.state.worker


def settings(conn: HTTPConnection) -> Settings:
    return conn.app.state.settings
