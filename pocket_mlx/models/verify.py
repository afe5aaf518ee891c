"""The verify pass of speculative decoding: one trunk forward over [pending token, d1..dk]
whose every row has the bits one-token decode would give it, and a commit that keeps only the
rows accepted, without a second forward.

Why row-exact, and how (the same split as models/batched.py, measured by
tests/test_speculative.py): greedy speculation must reproduce plain decode token for token, so
each row of the verify pass must be computed with one-token decode's reduction order.
- Every weight matmul (embedding, projections, the MoE block with its router, the lm_head) and
  every row-wise op (norms, activations) runs on the L = k + 1 rows together: on the CPU the
  extension's row kernels give each row of an M-row product the bits of that row alone (up to
  `gemm_min_rows` rows; `kernels.keep_rows_independent` keeps L under it), and the MoE block
  routes each token by itself. That is where the speed comes from: the weights are read once
  for L tokens.
- Gated DeltaNet layers run their core (conv, gates, delta rule, gated norm) for the L rows in
  one node of the extension (`linear_attn_rows`: each row is the one-token decode node's
  arithmetic, fed the state after the row before), from one batched projection; the (conv
  window, state) after each row is kept (a tape of L entries, each its own array), so committing
  n rows is taking entry n - 1 (no copy; the other entries are freed, none pinned by a view). Without the extension, row after row through the decode
  forward.
- Full-attention layers: on the CPU with the extension, decode attends through the extension's
  causal kernel (one row, all keys), whose row i sums over keys 0..offset + i in an order that
  depends on nothing else; so the pass applies RoPE to the L rows (the extension's RoPE, row l
  at offset + l), appends them to the KV cache and attends all rows in one causal call of that
  kernel. Elsewhere (MLX's sdpa, which sums in another order for L rows) RoPE, the append and
  the attention go row by row as the decode step does. Committing n rows trims the KV cache by
  L - n.

MLX's own CPU kernels (extension off) are row-exact as well. On the GPU nothing here has
measured it (Metal's one-row and many-row quantized kernels differ): `batched_rows_exact()` is
False there and the pass runs the rows one by one through the ordinary decode forward (exact,
still one graph and no re-run on rejection, but no saving of weight reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from pocket_mlx import kernels
from pocket_mlx.kernels import ops
from pocket_mlx.models.cache import attend_as
from pocket_mlx.models.fusion import project


def batched_rows_exact() -> bool:
    """Whether an L-row forward of the products gives every row one-token decode's bits here:
    on the CPU, with the extension's row kernels and with MLX's own CPU kernels alike
    (tests/test_speculative.py and tests/test_batched.py check both); not assumed elsewhere."""
    return mx.default_device() == mx.cpu


@dataclass
class Tape:
    """What a verify pass leaves to commit: per linear layer, the (conv_state, state) after
    each row (L separate arrays each, so the cache keeps one and the rest are freed); the
    number of rows fed; each layer's cache offset before the pass."""

    rows: int
    linear: dict[int, list[tuple[mx.array, mx.array]]] = field(default_factory=dict)
    offsets: list[int] = field(default_factory=list)


def verify_forward(model, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array, Tape]:
    """Logits [L, vocab] and the final-norm hidden states [L, hidden] of `tokens` [L] fed after
    what `cache` holds, each row bit-identical to one-token decode of that row. The cache then
    holds all L rows (KV appended, linear states at the last row); `commit(cache, tape, n)`
    keeps the first n. Lazy: nothing is evaluated here."""
    L = tokens.shape[0]
    tape = Tape(rows=L, offsets=[c.offset for c in cache])
    if not batched_rows_exact():
        return _rowwise(model, tokens, cache, tape)
    kernels.keep_rows_independent(L)
    with kernels.pinned():
        return _rows(model, tokens, cache, tape)


def _rows(model, tokens: mx.array, cache: list, tape: Tape):
    """verify_forward's graph where the L-row products are row-exact (the CPU)."""
    layers = model.layers
    lm = model.language_model
    tm = lm.model
    h = tm.embed_tokens(tokens[None])
    for li, (layer, c) in enumerate(zip(layers, cache)):
        x = layer.input_layernorm(h)
        if layer.is_linear:
            r = _linear_rows(layer.linear_attn, x, c, tape, li)
        else:
            r = _attention_rows(layer.self_attn, x, c)
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = tm.norm(h)
    out = tm.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
    return out[0], h[0], tape


