"""What `create_app` was told, kept on `app.state` for the module-level handlers.

Why not a closure: handlers, middleware and exception handlers each read `request.app.state`
(`engine`, `metrics`, `settings`), Starlette's own way to share app-wide objects, so each lives
in the module of its idea and can be read on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

if TYPE_CHECKING:  # the engine module loads MLX; this one is read by every handler
    from pocket_mlx.server.engine import Engine


@dataclass(frozen=True)
class Settings:
    """`api_key`: the key as bytes (None: no key asked); `max_body`: the largest request body
    read, in bytes; `aliases`: other model names answered to."""

    api_key: bytes | None
    max_body: int
    aliases: tuple[str, ...]


def engine(conn: HTTPConnection) -> Engine:
    return conn.app.state.engine


def settings(conn: HTTPConnection) -> Settings:
    return conn.app.state.settings
