"""The extension's one-node decode ops (RMSNorm, gated RMSNorm, causal conv + silu, RoPE, MoE
router, a whole MoE block, a Gated DeltaNet token) against MLX's composed forms, which
`pocket_mlx.kernels.ops` falls back to without the extension. Fresh random data each run; odd sizes;
float32 (the CPU path)."""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pocket_mlx import kernels
from pocket_mlx.kernels import ops

RNG = np.random.default_rng()


# Every test: the extension on the CPU (skips without it, fails under POCKET_MLX_REQUIRE_KERNELS=1).
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def rand(*shape, scale=1.0):
    return mx.array(RNG.standard_normal(shape).astype(np.float32) * scale)


def close(a, b, rtol=1e-5):
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= rtol * max(np.abs(b).max(), 1e-30)


def nodes(y) -> str:
    f = io.StringIO()
    mx.export_to_dot(f, y)
    return f.getvalue()


def stock(fn, *args, **kw):
    kernels.set_enabled(False)
    try:
        return fn(*args, **kw)
    finally:
        kernels.set_enabled(True)


@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 128), (2, 7), (4, 1, 33)])
def test_rms_norm(shape):
    x, w, g = rand(*shape, scale=3), rand(shape[-1]), rand(*shape)
    eps = float(RNG.uniform(1e-6, 1e-2))
    y = ops.rms_norm(x, w, eps)
    assert "PocketRMSNorm" in nodes(y)
    close(y, mx.fast.rms_norm(x, w, eps))
    close(ops.rms_norm(x, None, eps), mx.fast.rms_norm(x, None, eps))
    close(ops.rms_norm_gated(x, w, g, eps), stock(ops.rms_norm_gated, x, w, g, eps))


@pytest.mark.parametrize("S,C,K", [(1, 8192, 4), (7, 96, 4), (3, 33, 2)])
def test_causal_conv_silu(S, C, K):
    x, w = rand(2, S + K - 1, C), rand(C, K, 1)
    y = ops.causal_conv_silu(x, w)
    assert "PocketConvSilu" in nodes(y)
    close(y, nn.silu(ops.depthwise_conv(x, w)))
    # A strided input (a slice of a wider array) reads the same values.
    wide = rand(2, S + K - 1, C + 5)
    close(ops.causal_conv_silu(wide[..., 2:C + 2], w), nn.silu(ops.depthwise_conv(wide[..., 2:C + 2], w)))


@pytest.mark.parametrize("dims,D,offset", [(64, 256, 0), (64, 256, 17), (32, 32, 5), (6, 10, 300)])
def test_rope_decode(dims, D, offset):
    x = rand(2, 3, 1, D)
    y = ops.rope(x, dims, 1e4, offset)
    assert "PocketRope" in nodes(y)
    close(y, mx.fast.rope(x, dims, traditional=False, base=1e4, scale=1.0, offset=offset), 1e-5)
    # Several positions (prefill) go to MLX's rope: same values.
    xs = rand(1, 2, 5, D)
    close(ops.rope(xs, dims, 1e4, offset),
          mx.fast.rope(xs, dims, traditional=False, base=1e4, scale=1.0, offset=offset))


@pytest.mark.parametrize("E,k,normalize", [(128, 8, True), (256, 8, False), (9, 3, True)])
def test_moe_route(E, k, normalize):
    logits = rand(3, 2, E, scale=2)
    inds, scores = ops.moe_route(logits, k, normalize)
    assert "PocketRoute" in nodes(scores)
    ref_i, ref_s = stock(ops.moe_route, logits, k, normalize)
    assert inds.dtype == ref_i.dtype == mx.uint32
    assert np.array_equal(np.sort(np.array(inds), -1), np.sort(np.array(ref_i), -1))
    close(mx.sort(scores, -1), mx.sort(ref_s, -1))


