"""Drafters for speculative decoding: who proposes the tokens the verify pass checks.

A drafter is anything with the `Drafter` protocol: `draft(tokens, k)` proposes up to k tokens
to follow `tokens` (the prompt and the reply so far, the pending token last), `accepted(...)`
hears how many of them the trunk kept (and the trunk's final-norm hidden states of the rows it
kept, which an MTP head drafts from), `reset()` forgets a sequence. A drafter that samples its
drafts from a distribution q sets `last_probs` to q ([k, vocab]) after `draft`; None means
deterministic drafts (q one-hot), as lookup's are.

- `LookupDrafter` (prompt lookup): the longest n-gram (n from `max_ngram` down to
  `min_ngram`) ending the sequence that occurred before; drafts what followed it there.
- `BackOff` wraps a drafter for `auto`: while drafts keep failing it stops asking (and so runs
  plain one-token steps) for a number of steps that doubles with each failure, up to `max_skip`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx

from pocket_mlx.errors import PocketError

METHODS = ("auto", "off", "mtp", "lookup")
DEFAULT_NUM_DRAFT_TOKENS = 3
MAX_NUM_DRAFT_TOKENS = 8


class Drafter(Protocol):
    name: str
    last_probs: mx.array | None

    def draft(self, tokens: Sequence[int], k: int) -> list[int]: ...

    def accepted(self, drafted: int, accepted: int, hidden: mx.array | None = None) -> None: ...

    def reset(self) -> None: ...


class LookupDrafter:
    """Prompt lookup: n-gram matches over the prompt and the reply. An index from each n-gram
    to where it last ended is extended as tokens arrive, so a draft costs O(new tokens)."""

    name = "lookup"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.last_probs = None
        self.reset()

    def reset(self) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        self.tokens: list[int] = []

    def _extend(self, tokens: Sequence[int]) -> None:
        """Index every n-gram ending before the last token (the last one is the query: its own
        occurrence must not match itself)."""
        n = len(self.tokens)
        if n and (len(tokens) < n or tokens[n - 1] != self.tokens[-1]):
            self.reset()  # another sequence, or a rewound one
        start = len(self.tokens)
        self.tokens.extend(tokens[start:])
        for end in range(max(start, 1), len(self.tokens)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self.index[tuple(self.tokens[end - n : end])] = end

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_ngram:
            return []
        self._extend(tokens)
        t = self.tokens
        for n in range(min(self.max_ngram, len(t) - 1), self.min_ngram - 1, -1):
            pos = self.index.get(tuple(t[-n:]))
            if pos is not None and pos < len(t):
                return t[pos : pos + k]
        return []

    def accepted(self, drafted: int, accepted: int, hidden: mx.array | None = None) -> None:
        pass


class BackOff:
    """`auto`'s wrapper: after a pass whose drafts were all rejected, skip drafting for `skip`
    steps (1, 2, 4, ... up to `max_skip`); any accepted draft resets it. A verify pass costs
    more than a one-token step (the MoE routes k + 1 tokens), so drafts that keep failing are
    a loss; they are only tried again now and then."""

    def __init__(self, inner, max_skip: int = 32) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_skip = max_skip
        self.reset()

    @property
    def last_probs(self):
        return self.inner.last_probs

    def reset(self) -> None:
        self.skip, self.wait = 0, 0
        self.inner.reset()

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        if self.wait > 0:
            self.wait -= 1
            return []
        return self.inner.draft(tokens, k)

    def accepted(self, drafted: int, accepted: int, hidden: mx.array | None = None) -> None:
        self.inner.accepted(drafted, accepted, hidden)
        if drafted == 0:
            return
        if accepted == 0:
            self.skip = min(self.max_skip, max(1, 2 * self.skip))
            self.wait = self.skip
        else:
            self.skip = 0


def check_num_draft_tokens(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_DRAFT_TOKENS:
        raise PocketError(f"--num-draft-tokens must be 1..{MAX_NUM_DRAFT_TOKENS}, got {k!r}")
    return k


def mtp_drafter(model):
    """The model's MTP head as a drafter, or None when it has none. The head itself (models/,
    branch mtp) exposes `model.mtp_drafter()`; until then no model has one."""
    make = getattr(model, "mtp_drafter", None)
    return make() if callable(make) else None


def make_drafter(method: str, model) -> Drafter | None:
    """The drafter of `--speculative METHOD` for `model`, or None (plain decode). `mtp` on a
    model without a head is a PocketError; `auto` is mtp when there is a head, else lookup,
    with back-off either way."""
    if method not in METHODS:
        raise PocketError(f"--speculative must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "off":
        return None
    if method == "lookup":
        return LookupDrafter()
    head = mtp_drafter(model)
    if method == "mtp":
        if head is None:
            raise PocketError(
                "--speculative mtp: this model has no MTP head (use --speculative lookup or auto)"
            )
        return head
    return BackOff(head if head is not None else LookupDrafter())