def _rowwise(model, tokens: mx.array, cache: list, tape: Tape):
    """The rows one at a time through the model's own decode forward (no row-exact batched
    kernels here), keeping each linear layer's state after every row."""
    logits, hidden = [], []
    lm = model.language_model
    for i in range(tokens.shape[0]):
        h = lm.model(tokens[i : i + 1][None], cache)
        hidden.append(h[0, 0])
        logits.append(
            (lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h))[
                0, 0
            ]
        )
        for li, c in enumerate(cache):
            if model.layers[li].is_linear:
                tape.linear.setdefault(li, []).append((c.conv_state, c.state))
    return mx.stack(logits), mx.stack(hidden), tape


def _linear_rows(gdn, x: mx.array, cache, tape: Tape, li: int) -> mx.array:
    """GatedDeltaNet.__call__ for L rows: one projection, then the decode core of each row in
    turn, in one node of the extension (the caches after each row come back as two tapes),
    else row by row."""
    B, L, _ = x.shape
    qkv, z, b, a = project(gdn, x, *gdn.FUSED)
    if cache.conv_state is not None:
        fast = ops.linear_attn_rows(
            qkv, z, b, a, cache.conv_state, gdn.conv1d.weight, gdn.A_log, gdn.dt_bias,
            gdn.norm.weight, cache.state, Hk=gdn.num_k_heads, Dk=gdn.head_k_dim,
            Hv=gdn.num_v_heads, Dv=gdn.head_v_dim, eps=gdn.norm.eps)
        if fast is not None:
            out, slots = fast[0], fast[1:]
            tape.linear[li] = list(zip(slots[:L], slots[L:], strict=True))
            cache.conv_state, cache.state = slots[L - 1], slots[2 * L - 1]
            cache.offset += L
            return gdn.out_proj(out.swapaxes(0, 1))
    steps = tape.linear.setdefault(li, [])
    outs = []
    for i in range(L):
        row = slice(i, i + 1)
        out = gdn._decode_step(qkv[:, row], z[:, row], b[:, row], a[:, row], cache)
        if out is None:  # no decode node here (not float32): the layer's decode forward per row
            break
        outs.append(out)
        steps.append((cache.conv_state, cache.state))
    else:
        return gdn.out_proj(mx.concatenate(outs, axis=1))
    rows = []
    for i in range(L):
        rows.append(gdn(x[:, i : i + 1], cache))
        steps.append((cache.conv_state, cache.state))
    return mx.concatenate(rows, axis=1)


def _attention_rows(attn, x: mx.array, cache) -> mx.array:
    """Attention.__call__ for L rows of one sequence at one-token decode's bits: projections on
    all rows; where decode attends through the extension's causal kernel (whose row i depends
    only on its own keys, 0..offset + i), RoPE (row l at offset + l), the cache update and the
    attention for all rows in one go; else RoPE, cache update and attention row by row at each
    row's own position, as decode."""
    B, L, _ = x.shape
    q, gate, k, v = attn.heads(x)
    if ops.decode_attention_node(q):
        qr = ops.rope_rows(q, attn.rope_dims, attn.rope_base, cache.offset)
        kr = ops.rope_rows(k, attn.rope_dims, attn.rope_base, cache.offset)
        if qr is not None and kr is not None:
            kc, vc = attend_as(*cache.update_and_fetch(kr, v), qr.dtype)
            return attn.o_proj(ops.gated_attention(qr, kc, vc, gate, attn.scale, "causal"))
    outs = []
    for i in range(L):
        row = slice(i, i + 1)
        qi = ops.rope(q[:, :, row], attn.rope_dims, attn.rope_base, cache.offset)
        ki = ops.rope(k[:, :, row], attn.rope_dims, attn.rope_base, cache.offset)
        ki, vi = attend_as(*cache.update_and_fetch(ki, v[:, :, row]), qi.dtype)
        outs.append(ops.gated_attention(qi, ki, vi, gate[:, row], attn.scale, None))
    return attn.o_proj(mx.concatenate(outs, axis=1))


def commit(cache: list, tape: Tape, n: int) -> None:
    """Keep the first `n` rows (1 <= n <= rows) of the last verify pass in `cache`: the KV
    caches trimmed, each linear layer's state and conv window taken from the tape at row n."""
    if not 1 <= n <= tape.rows:
        raise ValueError(f"commit of {n} rows of a {tape.rows}-row verify pass")
    for li, c in enumerate(cache):
        if li in tape.linear:
            c.conv_state, c.state = tape.linear[li][n - 1]
            c.offset = tape.offsets[li] + n
        else:
            c.trim(c.offset - (tape.offsets[li] + n))
