"""The watchdog of a distributed run: a child process that ends this one when a deadline passes.

Why a process, and why it ends its parent from outside instead of raising: MLX holds the GIL
while `mx.distributed.init` or a ring collective waits for its peers (checked: no Python thread
runs meanwhile), so nothing inside the process can notice a peer that never connects or hangs;
only another process can, and the only thing it can do is signal.
"""

from __future__ import annotations

import os
import subprocess
import sys

# The child's program. The parent writes "SECONDS MESSAGE" lines to arm it and "-" to disarm;
# when a deadline passes it prints the message as one line and ends the parent; when the parent
# ends, its pipe closes and so does the child.
_WATCHDOG = r"""
import os, select, signal, sys, time
parent, deadline, what, buf = int(sys.argv[1]), None, "", b""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([0], [], [], wait)
    if ready:
        data = os.read(0, 65536)
        if not data:
            sys.exit(0)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line == b"-":
                deadline = None
            else:
                secs, _, msg = line.decode().partition(" ")
                deadline, what = time.monotonic() + float(secs), msg
    elif deadline is not None and time.monotonic() >= deadline:
        sys.stderr.write("error: " + what + "\n")
        sys.stderr.flush()
        try:
            os.kill(parent, signal.SIGTERM)
            time.sleep(2)
            os.kill(parent, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
"""


class Watchdog:
    """Ends this process with one line on stderr when a deadline passes without `disarm`: a
    peer that never connects, or hangs, would otherwise block a collective forever (MLX's ring
    has no timeout of its own). Killed by a signal, the process exits with 143 (SIGTERM)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid())],
                                      stdin=subprocess.PIPE, close_fds=True)

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def arm(self, seconds: float, what: str) -> None:
        self._send(f"{seconds} rank {self.rank}: {' '.join(what.split())}")

    def disarm(self) -> None:
        self._send("-")
