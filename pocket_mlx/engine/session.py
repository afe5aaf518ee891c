"""One chat's model state: the KV cache and the exact tokens it holds. No Textual here.

Why: each turn should prefill only what the cache lacks. The conversation is re-tokenized with
the chat template every turn; when the tokens the cache holds are a prefix of it, only the rest is
fed. Regenerate rewinds to a snapshot taken before the last turn (KV caches trim; linear-attention
caches cannot, but their arrays are immutable, so keeping references is a snapshot: see
`prompt_cache.capture`). With a shared `PromptCache`, the cache after each reply is stored there,
and so is the cache at message boundaries and every SNAPSHOT_INTERVAL tokens of a prefill, as
`serve` stores them (engine/snapshot_points.py); a conversation this session does not hold
(another one with the same system prompt, or one resumed after a restart) starts from the
longest stored prefix of it. Anything else (an edited system prompt, another
conversation) gets a fresh cache and a full prefill.

At the context limit: a turn is sent only with room for a reply (`reply_room`). When the
conversation no longer fits, the oldest turns are dropped from what the model sees (the window;
the saved conversation keeps them) down to about three quarters of the context, so the next few
turns continue from the cache instead of each dropping one more turn and prefilling everything
again. The window's start is kept from turn to turn. A new start means a fresh cache and a prefill
of the kept turns: the linear-attention state cannot be trimmed from the front. A turn that does
not fit even alone is refused (`ContextOverflow`) before the cache is touched.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pocket_mlx.engine.generation import Response, SamplingParams, context_limit, stream_generate
from pocket_mlx.engine.loader import use_device
from pocket_mlx.engine.params import DEFAULT_MAX_TOKENS, check_max_tokens, checked
from pocket_mlx.engine.prompt_cache import LayerState, PromptCache, capture, restore
from pocket_mlx.engine.reasoning import thinking_for, thinking_kwargs
from pocket_mlx.engine.snapshot_points import message_boundaries, snapshot_points
from pocket_mlx.errors import PocketError

log = logging.getLogger(__name__)

REPLY_SHARE = 4  # a reply's room is max_tokens, but at most a quarter of the context
HEADROOM_SHARE = 4  # dropping leaves about a quarter of the context free for the next turns


class ContextOverflow(PocketError):
    """The last message (with the system prompt and room for a reply) is longer than the
    model's context on its own: dropping older turns cannot help."""


