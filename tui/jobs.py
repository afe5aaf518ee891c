"""The chat's model side: the jobs the UI sends, the turn it may undo, and the engine thread
that answers them (engine/worker.py's `ModelWorker`), reporting only through messages
(tui/events.py) and `LiveReply`.

Why apart from the app: the app is the UI (widgets, keys, the conversation on screen); what
runs on the model's thread, and what crosses between the two, is here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from textual.message import Message

from pocket_mlx.config import ModelFolder
from pocket_mlx.engine.generation import GenerationStats
from pocket_mlx.engine.loader import load
from pocket_mlx.engine.prompt_cache import PromptCache, open_store
from pocket_mlx.engine.reasoning import thinking_kwargs
from pocket_mlx.engine.session import ChatSession, ContextOverflow, Settings
from pocket_mlx.engine.worker import ModelWorker
from pocket_mlx.errors import PocketError
from pocket_mlx.tui.events import (
    ContextMeasured,
    ContextTrimmed,
    EngineNotice,
    ModelFailed,
    ModelReady,
    PrefillProgress,
    ReplyDone,
)
from pocket_mlx.tui.model_info import model_info

CHUNK_S = 0.2  # the engine publishes reply text and a stats copy at most this often (5 Hz)
POLL_S = 0.1  # an idle engine checks this often whether the app closed


class Job(NamedTuple):
    messages: list[dict]
    settings: Settings
    device: str
    kind: str = "reply"  # "reply" | "measure" (count the tokens of conversation `conv_id`)
    conv_id: str = ""


class Turn(NamedTuple):
    """The turn being answered, to undo it if no reply comes."""

    kind: str  # "send" | "regenerate"
    message: dict  # the user message
    previous: dict | None = None  # regenerate: the reply it replaces


def undone_note(turn: Turn | None) -> str:
    """What became of a turn taken back, for the notice that says so."""
    if turn is None:
        return ""
    if turn.kind == "send":
        return " (not saved; back in the prompt)"
    return " (the previous reply is kept)"


class LiveReply:
    """What the engine thread hands the UI while a reply is being written, without messages.

    The engine `put`s text and a stats copy (at most every CHUNK_S); the UI `take`s them on its
    tick. No message per chunk means no wake-up of the UI's event loop between ticks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._reasoning: list[str] = []  # a thinking model's reasoning, apart from its text
        self._stats: GenerationStats | None = None
        self._context = 0

    def put(self, text: str, stats: GenerationStats, context: int, reasoning: str = "") -> None:
        with self._lock:
            if text:
                self._text.append(text)
            if reasoning:
                self._reasoning.append(reasoning)
            self._stats, self._context = stats, context

    def latest(self) -> tuple[GenerationStats | None, int]:
        with self._lock:
            return self._stats, self._context

    def take_text(self) -> str:
        with self._lock:
            text, self._text = "".join(self._text), []
            return text

    def take_reasoning(self) -> str:
        with self._lock:
            text, self._reasoning = "".join(self._reasoning), []
            return text

    def reset(self) -> None:
        with self._lock:
            self._text, self._reasoning, self._stats, self._context = [], [], None, 0


