"""Drafters for speculative decoding: who proposes the tokens the verify pass checks.

A drafter is anything with the `Drafter` protocol: `draft(tokens, k)` proposes up to k tokens
to follow `tokens` (the prompt and the reply so far, the pending token last), `accepted(...)`
hears how many of them the trunk kept (and the trunk's final-norm hidden states of the rows it
kept, which an MTP head drafts from), `reset()` forgets a sequence. A drafter that samples its
drafts from a distribution q sets `last_probs` to q ([k, vocab]) after `draft`; None means
deterministic drafts (q one-hot), as lookup's are. A drafter with a
`prompt_hidden(hidden, tokens)` method gets the prompt's final-norm hidden states during prefill
([n, hidden] per chunk with the chunk's token ids [n], all prompt tokens but the last, whose
hidden state comes with the first pass's `accepted`): an MTP head fills its own KV cache from
them.

- `MTPDrafter` (engine/mtp_drafter.py): the model's MTP head, depth up to 3; a model may
  also supply its own as `model.mtp_drafter()`.
- `LookupDrafter` (prompt lookup): the longest n-gram (n from `max_ngram` down to
  `min_ngram`) ending the sequence that occurred before; drafts what followed it there.
- `BackOff` wraps a drafter for `auto`: while drafts keep failing, or drafting passes decode
  fewer tokens per second than plain decode, it stops asking (plain pipelined decode runs
  instead) for a number of tokens that grows 4x with each failure, up to `max_skip`, tries
  again with one draft, and remembers per model what it learnt for the next generation.
- `LookupFirst` is `auto` on a model with a head: lookup's draft where the context has a match,
  the head's otherwise, each behind its own `BackOff` (lookup's matches pay where the head's
  guesses do not: on the bundled model lookup decoded 1.25x of plain on ordinary prompts while
  the head alone, backing off, gave 0.95x).
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

    def reset_sequence(self) -> None:
        """Nothing to forget when steps went by unheard (the server's batched steps): lookup
        reads tokens only, and `_extend` catches up with them (rebuilding the index would cost
        O(context) at every such return)."""

    # Where no n-gram matches, the decode loop runs plain pipelined decode (a one-row verify
    # pass waits for each token: on the bundled model ~1.5x a pipelined step, and on its
    # code-edit prompt half the passes found no match) until `has_draft` sees a match.
    def has_draft(self, tokens: Sequence[int]) -> bool:
        return bool(self.draft(tokens, 1))


class BackOff:
    """`auto`'s wrapper: drafts only while drafting pays. It times its passes (`timed`, from
    the decode loop): decode throughput of drafting passes against that of plain decode, as
    exponential averages. After a drafting pass that accepted nothing or whose average
    throughput is below plain decode's, it skips drafting for `skip` tokens (8, 32, 128, ... up
    to `max_skip`), any pass that pays resets it. Skipped stretches, and the few tokens after
    a draft found nothing (`idle`), run as plain pipelined decode (`plain_steps`). It starts
    with `probe` plain tokens, to know plain decode's speed. A verify pass costs more than a
    one-token step (its MoE routes k + 1 tokens to more experts, and on a CPU the products'
    work grows with the rows), so drafts that keep failing are a loss; until a pass has paid
    (the first try, and every try after backing off) it drafts one token (`probe_k`), the
    cheapest verify pass, judged on its own speed.

    `memory` (a dict kept by the caller, one per model and drafter: `make_drafter` keeps it on
    the model) carries the speeds and the back-off level from one generation to the next, so a
    chat's or a server's next reply does not pay again to learn that drafting loses: it tries
    once after at most `first_try` tokens (one-token draft) and backs off from where the last
    reply left off. Measured on the bundled model (its head accepts ~25%; docs/SPECULATIVE.md):
    without these, `auto` decoded at 0.86x of `off`."""

    def __init__(self, inner, max_skip: int = 512, idle: int = 4, probe: int = 4,
                 probe_k: int = 1, first_try: int = 32, memory: dict | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_skip, self.idle, self.probe = max_skip, idle, probe
        self.probe_k, self.first_try = probe_k, first_try
        self.memory = memory
        self.reset()

    @property
    def last_probs(self):
        return self.inner.last_probs

    def reset(self) -> None:
        m = self.memory or {}
        self.skip = m.get("skip", 0)
        self.paying = m.get("paying", False)  # a pass paid since the last back-off
        self.wait = max(self.probe, min(self.skip, self.first_try))
        self.plain_rate: float | None = m.get("plain_rate")  # tokens/s of plain decode
        self.draft_rate: float | None = m.get("draft_rate")  # tokens/s of drafting passes
        self.inner.reset()

    def _remember(self) -> None:
        if self.memory is not None:
            self.memory.update(skip=self.skip, paying=self.paying, plain_rate=self.plain_rate,
                               draft_rate=self.draft_rate)

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        if self.wait > 0:
            return []
        return self.inner.draft(tokens, k if self.paying else min(k, self.probe_k))

    def plain_steps(self) -> int:
        """Plain tokens to decode now (asked when `draft` gave nothing)."""
        n, self.wait = max(self.wait, self.idle), 0
        return n

    def decoded_plainly(self, tokens: int) -> None:
        """`tokens` went by in a plain stretch that another drafter's wait decided (LookupFirst):
        they count off this one's wait as if it had asked for them."""
        self.wait = max(0, self.wait - tokens)

    def reset_sequence(self) -> None:
        """Steps went by unheard (the server's batched steps): the inner drafter starts the
        sequence over where it needs to; what was learnt about speed stays."""
        getattr(self.inner, "reset_sequence", self.inner.reset)()

    def timed(self, rows: int, seconds: float, tokens: int) -> None:
        rate = tokens / max(seconds, 1e-9)
        if rows == 1:
            self.plain_rate = (
                rate if self.plain_rate is None else 0.7 * self.plain_rate + 0.3 * rate
            )
        elif self.draft_rate is None or not self.paying:
            # A try is judged on its own speed, not averaged into the failures that caused a
            # back-off (else a drafter that starts to pay, in a chat's next reply say, would
            # need several good tries to count).
            self.draft_rate = rate
        else:
            self.draft_rate = 0.7 * self.draft_rate + 0.3 * rate
        self._remember()

    def accepted(self, drafted: int, accepted: int, hidden: mx.array | None = None) -> None:
        self.inner.accepted(drafted, accepted, hidden)
        if drafted == 0:
            return
        slower = (
            self.plain_rate is not None
            and self.draft_rate is not None
            and self.draft_rate < self.plain_rate
        )
        if accepted == 0 or slower:
            self.skip = min(self.max_skip, max(8, 4 * self.skip))
            self.wait, self.paying = self.skip, False
        else:
            self.skip, self.paying = 0, True
        self._remember()


