"""The one thread that owns the model: load, ready, serve jobs, beat while idle, finish.

Why one thread: MLX streams belong to the thread that made them (engine/devices.py), and the
model's caches and the `mx.random` state are not safe to share between threads. So `serve`
(server/engine.py), `chat` (tui/jobs.py) and the other ranks under `--distributed`
(cli/serve.py `follow`) each load the model on one thread and do all its work there; the
other threads hand it jobs through `put` and hear back through their own channels.

Under `--distributed` (engine/distributed/) the worker also keeps the ranks in step: loading
waits for every rank (`Lockstep.ready`), a worker with no job tells the others on each beat
(`Lockstep.idle`), and its end tells them to stop (`Lockstep.finish`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pocket_mlx.errors import PocketError, one_line

log = logging.getLogger(__name__)

#: `get`'s answer when no job came: non-blocking and the queue is empty.
EMPTY = object()


class ModelWorker:
    """Owns one model on the thread that calls `run` (or on a thread of its own, `start`).

    `load()` returns (model, tokenizer) (under --distributed: this rank's share); `setup(model,
    tokenizer)` prepares what serving needs (a failure there is a load failure) and returns it;
    `serve(state)` runs until the worker should stop, taking jobs with `get`."""

    def __init__(self, load: Callable[[], tuple[Any, Any]], *, lockstep=None,
                 poll_s: float | None = None, exit_on_lost: bool = True) -> None:
        self.load = load
        self.lockstep = lockstep  # rank 0's distributed.Lockstep, or None
        self.poll_s = poll_s  # without lockstep: wake this often to check `stopped`
        self.exit_on_lost = exit_on_lost  # a lost rank ends the process (serve) or raises (chat)
        self.jobs: queue.Queue = queue.Queue()
        self.ready = threading.Event()
        self.error: BaseException | None = None  # the load's
        self.model = None
        self._lost = False  # a rank is gone: no "stop" to send
        self._thread: threading.Thread | None = None

    # ---- the owner's side --------------------------------------------------------------------
    def run(self, serve: Callable[[Any], None],
            setup: Callable[[Any, Any], Any] = lambda model, tokenizer: (model, tokenizer),
            ) -> bool:
        """Load, mark ready, serve, finish, on this thread. False when the load failed
        (`error` says why; `ready` is set either way)."""
        try:
            model, tokenizer = self.load()
            if self.lockstep is not None:
                self.lockstep.ready(model)
            self.model = model
            state = setup(model, tokenizer)
        except BaseException as e:  # noqa: BLE001 - the caller reports it
            self.error = e
            self.ready.set()
            return False
        self.ready.set()
        try:
            serve(state)
        finally:
            self.finish()
        return True

    def start(self, serve: Callable[[Any], None], setup: Callable[[Any, Any], Any],
              name: str = "pocket-mlx-engine") -> None:
        """`run` on a thread of its own; returns once loaded, raising the load's error."""
        self._thread = threading.Thread(target=self.run, args=(serve, setup), name=name,
                                        daemon=True)
        self._thread.start()
        self.ready.wait()
        if self.error is not None:
            raise self.error

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def get(self, block: bool = True, stopped: Callable[[], bool] = lambda: False):
        """The next job; None when `stopped()` turns true; `EMPTY` when not `block`ing and
        there is none. While waiting under --distributed, the other ranks hear a beat
        (`Lockstep.idle`) whenever no job came in time; a lost rank raises PocketError
        (unless `exit_on_lost`: then the process ends, see `Lockstep.idle`)."""
        while True:
            if not block:
                try:
                    return self.jobs.get_nowait()
                except queue.Empty:
                    return EMPTY
            if stopped():
                return None
            ls = self.lockstep
            timeout = ls.until_beat() if ls is not None else self.poll_s
            try:
                return self.jobs.get(timeout=timeout)
            except queue.Empty:
                if ls is not None:
                    try:
                        ls.idle(self.model, exit_on_lost=self.exit_on_lost)
                    except PocketError:
                        self._lost = True
                        raise

    def finish(self) -> None:
        """Under --distributed: the other ranks stop too (nothing to tell a lost one)."""
        if self.lockstep is None or self._lost or self.model is None:
            return
        try:
            self.lockstep.finish(self.model)
        except PocketError as e:  # a rank already gone: nothing left to tell
            log.warning(one_line(e))

    # ---- the other threads' side -------------------------------------------------------------
    def put(self, job) -> None:
        self.jobs.put(job)

    def drain(self) -> list:
        """Take every job still queued (to cancel them)."""
        out = []
        while True:
            try:
                out.append(self.jobs.get_nowait())
            except queue.Empty:
                return out
