"""A reply's text as the one event stream every wire format renders: reasoning, answer text
and whole tool calls apart (server/jobs.py's `Reasoning`, `Text`, `Call`).

Why one place: OpenAI's chunks, Anthropic's content blocks and the other formats differ only
in how they write these events; which text is reasoning, which is a call and which is the
answer is decided here once, the same for a stream and a whole reply. Pure text: no MLX.
"""

from __future__ import annotations

from pocket_mlx.server.jobs import Call, Done, Reasoning, Text, Whole
from pocket_mlx.server.requests import GenRequest
from pocket_mlx.server.tools import CallSplitter, splitter_for

Part = Reasoning | Text | Call


class ReplyParts:
    """Splits a reply, piece by piece, into `Reasoning`, `Text` and `Call` events: reasoning
    comes apart from the engine already (engine/reasoning.py parses the block as it decodes,
    for its budget and counts); the tool-call splitter (when the request's tools are on) runs
    over the answer's text, so a call is never read out of reasoning."""

    def __init__(self, split: CallSplitter | None):
        self.split = split

    @classmethod
    def for_request(cls, req: GenRequest, id_prefix: str) -> ReplyParts:
        """The splitter a rendered request needs; `id_prefix`: how call ids start."""
        return cls(splitter_for(req, id_prefix))

    @property
    def calls(self):
        return self.split.calls if self.split is not None else []

    def feed(self, text: str, reasoning: str = "") -> list[Part]:
        out: list[Part] = [Reasoning(reasoning)] if reasoning else []
        return out + self._answer(self.split.feed(text) if self.split is not None else [text])

    def close(self) -> list[Part]:
        return self._answer(self.split.close()) if self.split is not None else []

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

    def whole(self, text: str, done: Done, reasoning: str = "") -> Whole:
        """A whole reply's text and reasoning (fed at once) as its parts."""
        parts = self.feed(text, reasoning) + self.close()
        return Whole(text="".join(p.text for p in parts if isinstance(p, Text)),
                     calls=list(self.calls), done=done,
                     reasoning="".join(p.text for p in parts if isinstance(p, Reasoning)),
                     parts=parts)