class ChatEngine:
    """Loads the model and answers the UI's jobs, on the thread that calls `run` (the app's
    Textual thread worker). `post` is the app's `post_message`; `stop` is set by the UI to
    stop the reply being written."""

    def __init__(self, post: Callable[[Message], object], live: LiveReply,
                 stop: threading.Event, *, model: str | Path | ModelFolder | None,
                 device: str,
                 model_name: str, prompt_cache_mb: int, distributed=None,
                 speculative: str = "off", num_draft_tokens: int = 3) -> None:
        self.post, self.live, self.stop = post, live, stop
        # Speculative decoding of every reply (chat --speculative; ChatSession), not under
        # `distributed` (each rank would have to draft alike).
        self.speculative, self.num_draft_tokens = speculative, num_draft_tokens
        self.model_ref, self.device, self.model_name = model, device, model_name
        # The replies' caches, kept in RAM and written through to the data folder: a resumed
        # conversation (--resume, ctrl+o) continues from its last reply instead of prefilling
        # it all again. 0 turns it off.
        self.prompt_cache_mb = prompt_cache_mb
        # Rank 0's distributed.Lockstep under `chat --distributed` (the other ranks follow it,
        # cli/chat.py): this rank's share is loaded, a beat goes out while idle, "stop" when
        # the app closes.
        self.distributed = distributed
        self.worker = ModelWorker(self._load, lockstep=distributed, poll_s=POLL_S,
                                  exit_on_lost=False)

    def put(self, job: Job) -> None:
        self.worker.put(job)

    def run(self, cancelled: Callable[[], bool]) -> None:
        """Load, then answer jobs until `cancelled()` (the app closes)."""
        if self.worker.run(lambda session: self._serve(session, cancelled), self._setup):
            return
        e = self.worker.error
        if not isinstance(e, Exception):
            raise e
        # Any load failure is reported, not a traceback.
        self.post(ModelFailed(str(e) if isinstance(e, PocketError) else
                              f"{type(e).__name__}: {e}"))

    def _load(self) -> tuple:
        dist = self.distributed
        return load(self.model_ref, device=self.device, fuse=True,
                    shard=dist.shard if dist else None)

    def _setup(self, model, tokenizer) -> tuple[ChatSession, object]:
        info = replace(model_info(model, self.model_name),
                       thinking_switch=bool(thinking_kwargs(tokenizer.chat_template, True)))
        if self.distributed is not None:  # no prompt cache: each reply starts fresh on every rank
            return ChatSession(model, tokenizer, lockstep=self.distributed), info
        return ChatSession(model, tokenizer, prompt_cache=self._prompt_cache(model),
                           speculative=self.speculative,
                           num_draft_tokens=self.num_draft_tokens), info

    def _prompt_cache(self, model) -> PromptCache | None:
        try:
            # Written through: the app leaves without running teardown code (cli/chat.py).
            return open_store(model, self.prompt_cache_mb, write_through=True)
        except (OSError, PocketError) as e:  # a read-only data folder: chat without it
            self.post(EngineNotice(f"prompt cache off: {e}"))
            return None

    def _serve(self, state: tuple[ChatSession, object], cancelled: Callable[[], bool]) -> None:
        session, info = state
        self.post(ModelReady(info))
        try:
            while (job := self.worker.get(stopped=cancelled)) is not None:
                self._run_job(session, job, cancelled)
        except PocketError as e:  # a rank is gone: the chat cannot go on
            self.post(ModelFailed(str(e)))

    def _run_job(self, session: ChatSession, job: Job, cancelled: Callable[[], bool]) -> None:
        if job.kind == "measure":
            try:
                tokens = session.context_tokens(job.messages, job.settings)
            except Exception as e:  # noqa: BLE001 - a template error shows at the next turn
                self.post(EngineNotice(f"could not count the conversation's tokens: {e}"))
                return
            self.post(ContextMeasured(job.conv_id, tokens))
            return
        pending, thought, last, used, last_post = "", "", None, 0, 0.0

        def should_stop() -> bool:
            return self.stop.is_set() or cancelled()

        def progress(done: int, total: int, context: int) -> None:
            self.post(PrefillProgress(done, total, context))

        try:
            for r, used in session.generate(
                job.messages, job.settings, job.device, progress=progress,
                should_stop=should_stop, warn=lambda m: self.post(EngineNotice(m)),
                trimmed=lambda n, out: self.post(ContextTrimmed(n, out)),
            ):
                last = r
                pending += r.text
                thought += r.reasoning
                now = time.perf_counter()
                if now - last_post >= CHUNK_S and r.stats.phase != "done":
                    self.live.put(pending, replace(r.stats), used, thought)
                    pending, thought, last_post = "", "", now
            stats = replace(last.stats) if last is not None else None
            self.post(ReplyDone(pending, stats, used, reasoning=thought))
        except ContextOverflow as e:
            self.post(ReplyDone(pending, None, used, error=str(e), refused=True))
        except PocketError as e:
            self.post(ReplyDone(pending, None, used, error=str(e)))
        except Exception as e:  # noqa: BLE001 - keep the app alive, show what broke
            self.post(ReplyDone(pending, None, used, error=f"{type(e).__name__}: {e}"))
