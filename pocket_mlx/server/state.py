"""What `create_app` was told, kept on `app.state` for the module-level handlers.

Why not a closure: handlers, middleware and exception handlers each read `request.app.state`
(`engine`, `metrics`, `settings`), Starlette's own way to share app-wide objects, so each lives
in the module of its idea and can be read on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

if TYPE_CHECKING:  # the engine module loads MLX; this one is read by every handler
    from pocket_mlx.server.engine import Engine


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    """`api_key`: the key as bytes (None: no key asked); `max_body`: the largest request body
    read, in bytes; `aliases`: other model names answered to; `log`: where a log line goes."""

    api_key: bytes | None
    max_body: int
    aliases: tuple[str, ...]
    log: Callable[[str], object]


def engine(conn: HTTPConnection) -> Engine:
    return conn.app.state.engine


def settings(conn: HTTPConnection) -> Settings:
    return conn.app.state.settings


def log(conn: HTTPConnection, line: str) -> None:
    """One line in the server's log, prefixed as every serve line is."""
    conn.app.state.settings.log(f"pocket-mlx serve: {line}")
