"""Reasoning ("thinking") apart from the answer: one parser for every caller, pure text.

Why here and text-only: the chat, `generate`, the batched decoder and every API of the server
must split a reply the same way, and a template decides where a reply starts. Qwen3.5's
template ends the generation prompt with `<think>\\n`, so the reply is reasoning until
`</think>`, then (after the separator "\\n\\n") the answer; with `enable_thinking=false` it
renders an empty block (`<think>\\n\\n</think>\\n\\n`) and the model answers at once. Other
models open `<think>` themselves at the start of their reply. `ReasoningParser` handles both
(`inside`), `thinking_for` tells which one a rendered prompt is, and `ReasoningTracker` adds
what a decoder needs on top: reasoning tokens counted, and a budget that closes the block by
forcing the tokens of `CLOSE_SEQUENCE` instead of sampling. No MLX here: decoders feed it
text and token ids.

Tag tokens must reach the parser as text: a tokenizer that marks `<think>` special and skips
it when decoding would hide the block (Qwen's tokenizers mark them not special).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
# What the engine writes to close a block itself (reasoning budget): the tag and the
# separator Qwen3.5's template puts between reasoning and answer.
CLOSE_SEQUENCE = CLOSE_TAG + "\n\n"

REASONING, TEXT = "reasoning", "text"
Piece = tuple[str, str]  # (REASONING | TEXT, text)

_START, _BLOCK, _AFTER, _ANSWER = "start", "block", "after", "answer"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Splits a streamed reply into ("reasoning", s) and ("text", s) pieces.

    `inside`: the prompt left the model inside the block (Qwen3.5), so the reply is reasoning
    until `close_tag`; else the reply is answer text unless it opens with `open_tag` (leading
    whitespace allowed). Only what could still be a tag (or whitespace that would be stripped)
    is held back. Tags never reach either stream; reasoning is stripped of the whitespace
    around it, the answer of the separator (leading whitespace) after `close_tag`. A block
    never closed is all reasoning; after the block, a stray `close_tag` (or `open_tag`) is text.
    """

    def __init__(self, inside: bool, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG):
        self.inside, self.open_tag, self.close_tag = inside, open_tag, close_tag
        self.state = _START
        self.opened = inside  # the reply is (or was) in a block
        self.closed = False  # the block's close tag was seen
        self.pending = ""  # held back: undecided, a possible partial tag, trailing whitespace
        self.reasoning = ""  # all reasoning emitted so far
        self.text = ""  # all answer text emitted so far
        self._fresh = True  # no reasoning emitted yet (its leading whitespace is dropped)

    @property
    def in_block(self) -> bool:
        """Whether what comes next is reasoning (the block is open, or `inside` and undecided)."""
        return self.state == _BLOCK or (self.state == _START and self.inside)

    def feed(self, text: str) -> list[Piece]:
        """The pieces that `text` (the next part of the reply) completes, in order."""
        self.pending += text
        out: list[Piece] = []
        while self.pending and self._step(out):
            pass
        return self._merge(out)

    def close(self, drop_partial: bool = False) -> list[Piece]:
        """The end of the reply: what was held back (a partial tag becomes text of its
        stream, or is dropped with `drop_partial`)."""
        out: list[Piece] = []
        held, self.pending = self.pending, ""
        if self.state == _START:
            if self.inside:
                out.append((REASONING, "" if drop_partial else held.strip()))
            else:
                out.append((TEXT, held))
        elif self.state == _BLOCK and not drop_partial:
            out.append((REASONING, held.rstrip() if not self._fresh else held.strip()))
        return self._merge(out)

    # ---- the states ----------------------------------------------------------------------
    def _step(self, out: list[Piece]) -> bool:
        """Consume what the current state can decide; False when the rest must wait."""
        if self.state == _START:
            return self._start()
        if self.state == _BLOCK:
            return self._block(out)
        if self.state == _AFTER:
            self.pending = self.pending.lstrip()
            if self.pending:
                self.state = _ANSWER
            return bool(self.pending)
        out.append((TEXT, self.pending))
        self.pending = ""
        return False

    def _start(self) -> bool:
        head = self.pending.lstrip()
        if head.startswith(self.open_tag):
            self.pending = head[len(self.open_tag):]
            self.state, self.opened = _BLOCK, True
            return True
        if self.open_tag.startswith(head):
            return False  # whitespace, or a partial open tag: wait
        self.state = _BLOCK if self.inside else _ANSWER
        return True

    def _block(self, out: list[Piece]) -> bool:
        if self._fresh:
            self.pending = self.pending.lstrip()
        at = self.pending.find(self.close_tag)
        if at >= 0:
            out.append((REASONING, self.pending[:at].rstrip()))
            self.pending = self.pending[at + len(self.close_tag):]
            self.state, self.closed = _AFTER, True
            return True
        keep = _partial_suffix(self.pending, self.close_tag)
        body = self.pending[:len(self.pending) - keep]
        shown = body.rstrip()
        self.pending = body[len(shown):] + self.pending[len(body):]
        out.append((REASONING, shown))
        return False

    def _merge(self, pieces: list[Piece]) -> list[Piece]:
        """Adjacent pieces of one kind joined, empty ones dropped; the totals kept."""
        out: list[Piece] = []
        for kind, s in pieces:
            if not s:
                continue
            if kind == REASONING:
                self.reasoning += s
                self._fresh = False
            else:
                self.text += s
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + s)
            else:
                out.append((kind, s))
        return out


def split_pieces(pieces: list[Piece]) -> tuple[str, str]:
    """(reasoning, text) of a list of pieces."""
    return ("".join(s for k, s in pieces if k == REASONING),
            "".join(s for k, s in pieces if k == TEXT))


