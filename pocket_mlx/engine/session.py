"""One chat's model state: the KV cache and the exact tokens it holds. No Textual here.

Why: each turn should prefill only what the cache lacks. The conversation is re-tokenized with
the chat template every turn; when the tokens the cache holds are a prefix of it, only the rest is
fed. Regenerate rewinds to a snapshot taken before the last turn (KV caches trim; linear-attention
caches cannot, but their arrays are immutable, so keeping references is a snapshot). Anything else
(an edited system prompt, another conversation) gets a fresh cache and a full prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pocket_mlx.engine.generation import Response, SamplingParams, context_limit, stream_generate
from pocket_mlx.errors import PocketError


@dataclass
class Settings:
    """What the settings dialog edits; saved with each conversation."""

    system: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256

    def validate(self) -> None:
        SamplingParams(temperature=self.temperature, top_p=self.top_p).validate()
        if self.max_tokens < 1:
            raise PocketError(f"max tokens must be >= 1, got {self.max_tokens}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)

    def to_dict(self) -> dict:
        return {"system": self.system, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, d: dict) -> Settings:
        base = cls()
        return cls(system=str(d.get("system", base.system) or ""),
                   temperature=float(d.get("temperature", base.temperature)),
                   top_p=float(d.get("top_p", base.top_p)),
                   max_tokens=int(d.get("max_tokens", base.max_tokens)))


def _capture(cache: list) -> list[tuple]:
    return [("linear", c.conv_state, c.state, c.offset) if hasattr(c, "conv_state")
            else ("kv", c.offset) for c in cache]


def _restore(cache: list, snap: list[tuple]) -> None:
    for c, s in zip(cache, snap):
        if s[0] == "linear":
            c.conv_state, c.state, c.offset = s[1], s[2], s[3]
        else:
            c.trim(c.offset - s[1])


@dataclass
class TurnPlan:
    feed: list[int]  # ids to pass to stream_generate
    base: int  # tokens already in the cache before this turn
    reused: str  # "cache" | "snapshot" | "fresh"


class ChatSession:
    """A loaded model plus the cache of the conversation it last served."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.cache: list | None = None
        self.cache_tokens: list[int] = []
        self._snap: tuple[list[int], list[tuple]] | None = None
        self.plan_kind = ""  # how the last turn started: "cache" | "snapshot" | "fresh"

    @property
    def context_max(self) -> int:
        return context_limit(self.model)

    def reset(self) -> None:
        self.cache, self.cache_tokens, self._snap = None, [], None

    def conversation_ids(self, messages: list[dict], system: str = "") -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m["role"], "content": m["content"]} for m in messages]
        tok = self.tokenizer
        return tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)

    def plan(self, ids: list[int]) -> TurnPlan:
        """Pick the cache state to continue from; sets `self.cache` accordingly."""

        def is_prefix(held: list[int]) -> bool:
            return len(held) < len(ids) and ids[: len(held)] == held

        if self.cache is not None and is_prefix(self.cache_tokens):
            self._snap = (list(self.cache_tokens), _capture(self.cache))
            return TurnPlan(ids[len(self.cache_tokens):], len(self.cache_tokens), "cache")
        if self.cache is not None and self._snap is not None and is_prefix(self._snap[0]):
            _restore(self.cache, self._snap[1])
            self.cache_tokens = list(self._snap[0])
            return TurnPlan(ids[len(self.cache_tokens):], len(self.cache_tokens), "snapshot")
        self.cache = self.model.make_cache()
        self.cache_tokens = []
        self._snap = ([], _capture(self.cache))
        return TurnPlan(list(ids), 0, "fresh")

    def generate(
        self,
        messages: list[dict],
        settings: Settings,
        device: str,
        *,
        progress: Callable[[int, int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        warn: Callable[[str], object] = print,
    ) -> Iterator[tuple[Response, int]]:
        """Yield (response, tokens in context) for the reply to `messages`; `progress` gets
        (prompt tokens done, prompt tokens to do, tokens in context)."""
        ids = self.conversation_ids(messages, settings.system)
        plan = self.plan(ids)
        self.plan_kind = plan.reused
        prog = (lambda done, total: progress(done, total, plan.base + done)) if progress else None
        last = None
        try:
            for r in stream_generate(self.model, self.tokenizer, plan.feed,
                                     max_tokens=settings.max_tokens,
                                     sampling=settings.sampling(), device=device,
                                     cache=self.cache, progress=prog,
                                     should_stop=should_stop, warn=warn):
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
        elif self._snap is not None and self.cache is not None:
            _restore(self.cache, self._snap[1])  # stopped mid-prefill: back to a known state
            self.cache_tokens = list(self._snap[0])
        else:
            self.reset()
