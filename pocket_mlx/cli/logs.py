"""The one logging setup: every module logs through `logging.getLogger(__name__)`, and the CLI
(cli/main.py) sends what the `pocket_mlx` loggers say to stderr, one line each, as
"pocket-mlx COMMAND: message".

Why the standard module: the server's log lines come from the HTTP handlers, the engine thread
and the batch, the chat's warnings from the session and the prompt cache; each says what it has
to say and the prefix (the command) is the formatter's, written once. Nothing is printed by the
library itself until a command configures it (Python's default shows warnings only), so an
embedding program or a test decides where the lines go (pytest's caplog reads them).
"""

from __future__ import annotations

import logging
import sys

#: The package's root logger: its children are every module of pocket_mlx (and pocket_mlx.tui).
ROOT = "pocket_mlx"


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is at each line (a test's capture, a redirect
    made after setup), flushed per line: the log of a server is read as it runs."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # set by StreamHandler.__init__; sys.stderr is read instead
        pass


def setup_logging(command: str, level: int = logging.INFO) -> None:
    """Lines from `pocket_mlx` loggers at `level` and above go to stderr as "pocket-mlx
    `command`: message". Called once per run by cli/main.py; calling it again (a test running
    several commands in one process) replaces the handler instead of adding a second one."""
    logger = logging.getLogger(ROOT)
    for h in [h for h in logger.handlers if isinstance(h, _Stderr)]:
        logger.removeHandler(h)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(f"pocket-mlx {command}: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