class LookupFirst:
    """`auto` on a model with an MTP head: lookup drafts where an n-gram of the context
    matches, the head where none does, each behind its own `BackOff` (its speeds, failures and
    memory its own: a head that loses backs off without silencing lookup, and the other way
    round). Plain stretches last until the drafter that can draft next may try again; while
    lookup is not backing off a match ends them early (`has_draft`), as with lookup alone. The
    head hears every trunk row (its cache needs them all), lookup's passes included."""

    name = "lookup+mtp"
    last_probs = None  # both draft deterministically (q one-hot)

    def __init__(self, lookup: BackOff, head: BackOff) -> None:
        self.lookup, self.head = lookup, head
        self.source: BackOff | None = None  # who drafted the pass in flight

    def reset(self) -> None:
        self.lookup.reset()
        self.head.reset()
        self.source = None

    def reset_sequence(self) -> None:
        self.lookup.reset_sequence()
        self.head.reset_sequence()
        self.source = None

    def prompt_hidden(self, hidden: mx.array, tokens: mx.array) -> None:
        """The prompt's trunk rows fill the head's cache (so its first drafts see the prompt)."""
        hook = getattr(self.head.inner, "prompt_hidden", None)
        if hook is not None:
            hook(hidden, tokens)

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        self.source = None
        for b in (self.lookup, self.head):
            drafts = b.draft(tokens, k)
            if drafts:
                self.source = b
                return drafts
        return []

    def has_draft(self, tokens: Sequence[int]) -> bool:
        return self.lookup.wait == 0 and self.lookup.inner.has_draft(tokens)

    def plain_steps(self) -> int:
        """Plain tokens until one of the two may draft again (the stretch is counted off both
        waits by `timed`, which hears how many tokens it really had)."""
        head = max(self.head.wait, self.head.idle)
        if self.lookup.wait == 0:  # lookup had no match: until one appears (`has_draft`)
            return head
        return max(min(self.lookup.wait, head), self.lookup.idle)

    def timed(self, rows: int, seconds: float, tokens: int) -> None:
        if rows == 1:  # plain decode: both learn its speed, both waits run down
            for b in (self.lookup, self.head):
                b.decoded_plainly(tokens)
                b.timed(rows, seconds, tokens)
        elif self.source is not None:
            self.source.timed(rows, seconds, tokens)

    def accepted(self, drafted: int, accepted: int, hidden: mx.array | None = None) -> None:
        source, self.source = self.source, None
        if drafted and source is self.lookup:
            self.lookup.accepted(drafted, accepted, hidden)
            self.head.inner.accepted(0, 0, hidden)  # the head's cache takes every trunk row
        else:
            self.head.accepted(drafted, accepted, hidden)


def check_num_draft_tokens(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_DRAFT_TOKENS:
        raise PocketError(f"--num-draft-tokens must be 1..{MAX_NUM_DRAFT_TOKENS}, got {k!r}")
    return k


def mtp_drafter(model):
    """The model's MTP head as a drafter (`model.mtp_drafter()` when the model supplies one,
    else `MTPDrafter` over `model.mtp`), or None when it has no head."""
    make = getattr(model, "mtp_drafter", None)
    if callable(make):
        return make()
    if getattr(model, "mtp", None) is None:
        return None
    from pocket_mlx.engine.mtp_drafter import MTPDrafter

    return MTPDrafter(model)


def make_drafter(method: str, model) -> Drafter | None:
    """The drafter of `--speculative METHOD` for `model`, or None (plain decode). `mtp` on a
    model without a head is a PocketError; `auto` is lookup first and the head where lookup
    has no match (`LookupFirst`) when there is a head, else lookup, with back-off either way."""
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
    # What `auto` learnt about this model (BackOff's `memory`), kept on the model for its next
    # generation; object.__setattr__: nn.Module would file a dict attribute among its
    # parameters.
    memory = getattr(model, "_auto_backoff", None)
    if memory is None:
        memory = {}
        object.__setattr__(model, "_auto_backoff", memory)
    # Per drafter and device: speeds measured on the CPU say nothing of the GPU's.
    device = getattr(model, "device", None)

    def backed_off(inner) -> BackOff:
        return BackOff(inner, memory=memory.setdefault(f"{inner.name}@{device}", {}))

    lookup = backed_off(LookupDrafter())
    return lookup if head is None else LookupFirst(lookup, backed_off(head))
