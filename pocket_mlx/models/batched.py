"""One decode step of several sequences at once (continuous batching, `pocket-mlx serve`).

Why: decoding is bound by reading the weights. Run as rows of one [B, 1, H] forward, every
matmul (embedding, projections, router, experts, shared expert, lm_head) reads its weights once
per step for all B sequences instead of once per sequence.

What is batched and what is not:
- every weight matmul and every row-wise op (norms, activations, the MoE block) runs on the B
  rows together: these ops are row-independent, so each row comes out bit-identical to the same
  sequence decoded alone (the CPU kernels of the extension give the same sums for M = B rows
  as for M = 1, in FAST and EXACT modes; tests/test_batched.py checks it);
- Gated DeltaNet layers carry a fixed-size state per sequence (conv window, delta-rule state):
  while sequences decode together those states live stacked [B, ...] here, so the layer's own
  decode path runs on all of them in one node;
- full-attention layers attend each sequence against its own KVCache (different lengths): the
  projections are batched, RoPE, the cache update and the attention run per sequence (on the
  CPU all rows in one node of the extension, each row with its own length). A padded batched
  attention would change the summation over keys and so the bits.

Sequences join and leave between steps (`set_members`); a sequence's linear-attention state is
written back into its own cache (`release`) when it leaves, so its cache can be stored (prompt
cache) or continued alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from pocket_mlx import kernels
from pocket_mlx.kernels import ops
from pocket_mlx.models.cache import LinearAttentionCache, attend_as
from pocket_mlx.models.qwen3_5_moe import Attention


class DecodeBatch:
    """The sequences decoding together and their stacked linear-attention states.

    A member is any object with a `cache` attribute: its model cache (`model.make_cache()`),
    already holding its prompt (its linear layers' states must be set: the first token of a
    sequence runs alone, see engine/batch.py). While it is a member, the batch owns the
    linear layers' states (the member's own entries are emptied, so no stale copy is kept);
    its KV caches stay its own and are updated in place by each step."""

    def __init__(self, model) -> None:
        self.model = model
        self.layers = model.layers
        self.linear = [i for i, layer in enumerate(self.layers) if layer.is_linear]
        self.members: list[Any] = []
        # Per linear layer index: stacked conv_state [B, K-1, C] and state [B, Hv, Dv, Dk].
        self.conv: dict[int, mx.array | None] = {i: None for i in self.linear}
        self.state: dict[int, mx.array | None] = {i: None for i in self.linear}
        self._released: set[int] = set()  # id() of members already written back

    def __len__(self) -> int:
        return len(self.members)

    def set_members(self, members: Sequence[Any]) -> list[Any]:
        """Make `members` the batch: those already in it keep their rows (in their order),
        new ones are appended, the others leave (written back unless `release`d). Returns the
        members in row order (the order of the tokens `step` takes)."""
        wanted = {id(m) for m in members}
        keep = [i for i, m in enumerate(self.members) if id(m) in wanted]
        for i, m in enumerate(self.members):
            if id(m) not in wanted and id(m) not in self._released:
                self._write_back(m, i)
        if len(keep) == len(self.members) and len(members) == len(self.members):
            self._released.clear()
            return self.members
        have = {id(self.members[i]) for i in keep}
        joining = [m for m in members if id(m) not in have]
        order = [self.members[i] for i in keep] + joining
        rows = mx.array(keep, mx.int32) if keep and len(keep) < len(self.members) else None
        for li in self.linear:
            conv, state = [], []
            if keep:
                c, s = self.conv[li], self.state[li]
                # A gather copies the kept rows out: the old stacked arrays are then freed.
                conv.append(c if rows is None else c[rows])
                state.append(s if rows is None else s[rows])
            for m in joining:
                lc = m.cache[li]
                if lc.conv_state is None or lc.state is None:
                    raise ValueError("a sequence joins the batch before its first token ran")
                conv.append(lc.conv_state)
                state.append(lc.state)
                lc.conv_state = lc.state = None  # the batch holds them now
            self.conv[li] = (conv[0] if len(conv) == 1 else mx.concatenate(conv)) if conv else None
            self.state[li] = (state[0] if len(state) == 1 else mx.concatenate(state)) if state \
                else None
        self.members = order
        self._released.clear()
        return self.members

    def release(self, member: Any) -> None:
        """Write `member`'s linear states back into its own cache now (its last step
        included); it leaves at the next `set_members`, which then does not copy it again."""
        i = next(i for i, m in enumerate(self.members) if m is member)
        if id(member) not in self._released:
            self._write_back(member, i)
            self._released.add(id(member))

    def _write_back(self, member: Any, row: int) -> None:
        idx = mx.array([row], mx.int32)  # a gather: a copy, not a view pinning the batch
        for li in self.linear:
            lc = member.cache[li]
            lc.conv_state = self.conv[li][idx]
            lc.state = self.state[li][idx]

    def step(self, tokens: mx.array) -> mx.array:
        """Logits [B, vocab] of the next token of every member, `tokens` [B] being each one's
        last token (in `members` order). Updates the caches (lazily)."""
        if tokens.shape != (len(self.members),):
            raise ValueError(f"{tokens.shape} tokens for {len(self.members)} sequences")
        with kernels.pinned():  # enabled() read once for the step's graph, not per op
            return self._step(tokens)

    def _step(self, tokens: mx.array) -> mx.array:
        lm = self.model.language_model
        tm = lm.model
        h = tm.embed_tokens(tokens[:, None])
        for li, layer in enumerate(self.layers):
            # As DecoderLayer.__call__, with the mixer's per-sequence state handled here.
            x = layer.input_layernorm(h)
            if layer.is_linear:
                c = LinearAttentionCache()
                c.conv_state, c.state = self.conv[li], self.state[li]
                r = layer.linear_attn(x, c)
                self.conv[li], self.state[li] = c.conv_state, c.state
                for m in self.members:
                    m.cache[li].offset += 1
            else:
                r = attend(layer.self_attn, x, [m.cache[li] for m in self.members])
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = tm.norm(h)
        out = tm.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
        return out[:, 0, :]


def attend(attn: Attention, x: mx.array, caches: Sequence) -> mx.array:
    """`Attention.__call__` for B sequences of one token each, `caches[i]` being row i's
    KVCache: the projections, norms and gate on all rows at once; RoPE at each sequence's own
    position, its cache update and its attention per sequence (same ops, same order as the
    one-sequence call, so the same bits), all rows in one node on the CPU with the extension."""
    q, gate, k, v = attn.heads(x)
    out = attn.decode_rows(q, gate, k, v, list(caches))
    if out is not None:  # the CPU extension: every row in one node
        return attn.o_proj(out)
    outs = []
    for i, cache in enumerate(caches):
        qi = ops.rope(q[i:i + 1], attn.rope_dims, attn.rope_base, cache.offset)
        ki = ops.rope(k[i:i + 1], attn.rope_dims, attn.rope_base, cache.offset)
        ki, vi = attend_as(*cache.update_and_fetch(ki, v[i:i + 1]), qi.dtype)
        outs.append(ops.gated_attention(qi, ki, vi, gate[i:i + 1], attn.scale, None))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return attn.o_proj(out)