@pytest.mark.parametrize("rows,V", [(1, 248320), (3, 8192), (2, 100), (1, 8195)])
def test_log_softmax(rows, V):
    """Sampling's log-probabilities: one node, close to MLX's (and closer than it to float64),
    each row's bits its own (a verify pass's rows equal one-token decode's), infinite maxima as
    MLX has them."""
    x = rand(rows, V, scale=5.0)
    y = ops.log_softmax(x)
    assert "PocketLogSoftmax" in nodes(y)
    ref = x - mx.logsumexp(x, axis=-1, keepdims=True)
    x64 = np.array(x).astype(np.float64)
    m = x64.max(-1, keepdims=True)
    exact = x64 - (np.log(np.exp(x64 - m).sum(-1, keepdims=True)) + m)
    assert np.abs(np.array(y) - exact).max() <= max(1e-5, np.abs(np.array(ref) - exact).max())
    for r in range(rows):
        assert np.array_equal(np.array(ops.log_softmax(x[r : r + 1])), np.array(y)[r : r + 1])
    inf = mx.array([[-np.inf] * 5, [0.0, -np.inf, 1.0, 2.0, 3.0], [np.inf, 0.0, 1.0, 2.0, 3.0]],
                   mx.float32)
    got, want = np.array(ops.log_softmax(inf)), np.array(inf - mx.logsumexp(inf, axis=-1,
                                                                            keepdims=True))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.isposinf(got), np.isposinf(want))
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert np.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)


def test_without_the_extension_ops_are_mlx():
    x, w = rand(1, 1, 64), rand(64)
    kernels.set_enabled(False)
    try:
        for y in (ops.rms_norm(x, w, 1e-6), ops.causal_conv_silu(rand(1, 4, 64), rand(64, 4, 1)),
                  ops.rope(rand(1, 2, 1, 64), 32, 1e4, 3), ops.moe_route(x, 4, True)[1],
                  ops.log_softmax(x)):
            assert "Pocket" not in nodes(y)
    finally:
        kernels.set_enabled(True)
    # Non-float32 activations also take MLX's path.
    assert "Pocket" not in nodes(ops.rms_norm(x.astype(mx.bfloat16), None, 1e-6))


@pytest.mark.parametrize("fuse", [False, True])
def test_linear_attention_decode_is_one_node_and_matches_mlx(tiny_ckpt, exact_kernels, fuse):
    """One decode token of Gated DeltaNet between its projections (conv, gates, delta rule,
    gated norm) as one node: same output and same caches as MLX's ops, three steps in a row."""
    from pocket_mlx.engine.loader import load
    from pocket_mlx.models.cache import LinearAttentionCache

    model, _ = load(tiny_ckpt, device="cpu", dtype="float32", fuse=fuse)
    mixer = model.layers[0].linear_attn
    prompt = rand(1, 5, model.args.hidden_size)
    ours, ref = LinearAttentionCache(), LinearAttentionCache()
    mx.eval(mixer(prompt, ours))
    mx.eval(stock(mixer, prompt, ref))
    for _ in range(3):
        x = rand(1, 1, model.args.hidden_size)
        out = mixer(x, ours)
        assert "PocketLinearAttn" in nodes(out)
        expect = stock(mixer, x, ref)
        assert "PocketLinearAttn" not in nodes(expect)
        close(out, expect, rtol=1e-4)
        close(ours.state, ref.state, rtol=1e-4)
        close(ours.conv_state, ref.conv_state)
        assert ours.offset == ref.offset


def test_linear_attention_step_rejects_bad_shapes():
    B, Hk, Dk, Hv, Dv, K = 1, 2, 16, 4, 8, 4
    C = 2 * Hk * Dk + Hv * Dv
    args = [rand(B, 1, C), rand(B, 1, Hv * Dv), rand(B, 1, Hv), rand(B, 1, Hv),
            rand(B, K - 1, C), rand(C, K, 1), rand(Hv), rand(Hv), rand(Dv), rand(B, Hv, Dv, Dk)]
    dims = dict(Hk=Hk, Dk=Dk, Hv=Hv, Dv=Dv, eps=1e-6)
    assert len(kernels.linear_attn_step(*args, **dims)) == 3
    with pytest.raises(ValueError, match="shape mismatch"):
        kernels._ext.linear_attn_step(*args[:9], rand(B, Hv, Dv, Dk + 1), **dims)
    assert kernels.linear_attn_step(*args[:9], rand(B, Hv, Dv, Dk + 1), **dims) is None


