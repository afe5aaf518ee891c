"""The extension's causal attention (prefill; core/attention.cpp) against MLX's
scaled_dot_product_attention with mask="causal": grouped heads, a cache before the chunk
(strided key/value views of a larger buffer, as KVCache returns them), odd lengths that cut the
query and key blocks, with and without the fused sigmoid output gate (a strided view, as the
model's split hands it over), every ISA this CPU runs, and the model's entry point
(ops.gated_attention) with its fallbacks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pocket_mlx import kernels
from pocket_mlx.kernels import ops

RNG = np.random.default_rng()


# Every test: the extension on the CPU (skips without it, fails under POCKET_MLX_REQUIRE_KERNELS=1).
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _a(*shape):
    return mx.array(RNG.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
def test_causal_attention_matches_mlx(isa):
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available")
    for B, Hq, Hkv, L, past, D in ((1, 4, 2, 37, 0, 64), (2, 2, 1, 5, 70, 16), (1, 16, 2, 130, 3, 256),
                                   (1, 1, 1, 1, 9, 32)):
        S = past + L
        q = _a(B, Hq, L, D)
        # Keys/values as a view of a bigger cache buffer (strided along the sequence axis).
        kb, vb = _a(B, Hkv, S + 11, D), _a(B, Hkv, S + 11, D)
        k, v = kb[:, :, :S, :], vb[:, :, :S, :]
        scale = D**-0.5
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        out = kernels._ext.causal_attention(q, k, v, scale=scale).transpose(0, 2, 1, 3)
        err = float(mx.abs(out - ref).max())
        assert err < 2e-5, f"{isa} B={B} Hq={Hq} Hkv={Hkv} L={L} past={past} D={D}: {err:.3g}"
        gate = mx.split(_a(B, L, Hq, 2 * D), 2, axis=-1)[1]  # strided, like the model's
        ref_g = ref.transpose(0, 2, 1, 3) * mx.sigmoid(gate)
        out_g = kernels._ext.causal_attention(q, k, v, gate, scale=scale)
        err = float(mx.abs(out_g - ref_g).max())
        assert err < 2e-5, f"{isa} gated B={B} Hq={Hq} L={L} D={D}: {err:.3g}"


def _ref_gated(q, k, v, gate, scale, mask):
    B, _, L, _ = q.shape
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate.reshape(B, L, -1))


def test_ops_entry_point_and_fallbacks():
    q, k, v, gate = _a(1, 4, 9, 32), _a(1, 2, 9, 32), _a(1, 2, 9, 32), _a(1, 9, 4, 32)
    ref = _ref_gated(q, k, v, gate, 0.3, "causal")
    out = ops.gated_attention(q, k, v, gate, 0.3, "causal")
    assert out.shape == (1, 9, 128) and float(mx.abs(out - ref).max()) < 2e-5
    # One query (a decode step): the same kernel, so an L-row verify pass matches it row for
    # row (tests/test_decode_ops.py); MLX's ops with the extension off.
    q1, g1 = q[:, :, -1:, :], gate[:, -1:]
    one = ops.gated_attention(q1, k, v, g1, 0.3, None)
    assert mx.array_equal(one, out[:, -1:]) and float(mx.abs(one - ref[:, -1:]).max()) < 2e-5
    kernels.set_enabled(False)
    try:
        assert mx.array_equal(ops.gated_attention(q1, k, v, g1, 0.3, None),
                              _ref_gated(q1, k, v, g1, 0.3, None))
    finally:
        kernels.set_enabled(True)
    # bfloat16: MLX's own ops.
    qb, kb, vb, gb = (a.astype(mx.bfloat16) for a in (q, k, v, gate))
    assert mx.array_equal(ops.gated_attention(qb, kb, vb, gb, 0.3, "causal"),
                          _ref_gated(qb, kb, vb, gb, 0.3, "causal"))
    with pytest.raises(ValueError):
        kernels._ext.causal_attention(q, k[..., :16], v[..., :16], scale=0.3)
    with pytest.raises(ValueError):
        kernels._ext.causal_attention(q, k, v, gate[:, :3], scale=0.3)


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
def test_prefill_rows_have_their_one_row_bits_at_depth(isa, mode):
    """A prompt's rows over several key blocks (a cache of 150 before 70 queries, 16 query heads
    over 2 KV heads as the 35B shape): each row's bits are those of its one-row (decode) call over
    its own keys, in both modes (FAST's vectorised softmax included), and near MLX's."""
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available")
    old = kernels.get_mode()
    kernels.set_mode(mode)
    try:
        past, L, D = 150, 70, 64
        q, k, v = _a(1, 16, L, D), _a(1, 2, past + L, D), _a(1, 2, past + L, D)
        gate = _a(1, L, 16, D)
        out = kernels._ext.causal_attention(q, k, v, gate, scale=0.125)
        ref = _ref_gated(q, k, v, gate, 0.125, "causal").reshape(out.shape)
        assert float(mx.abs(out - ref).max()) < 2e-5
        for i in (0, 13, 42, L - 1):  # rows ending in different key blocks
            S = past + i + 1
            one = kernels._ext.causal_attention(q[:, :, i:i + 1], k[:, :, :S], v[:, :, :S],
                                                gate[:, i:i + 1], scale=0.125)
            assert mx.array_equal(one, out[:, i:i + 1]), f"row {i}"
    finally:
        kernels.set_mode(old)