def split_reasoning(reply: str, inside: bool) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply, as streaming it through the parser gives."""
    p = ReasoningParser(inside)
    return split_pieces(p.feed(reply) + p.close())


# ---- what the template says --------------------------------------------------------------
def supports_thinking(template: str | None) -> bool:
    """Whether a chat template knows of reasoning blocks (an `enable_thinking` switch or the
    tag itself): only then is a reply parsed; other models' text stays as it is."""
    return bool(template) and ("enable_thinking" in template or OPEN_TAG in template)


def prompt_leaves_inside(prompt: str, open_tag: str = OPEN_TAG) -> bool:
    """Whether a rendered prompt ends inside a block: its last `open_tag` is followed by
    whitespace only (Qwen3.5's `<think>\\n`; an empty `<think>\\n\\n</think>\\n\\n` is not)."""
    at = prompt.rfind(open_tag)
    return at >= 0 and not prompt[at + len(open_tag):].strip()


def thinking_for(template: str | None, prompt: str) -> bool | None:
    """The `thinking` argument of the decoders for a prompt rendered by `template`: None (the
    template knows no reasoning: no parsing), True (the prompt left the model inside the
    block), False (it did not; the model may still open one itself)."""
    if not supports_thinking(template):
        return None
    return prompt_leaves_inside(prompt)


def thinking_kwargs(template: str | None, enabled: bool | None) -> dict:
    """The chat-template keywords that switch thinking on or off (`enable_thinking`, the
    convention of Qwen's templates, vLLM and llama.cpp); {} for the template's default (None)
    or a template without the switch."""
    if enabled is None or not template or "enable_thinking" not in template:
        return {}
    return {"enable_thinking": bool(enabled)}


def parse_reasoning_mode(value: str) -> bool | None:
    """`on` / `off` / `auto` (the template's default) as True / False / None."""
    modes = {"on": True, "off": False, "auto": None}
    if value not in modes:
        raise ValueError(f"must be on, off or auto, got {value!r}")
    return modes[value]


def check_reasoning_budget(value: int | None) -> int | None:
    """A budget of reasoning tokens: None (no limit) or an integer >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be an integer >= 0 (reasoning tokens), got {value!r}")
    return value


class ReasoningTracker:
    """One sequence's reasoning as a decoder sees it: the parser fed each token's text, the
    reasoning tokens counted, and the budget. Protocol: after the prompt's prefill and after
    each token read, call `next_forced()`; an id means "feed this token next instead of the
    one sampled" (the budget ran out: the block is being closed with `close_ids`, the tokens
    of CLOSE_SEQUENCE). Then `add(piece)` for each token read, `finish(tail)` at the end.

    Counted: tokens the model sampled while the block was open, its own close tag included;
    forced tokens are not, so a budget of N means at most N reasoning tokens."""

    def __init__(self, inside: bool, budget: int | None = None, close_ids: Sequence[int] = ()):
        self.parser = ReasoningParser(inside)
        self.budget = check_reasoning_budget(budget)
        self.close_ids = list(close_ids)
        self.tokens = 0  # reasoning tokens sampled
        self.forced = 0  # tokens forced so far
        self._queue: deque[int] = deque()
        self._owed = False  # the next token read is one `next_forced` handed out
        self._started = False  # the budget's close was queued (once per reply)
        self._due()

    def _due(self) -> None:
        """Queue the close once the budget is spent and the block is still open."""
        if (self.budget is not None and not self._started and self.parser.in_block
                and self.tokens >= self.budget and self.close_ids):
            self._started = True
            self._queue.extend(self.close_ids)

    def next_forced(self) -> int | None:
        """The token to feed next instead of sampling, or None."""
        if not self._queue:
            return None
        self._owed = True
        return self._queue.popleft()

    @property
    def in_block(self) -> bool:
        """Whether the next text is reasoning (see `ReasoningParser.in_block`)."""
        return self.parser.in_block

    @property
    def owed(self) -> bool:
        """The next token read is one `next_forced` handed out."""
        return self._owed

    def add(self, piece: str) -> tuple[str, str]:
        """One token read, with its text (may be empty): (reasoning, answer) to show."""
        forced, self._owed = self._owed, False
        before = self.parser.in_block
        pieces = self.parser.feed(piece)
        if forced:
            self.forced += 1
        elif before or self.parser.in_block:
            self.tokens += 1
        self._due()
        return split_pieces(pieces)

    def finish(self, tail: str = "") -> tuple[str, str]:
        """The end of the reply: `tail` (text held back by the decoder) and what the parser
        held. A close cut short (max tokens) leaves no partial tag in the reasoning."""
        cut = self._started and self.parser.in_block
        return split_pieces(self.parser.feed(tail) + self.parser.close(drop_partial=cut))

    @property
    def reasoning(self) -> str:
        return self.parser.reasoning

    @property
    def text(self) -> str:
        return self.parser.text


def close_sequence_ids(tokenizer) -> list[int]:
    """The token ids a budget forces to close a block: CLOSE_SEQUENCE as `tokenizer` (the
    engine's `Tokenizer`) encodes it on its own."""
    return tokenizer.encode(CLOSE_SEQUENCE, add_special_tokens=False)


def tracker_for(tokenizer, thinking: bool | None, budget: int | None = None
                ) -> ReasoningTracker | None:
    """A sequence's tracker: None when `thinking` is None (no parsing: the reply as it comes;
    a budget needs the block parsed, so it is ignored then). ValueError for a bad budget."""
    check_reasoning_budget(budget)
    if thinking is None:
        return None
    ids = close_sequence_ids(tokenizer) if budget is not None else ()
    return ReasoningTracker(bool(thinking), budget, ids)