def _address(a: mx.array) -> int:
    return np.asarray(memoryview(a)).ctypes.data


@pytest.mark.parametrize("Dk,Dv", [(32, 32), (128, 128), (24, 8)])
def test_linear_attention_step_writes_a_free_state_in_place(Dk, Dv):
    """Decode's new state takes the old one's buffer when nothing else holds it (no fresh buffer
    a layer a token), with the bits of a step into a new buffer; a state the caller still holds
    is left as it was."""
    B, Hk, Hv, K = 1, 2, 4, 4
    C = 2 * Hk * Dk + Hv * Dv
    ins = [rand(B, 1, C), rand(B, 1, Hv * Dv), rand(B, 1, Hv), rand(B, 1, Hv),
           rand(B, K - 1, C), rand(C, K, 1, scale=0.5), rand(Hv), rand(Hv), rand(Dv)]
    dims = dict(Hk=Hk, Dk=Dk, Hv=Hv, Dv=Dv, eps=1e-6)
    state = rand(B, Hv, Dv, Dk, scale=0.1) + 0  # a buffer of its own
    mx.eval(ins, state)
    before = np.array(state)
    o_ref, _, s_ref = kernels.linear_attn_step(*ins, state, **dims)
    mx.eval(o_ref, s_ref)
    assert np.array_equal(np.array(state), before)  # held: untouched
    assert _address(s_ref) != _address(state)
    where = _address(state)
    o, _, s = kernels.linear_attn_step(*ins, state, **dims)
    del state  # now only the step holds the old state
    mx.eval(o, s)
    assert _address(s) == where
    assert mx.array_equal(s, s_ref).item() and mx.array_equal(o, o_ref).item()


@pytest.mark.parametrize("B,Hk,Dk,Hv,Dv,L", [(1, 2, 32, 4, 32, 4), (1, 2, 24, 4, 8, 5),
                                           (1, 4, 128, 8, 128, 3), (2, 2, 32, 4, 16, 4)])
def test_linear_attention_rows_are_decode_steps(B, Hk, Dk, Hv, Dv, L):
    """The verify pass's multi-row node: row i's output and the caches after row i (tape slot
    i) are bit for bit those of i + 1 one-token steps, fed from views of one fused projection
    (strided rows) as the model feeds them; Dk = 24 takes the kernel's masked tail, B = 2 the
    row-by-row path."""
    K = 4
    C = 2 * Hk * Dk + Hv * Dv
    proj = rand(B, L, C + Hv * Dv + 2 * Hv)
    qkv, z, b, a = mx.split(proj, [C, C + Hv * Dv, C + Hv * Dv + Hv], axis=-1)
    fixed = [rand(C, K, 1, scale=0.5), rand(Hv), rand(Hv), rand(Dv)]
    conv, state = rand(B, K - 1, C), rand(B, Hv, Dv, Dk, scale=0.1)
    dims = dict(Hk=Hk, Dk=Dk, Hv=Hv, Dv=Dv, eps=1e-6)
    out, *slots = kernels.linear_attn_rows(qkv, z, b, a, conv, *fixed, state, **dims)
    conv_tape, state_tape = slots[:L], slots[L:]
    assert out.shape == (L, B, Hv * Dv) and len(state_tape) == L
    assert conv_tape[0].shape == (B, K - 1, C) and state_tape[0].shape == (B, Hv, Dv, Dk)
    assert "PocketLinearAttn" in nodes(out)
    for i in range(L):
        r = slice(i, i + 1)
        o, conv, state = kernels.linear_attn_step(qkv[:, r], z[:, r], b[:, r], a[:, r], conv,
                                                  *fixed, state, **dims)
        mx.eval(o, conv, state)
        assert mx.array_equal(out[i], o[:, 0]).item(), i
        assert mx.array_equal(conv_tape[i], conv).item(), i
        assert mx.array_equal(state_tape[i], state).item(), i
    with pytest.raises(ValueError, match="shape mismatch"):
        kernels._ext.linear_attn_rows(qkv, z[:, :1], b, a, conv, *fixed, state, **dims)


