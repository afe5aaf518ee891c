"""A reply's text as the one event stream every wire format renders: reasoning, answer text
and whole tool calls apart (server/jobs.py's `Reasoning`, `Text`, `Call`).

Why one place: OpenAI's chunks, Anthropic's content blocks and the other formats differ only
in how they write these events; which text is reasoning, which is a call and which is the
answer is decided here once, the same for a stream and a whole reply. Pure text: no MLX.
"""

from __future__ import annotations

from typing import Protocol

from pocket_mlx.server.jobs import Call, Done, Reasoning, Text, Whole
from pocket_mlx.server.requests import GenRequest
from pocket_mlx.server.tools import CallSplitter, splitter_for

Part = Reasoning | Text | Call


class ReasoningSplit(Protocol):
    """A reasoning parser (engine/reasoning.py): text in, ("reasoning" | "text", s) out."""

    def feed(self, text: str) -> list[tuple[str, str]]: ...

    def close(self) -> list[tuple[str, str]]: ...


class ReplyParts:
    """Splits a reply, piece by piece, into `Reasoning`, `Text` and `Call` events: the
    reasoning parser (when the prompt left a thinking model inside its block) first, then
    the tool-call splitter (when the request's tools are on) over the answer's text."""

    def __init__(self, split: CallSplitter | None, reasoning: ReasoningSplit | None = None):
        self.split, self.reasoning = split, reasoning

    @classmethod
    def for_request(cls, req: GenRequest, id_prefix: str,
                    reasoning: ReasoningSplit | None = None) -> ReplyParts:
        """The splitters a rendered request needs; `id_prefix`: how call ids start."""
        return cls(splitter_for(req, id_prefix), reasoning)

    @property
    def calls(self):
        return self.split.calls if self.split is not None else []

    def feed(self, text: str) -> list[Part]:
        return self._parts(self.reasoning.feed(text) if self.reasoning else [("text", text)],
                           closing=False)

    def close(self) -> list[Part]:
        pieces = self.reasoning.close() if self.reasoning else []
        return self._parts(pieces, closing=True)

    def _parts(self, pieces: list[tuple[str, str]], closing: bool) -> list[Part]:
        out: list[Part] = []
        for kind, s in pieces:
            if kind == "reasoning":
                if s:
                    out.append(Reasoning(s))
            else:
                out += self._answer(self.split.feed(s) if self.split is not None else [s])
        if closing and self.split is not None:
            out += self._answer(self.split.close())
        return out

    def _answer(self, got: list) -> list[Part]:
        out: list[Part] = []
        for p in got:
            if isinstance(p, str):
                if p:
                    out.append(Text(p))
            else:
                index = next(i for i, c in enumerate(self.split.calls) if c is p)
                out.append(Call(p, index))
        return out

    def whole(self, text: str, done: Done) -> Whole:
        """A whole reply's text (fed at once) as its parts."""
        parts = self.feed(text) + self.close()
        return Whole(text="".join(p.text for p in parts if isinstance(p, Text)),
                     calls=list(self.calls), done=done,
                     reasoning="".join(p.text for p in parts if isinstance(p, Reasoning)),
                     parts=parts)
