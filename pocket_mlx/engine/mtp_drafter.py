"""The MTP drafter: Qwen3.5's multi-token-prediction head proposing the drafts (issue 27).

The head maps (the trunk's post-norm hidden at position t, token t+1) to a hidden that
predicts token t+2 (models/qwen3_5_moe.py, `MTP`; vLLM feeds it the post-norm hidden too). Its
attention layer has a KV cache of its own, which must hold one entry per position the trunk
has seen, each built from the trunk's hidden there, for its drafts to be the head's best:
- prefill: `prompt_hidden(hidden, tokens)` gets each chunk's trunk hidden states; pairs
  (hidden[i], tokens[i + 1]) go into the head's cache, the chunk's last row waits for the next
  token (the next chunk's first, or the pending token).
- `draft(tokens, k)`: the waiting rows (trunk hidden of the positions before the pending token)
  go in with their next tokens, the last of which is the pending one: its output gives draft 1.
  Deeper drafts chain on the head's own output hidden (vLLM's spec_step_idx), appending entries
  that hold no trunk hidden: they are trimmed after the pass.
- `accepted(drafted, accepted, hidden)`: the trunk's hidden of the rows the verify pass kept,
  which wait for the next draft (so a rejection costs the head nothing to undo).
Drafts are the head's argmax: deterministic (`last_probs` None), so sampling with speculation
keeps its distribution by the one-hot rule of engine/speculative.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from pocket_mlx.errors import PocketError

# Draft depth: Qwen3.5 ships one MTP layer trained for the next token; chaining it deeper
# loses acceptance fast (peers on MLX stop at 2-3), so more drafts than this are not asked.
MAX_MTP_DEPTH = 3


class MTPDrafter:
    """Drafts up to `max_depth` tokens per pass from the model's MTP head."""

    name = "mtp"
    # Rows the head takes in before a draft: all of them after a verify pass (at most k + 1),
    # the last `catch_up` after a long plain stretch, when `auto` backs off (older rows are
    # dropped as they arrive). On the bundled model a draft after 128 waiting rows took 7.7 ms,
    # after 32 2.7 ms, after one 0.9 ms (a plain step: 1.6 ms pipelined): a failed try's main
    # cost. The positions skipped leave a gap in the head's cache, which only lowers its
    # acceptance (drafts are proposals: the output is the trunk's either way).
    catch_up = 32

    def __init__(self, model, max_depth: int = MAX_MTP_DEPTH) -> None:
        if getattr(model, "mtp", None) is None:
            raise PocketError("this model has no MTP head")
        self.model, self.max_depth = model, max_depth
        self.last_probs = None
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.make_mtp_cache()
        # Trunk hidden states ([n, H] pieces, m rows in all) of the m positions before the
        # pending token, not yet in the head's cache (each waits for the token after it).
        self.waiting: list[mx.array] = []
        self.marks: list[int] | None = None  # head-cache offsets before the deeper drafts

    def _head(self, hidden: mx.array, tokens: mx.array, step: int = 0) -> mx.array:
        """The head over pairs (hidden [n, H], tokens [n]) -> its post-norm hidden [1, n, H],
        the head's cache advanced by n (no logits: only the last row's are ever read)."""
        embeds = self.model.language_model.model.embed_tokens(tokens[None])
        return self.model.mtp(hidden[None], embeds, self.cache, step)

    def prompt_hidden(self, hidden: mx.array, tokens: mx.array) -> None:
        """One prefill chunk: `hidden` [n, H] the trunk's post-norm hidden of `tokens` [n]."""
        if self.waiting:  # the previous chunk's last row pairs with tokens[0]
            rows, nxt = mx.concatenate([*self.waiting, hidden[:-1]]), tokens
        else:
            rows, nxt = hidden[:-1], tokens[1:]
        if nxt.size:
            self._head(rows, nxt)
        self.waiting = [hidden[-1:]]
        mx.eval(self.waiting, [a for c in self.cache for a in c.arrays])

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        k = min(k, self.max_depth)
        m = sum(h.shape[0] for h in self.waiting)
        if k <= 0 or m == 0 or len(tokens) < m:
            return []
        self._trim()
        lm = self.model.language_model
        hidden = self.waiting[0] if len(self.waiting) == 1 else mx.concatenate(self.waiting)
        if m > self.catch_up:  # the recent rows only (see catch_up)
            hidden, m = hidden[-self.catch_up :], self.catch_up
        g = self._head(hidden, mx.array(list(tokens[-m:]), mx.uint32))[:, -1:]
        self.waiting = []
        self.marks = [c.offset for c in self.cache]
        tok = mx.argmax(lm.logits(g)[:, -1], axis=-1)
        out = [tok]
        for d in range(1, k):
            g = self._head(g[0], tok, step=d)
            tok = mx.argmax(lm.logits(g)[:, -1], axis=-1)
            out.append(tok)
        return mx.concatenate(out).tolist()

    def _trim(self) -> None:
        """Drop the head-cache entries of deeper drafts (built on the head's own hidden)."""
        if self.marks is not None:
            for c, mark in zip(self.cache, self.marks, strict=True):
                c.trim(c.offset - mark)
            self.marks = None

    def accepted(self, drafted: int, accepted: int, hidden: mx.array | None = None) -> None:
        self._trim()
        if hidden is not None:
            # Collected, concatenated once when drafting: plain stretches of `auto` hand over
            # one row per token, and a chain of concatenations would copy O(n^2) rows. Pieces
            # older than the last `catch_up` rows are never fed: dropped now.
            self.waiting.append(hidden)
            rows = sum(h.shape[0] for h in self.waiting)
            while len(self.waiting) > 1 and rows - self.waiting[0].shape[0] >= self.catch_up:
                rows -= self.waiting.pop(0).shape[0]