def test_causal_attention_rows_are_decode_rows():
    """Decode attends through the causal kernel with one row; an L-row causal call over a cache
    view (the verify pass) gives row i the bits of the one-row call over keys 0..S - L + i."""
    B, H, Hkv, D, S, L = 1, 4, 2, 64, 77, 6
    cap = 96
    keys, values = rand(B, Hkv, cap, D), rand(B, Hkv, cap, D)
    q, gate = rand(B, H, L, D), rand(B, L, H, D)
    out = ops.gated_attention(q, keys[:, :, :S], values[:, :, :S], gate, 0.125, "causal")
    assert "PocketCausalAttention" in nodes(out)
    for i in range(L):
        n = S - L + i + 1
        one = ops.gated_attention(q[:, :, i:i + 1], keys[:, :, :n], values[:, :, :n],
                                  gate[:, i:i + 1], 0.125, None)
        assert "PocketCausalAttention" in nodes(one)
        assert mx.array_equal(out[:, i], one[:, 0]).item(), i
    # RoPE of L rows at offset o (a transposed view, as the model's heads): row l has the bits
    # of one row at o + l.
    x = rand(B, L, H, D).transpose(0, 2, 1, 3)
    rows = ops.rope_rows(x, 16, 1e4, 40)
    for i in range(L):
        assert mx.array_equal(rows[:, :, i:i + 1], ops.rope(x[:, :, i:i + 1], 16, 1e4, 40 + i)).item()


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_moe_block_is_one_node_and_matches_mlx(tiny_ckpt, exact_kernels, fuse, tokens):
    """A whole sparse-MoE block (router, top-k experts, gated shared expert) as one node equals
    the block built from MLX's ops, with the shared expert's gate/up separate or fused."""
    from pocket_mlx.engine.loader import load

    model, _ = load(tiny_ckpt, device="cpu", dtype="float32", fuse=fuse)
    block = model.layers[1].mlp
    x = rand(1, tokens, model.args.hidden_size)
    out = block(x)
    assert "PocketMoE" in nodes(out) and "PocketGatherQMM" not in nodes(out)
    ref = stock(block, x)
    assert "PocketMoE" not in nodes(ref)
    close(out, ref, rtol=1e-4)  # float32 sums in another order over 3 chained products


def test_moe_block_prefill_in_slices_and_not_for_calibration(tiny_ckpt, exact_kernels):
    """Inputs longer than FUSED_MAX_TOKENS run as several block nodes (same result); with a
    calibration observer the block keeps MLX's ops (the observer needs the routing)."""
    from pocket_mlx.engine.loader import load

    model, _ = load(tiny_ckpt, device="cpu", dtype="float32")
    block = model.layers[0].mlp
    block.FUSED_MAX_TOKENS = 8
    long = rand(1, 20, model.args.hidden_size)
    out = block(long)
    assert nodes(out).count("PocketMoE") == 3
    close(out, stock(block, long), rtol=1e-4)
    seen = []
    block.observer = lambda *a: seen.append(a)
    assert "PocketMoE" not in nodes(block(rand(1, 1, model.args.hidden_size)))
    assert seen


def test_moe_block_rejects_bad_shapes(tiny_ckpt):
    from pocket_mlx.engine.loader import load

    model, _ = load(tiny_ckpt, device="cpu", dtype="float32")
    block = model.layers[0].mlp
    mats = block._quantized_mats()
    x = rand(1, 1, model.args.hidden_size)
    with pytest.raises(ValueError, match="wrong shape"):
        kernels._ext.moe_block(x, [mats[0], mats[0], *mats[2:]], k=block.top_k, normalize=True)
    with pytest.raises(ValueError, match="bad k"):
        kernels._ext.moe_block(x, mats, k=10_000, normalize=True)
    assert kernels.moe_block(x, mats[:-1], block.top_k, True) is None