@dataclass
class Settings:
    """What the settings dialog edits; saved with each conversation."""

    system: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    # Thinking models: on (True) or off (False) through the chat template's `enable_thinking`,
    # or the template's default (None).
    thinking: bool | None = None

    def validate(self) -> None:
        self.sampling().validate()
        checked(check_max_tokens, self.max_tokens)
        if self.thinking is not None and not isinstance(self.thinking, bool):
            raise PocketError(f"thinking must be on, off or auto, got {self.thinking!r}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)

    def to_dict(self) -> dict:
        return {"system": self.system, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens, "thinking": self.thinking}

    @classmethod
    def from_dict(cls, d: dict) -> Settings:
        base = cls()
        return cls(system=str(d.get("system", base.system) or ""),
                   temperature=float(d.get("temperature", base.temperature)),
                   top_p=float(d.get("top_p", base.top_p)),
                   max_tokens=int(d.get("max_tokens", base.max_tokens)),
                   thinking=d.get("thinking", base.thinking))


@dataclass
class Window:
    """The part of a conversation the model sees: messages[start:] after the system prompt."""

    start: int
    ids: list[int]
    dropped: int  # messages this turn newly dropped (0: the window's start did not move)


def _role_content(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _with_system(messages: list[dict], system: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + _role_content(messages)


@dataclass
class TurnPlan:
    feed: list[int]  # ids to pass to stream_generate
    base: int  # tokens already in the cache before this turn
    reused: str  # "cache" | "snapshot" | "stored" | "fresh"


class ChatSession:
    """A loaded model plus the cache of the conversation it last served."""

    def __init__(self, model, tokenizer, prompt_cache: PromptCache | None = None,
                 lockstep=None, speculative: str = "off", num_draft_tokens: int = 3):
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_cache = prompt_cache
        # Speculative decoding of every reply (engine/speculative.py; not under lockstep).
        self.speculative, self.num_draft_tokens = speculative, num_draft_tokens
        # Rank 0's distributed.Lockstep under `chat --distributed`: every reply is generated by
        # every rank from a fresh cache (the whole window prefilled each turn; no cache kept).
        self.lockstep = lockstep
        self.cache: list | None = None
        self.cache_tokens: list[int] = []
        self._snap: tuple[list[int], list[LayerState]] | None = None
        # How the last turn started: "cache" | "snapshot" | "stored" | "fresh".
        self.plan_kind = ""
        # The messages left out of the model's context, as role/content: the window starts
        # after them as long as the conversation still begins with them.
        self.dropped: list[dict] = []

    @property
    def context_max(self) -> int:
        return context_limit(self.model)

    def reset(self) -> None:
        self.cache, self.cache_tokens, self._snap = None, [], None
        self.dropped = []

    def reply_room(self, settings: Settings) -> int:
        """Tokens kept free for the reply when a turn is sent."""
        return max(1, min(settings.max_tokens, self.context_max // REPLY_SHARE))

    def window(self, messages: list[dict], settings: Settings) -> Window:
        """The messages the model sees for a reply to `messages`: from the current start if
        they fit with room for the reply, else from the first later turn (a user message) that
        fits in three quarters of the context, else the first that fits at all. Raises
        ContextOverflow when the last turn alone does not fit. Does not change the session."""
        limit, room = self.context_max, self.reply_room(settings)
        held = len(self.dropped)
        start = held if _role_content(messages[:held]) == self.dropped else 0
        sizes: dict[int, list[int]] = {}

        def ids_from(k: int) -> list[int]:
            if k not in sizes:
                sizes[k] = self.conversation_ids(messages[k:], settings.system,
                                                 settings.thinking)
            return sizes[k]

        if len(ids_from(start)) + room <= limit:
            return Window(start, ids_from(start), 0)
        turns = [i for i, m in enumerate(messages) if i > start and m["role"] == "user"]
        last = turns[-1] if turns else start
        if len(ids_from(last)) + room > limit:
            n = len(ids_from(last))
            raise ContextOverflow(
                f"{n:,} tokens + {room:,} for the reply > the model's {limit:,}-token context, "
                "even in a new chat (ctrl+n); shorten it")
        for budget in (limit - limit // HEADROOM_SHARE, limit):
            # Fewer messages never take more tokens: the first turn that fits, by bisection.
            j = bisect_left(turns, True, key=lambda k: len(ids_from(k)) + room <= budget)
            if j < len(turns):
                k = turns[j]
                return Window(k, ids_from(k), k - start)
        raise AssertionError("unreachable: the last turn fits")  # pragma: no cover

    def context_tokens(self, messages: list[dict], settings: Settings) -> int:
        """Tokens the model would hold for this conversation now (its window), for the panel
        after a conversation is opened; the whole conversation if even its last turn is too
        long."""
        if not messages:
            return 0
        try:
            return len(self.window(messages, settings).ids)
        except ContextOverflow:
            return len(self.conversation_ids(messages, settings.system, settings.thinking))

    def conversation_ids(self, messages: list[dict], system: str = "",
                         thinking: bool | None = None) -> list[int]:
        """The prompt's tokens; `thinking` on/off reaches the template (`enable_thinking`)."""
        tok = self.tokenizer
        kwargs = thinking_kwargs(tok.chat_template, thinking)
        return tok.encode(tok.apply_chat_template(_with_system(messages, system), **kwargs),
                          add_special_tokens=False)

    def thinking(self, ids: list[int]) -> bool | None:
        """`stream_generate`'s `thinking` for a prompt (engine/reasoning.py), from its last
        tokens: enough to see whether the generation prompt left the model in a block."""
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        return thinking_for(self.tokenizer.chat_template, tail)

    def snapshot_points(self, messages: list[dict], system: str, ids: list[int],
                        plan: TurnPlan) -> list[tuple[int, str]]:
        """(position in `plan.feed`, kind) where this turn's prefill stores prompt-cache
        snapshots, chosen as `serve` chooses them: message boundaries (only when the turn
        starts from the store or afresh: continuing its own cache, the earlier messages are
        behind it already) and every SNAPSHOT_INTERVAL tokens. Without a store too: chunks end
        there with the cache on or off alike, so a reply does not depend on the cache."""
        # A thinking model's next turn renders this one without its reasoning, so it shares
        # this prompt only up to the end of its last message: a snapshot there too.
        bounds = message_boundaries(self.tokenizer, _with_system(messages, system), ids,
                                    through_last=self.thinking(ids) is not None) \
            if plan.reused in ("stored", "fresh") else []
        return [(p - plan.base, kind)
                for p, kind in snapshot_points(len(ids), bounds, plan.base)]

    def plan(self, ids: list[int]) -> TurnPlan:
        """Pick the cache state to continue from; sets `self.cache` accordingly."""

        def is_prefix(held: list[int]) -> bool:
            # Not an empty one: a new conversation in this session must look in the store (a
            # system prompt another conversation used) rather than rewind to an empty cache.
            return 0 < len(held) < len(ids) and ids[: len(held)] == held

        if self.cache is not None and is_prefix(self.cache_tokens):
            self._snap = (list(self.cache_tokens), capture(self.cache))
            return TurnPlan(ids[len(self.cache_tokens):], len(self.cache_tokens), "cache")
        if self.cache is not None and self._snap is not None and is_prefix(self._snap[0]):
            restore(self.cache, self._snap[1])
            self.cache_tokens = list(self._snap[0])
            return TurnPlan(ids[len(self.cache_tokens):], len(self.cache_tokens), "snapshot")
        self.cache, n = (self.prompt_cache.fetch(ids) if self.prompt_cache is not None
                         else (self.model.make_cache(), 0))
        self.cache_tokens = list(ids[:n])
        self._snap = (list(self.cache_tokens), capture(self.cache))
        return TurnPlan(list(ids[n:]), n, "stored" if n else "fresh")

    def generate(
        self,
        messages: list[dict],
        settings: Settings,
        device: str,
        *,
        progress: Callable[[int, int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        warn: Callable[[str], object] = print,
        trimmed: Callable[[int, int], object] | None = None,
    ) -> Iterator[tuple[Response, int]]:
        """Yield (response, tokens in context) for the reply to `messages`; `progress` gets
        (prompt tokens done, prompt tokens to do, tokens in context); `trimmed` gets (messages
        newly dropped from the model's context, messages left out in all) when the window
        moves. Raises ContextOverflow, before touching the cache, for a turn that cannot fit."""
        win = self.window(messages, settings)
        self.dropped = _role_content(messages[:win.start])
        if win.dropped and trimmed:
            trimmed(win.dropped, win.start)
        ids = win.ids
        if self.lockstep is not None:
            self.plan_kind = "fresh"
            for r in self.lockstep.stream_generate(
                    self.model, self.tokenizer, ids, max_tokens=settings.max_tokens,
                    sampling=settings.sampling(), device=device, should_stop=should_stop,
                    warn=warn):  # the reply as it comes: no reasoning parsed under lockstep
                s = r.stats
                yield r, (s.prefill_done if s.phase == "prefill"
                          else s.prompt_tokens + s.generation_tokens)
            return
        # Switch device (casting the cache with the model) before `plan` snapshots the cache:
        # a regenerate must restore arrays in the dtypes the model now runs in.
        use_device(self.model, device, self.cache)
        plan = self.plan(ids)
        self.plan_kind = plan.reused
        prog = (lambda done, total: progress(done, total, plan.base + done)) if progress else None
        points = self.snapshot_points(messages[win.start:], settings.system, ids, plan)

        def on_point(done: int, kind: str) -> None:
            if self.prompt_cache is None:
                return
            try:
                self.prompt_cache.store(ids[:plan.base + done], self.cache, kind=kind)
            except Exception as e:  # noqa: BLE001 - a snapshot is an optimisation
                log.warning("prompt cache: not stored: %s: %s", type(e).__name__, e)

        last = None
        try:
            for r in stream_generate(self.model, self.tokenizer, plan.feed,
                                     max_tokens=settings.max_tokens,
                                     sampling=settings.sampling(), device=device,
                                     cache=self.cache, progress=prog,
                                     should_stop=should_stop, warn=warn, points=points,
                                     on_point=on_point, speculative=self.speculative,
                                     num_draft_tokens=self.num_draft_tokens,
                                     thinking=self.thinking(ids)):
                last = r
                s = r.stats
                used = plan.base + (s.prefill_done if s.phase == "prefill"
                                    else s.prompt_tokens + s.generation_tokens)
                yield r, used
        finally:
            self._settle(last)

    def _settle(self, last: Response | None) -> None:
        """Record what the cache holds after a call, or roll back to the snapshot."""
        if last is not None and last.fed_tokens is not None:
            self.cache_tokens = self.cache_tokens + list(last.fed_tokens)
            if self.prompt_cache is not None and self.cache_tokens:
                # The end of a reply: where the next turn of this conversation starts.
                self.prompt_cache.store(self.cache_tokens, self.cache)
        elif self._snap is not None and self.cache is not None:
            restore(self.cache, self._snap[1])  # stopped mid-prefill: back to a known state
            self.cache_tokens = list(self._snap[0])
        else:
            self.reset()
