"""Parity of the C++ CPU kernels (pocket_mlx._qkernels) with MLX's own quantized ops.

Fresh random data every run. Every bits x group size x activation dtype x layout (plain,
gathered decode, gathered sorted), odd shapes, 1 and several threads, small and prefill-size M.
EXACT mode must match MLX computed in float32 within a relative error of 1e-5 (relative to the
largest output magnitude); float16/bfloat16 outputs are compared after rounding, within their
precision. Skips when the extension is not built (fails under POCKET_MLX_REQUIRE_KERNELS=1).
"""

from __future__ import annotations

import itertools
import os

import mlx.core as mx
import numpy as np
import pytest
from conftest import restore_isa

from pocket_mlx import kernels

BITS = (1, 2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
RTOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
RNG = np.random.default_rng()  # fresh data each run


@pytest.fixture(autouse=True)
def _cpu_and_defaults(kernels_ext):
    """Every test here: skips without the extension (fails under POCKET_MLX_REQUIRE_KERNELS=1,
    see conftest.kernels_ext), runs on the CPU and leaves the kernels' settings as it found them."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    kernels.set_enabled(True)
    old_mode = kernels.get_mode()
    kernels.set_mode("exact")
    kernels._ext.set_single_thread_bytes(0)  # use the pool even for tiny shapes
    yield
    kernels.set_mode(old_mode)
    kernels._ext.set_single_thread_bytes(256 * 1024)
    kernels.set_threads(None)
    restore_isa()
    mx.set_default_device(old)


def _quantized(shape, gs, bits, sdtype):
    w = mx.array(RNG.standard_normal(shape).astype(np.float32) * 0.05)
    wq, s, b = mx.quantize(w, gs, bits)
    return wq, s.astype(sdtype), b.astype(sdtype)


def _x(shape, dtype):
    return mx.array(RNG.standard_normal(shape).astype(np.float32)).astype(dtype)


def _promote(a, b):
    return (mx.zeros((1,), a) + mx.zeros((1,), b)).dtype


def _f32(*arrs):
    return [a.astype(mx.float32) for a in arrs]


def _check(ours, ref, out_dtype, what, scale=None):
    """Max error relative to the largest output, or to `scale` (see _magnitude) when given."""
    assert ours.dtype == out_dtype, f"{what}: dtype {ours.dtype} != {out_dtype}"
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    o = np.array(ours.astype(mx.float32))
    r = np.array(ref.astype(mx.float32))
    scale = max(float(np.abs(r).max()) if scale is None else scale, 1e-6)
    err = float(np.abs(o - r).max()) / scale
    tol = RTOL[out_dtype] if out_dtype in RTOL else 1e-5
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _magnitude(x, w, s, b, gs, bits):
    """Largest sum of |x_k * w_nk| over any activation row and weight row: the scale a float32
    dot product's rounding error is proportional to. A random test with a single output (N = 1)
    can land near zero by cancellation, where the error relative to |output| is meaningless."""
    wd = mx.dequantize(w, *_f32(s, b), group_size=gs, bits=bits)
    xa = np.abs(np.array(x.astype(mx.float32))).reshape(-1, x.shape[-1])
    wa = np.abs(np.array(wd)).reshape(-1, x.shape[-1])
    return float((xa @ wa.T).max())


def _ref_qmm(x, w, s, b, gs, bits):
    xf, sf, bf = _f32(x, s, b)
    return mx.quantized_matmul(xf, w, sf, bf, transpose=True, group_size=gs, bits=bits)


def _ref_gather(x, w, s, b, idx, gs, bits):
    xf, sf, bf = _f32(x, s, b)
    return mx.gather_qmm(xf, w, sf, bf, rhs_indices=idx, transpose=True, group_size=gs, bits=bits)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs", GROUPS)
def test_plain_parity(bits, gs):
    for dtype in DTYPES:
        sdtype = DTYPES[RNG.integers(3)]
        K = gs * int(RNG.integers(1, 6))  # multiple of gs, often not of the SIMD block
        N = int(RNG.integers(1, 50))  # not a multiple of lanes or threads
        w, s, b = _quantized((N, K), gs, bits, sdtype)
        out_dtype = _promote(dtype, sdtype)
        for threads, shape in ((1, (1, K)), (2, (3, K)), (2, (2, 1, 5, K)), (1, (K,))):
            kernels.set_threads(threads)
            x = _x(shape, dtype)
            ours = kernels.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
            ref = _ref_qmm(x, w, s, b, gs, bits)
            _check(ours, ref.astype(out_dtype), out_dtype,
                   f"qmm bits={bits} gs={gs} x={dtype} s={sdtype} {shape} N={N} t={threads}",
                   _magnitude(x, w, s, b, gs, bits))
        if dtype == mx.float32 and sdtype == mx.float32:
            # Float32 everywhere: also straight against MLX's own op.
            x = _x((2, K), dtype)
            ours = kernels.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
            ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)
            _check(ours, ref, mx.float32, f"qmm vs mx bits={bits} gs={gs}",
                   _magnitude(x, w, s, b, gs, bits))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs", GROUPS)
def test_gathered_parity(bits, gs):
    E = int(RNG.integers(3, 9))
    k = min(E, 4)
    for dtype in DTYPES:
        sdtype = DTYPES[RNG.integers(3)]
        K = gs * int(RNG.integers(1, 5))
        N = int(RNG.integers(1, 40))
        w, s, b = _quantized((E, N, K), gs, bits, sdtype)
        out_dtype = _promote(dtype, sdtype)
        threads = int(RNG.integers(1, 3))
        kernels.set_threads(threads)
        tag = f"bits={bits} gs={gs} x={dtype} s={sdtype} E={E} N={N} K={K} t={threads}"
        # Decode layout of SwitchGLU: x [B, L, 1, 1, K] against indices [B, L, k].
        B, L = 1, int(RNG.integers(1, 4))
        idx = mx.array(np.stack([RNG.permutation(E)[:k] for _ in range(B * L)])
                       .reshape(B, L, k).astype(np.uint32))
        x = _x((B, L, 1, 1, K), dtype)
        ours = kernels.gather_qmm(x, w, s, b, idx, group_size=gs, bits=bits)
        _check(ours, _ref_gather(x, w, s, b, idx, gs, bits).astype(out_dtype), out_dtype,
               "gather decode " + tag, _magnitude(x, w, s, b, gs, bits))
        # Down projection: x [B, L, k, 1, K] (one row per selected expert).
        xd = _x((B, L, k, 1, K), dtype)
        ours = kernels.gather_qmm(xd, w, s, b, idx, group_size=gs, bits=bits)
        _check(ours, _ref_gather(xd, w, s, b, idx, gs, bits).astype(out_dtype), out_dtype,
               "gather down " + tag, _magnitude(xd, w, s, b, gs, bits))
        # Sorted layout: x [T*k, 1, K] with flat sorted indices.
        T = int(RNG.integers(2, 12))
        flat = np.sort(RNG.integers(0, E, T * k)).astype(np.uint32)
        xs = _x((T * k, 1, K), dtype)
        ours = kernels.gather_qmm(xs, w, s, b, mx.array(flat), group_size=gs, bits=bits,
                                  sorted_indices=True)
        _check(ours, _ref_gather(xs, w, s, b, mx.array(flat), gs, bits).astype(out_dtype),
               out_dtype, "gather sorted " + tag, _magnitude(xs, w, s, b, gs, bits))


@pytest.mark.parametrize("bits,gs", [(1, 32), (1, 128), (2, 64), (3, 32), (4, 64), (6, 128), (8, 32),
                                     (5, 64)])
def test_prefill_sizes(bits, gs):
    """Large M (tiles of 8 rows reuse each dequantized weight row), plain and MoE-sorted."""
    K, N = gs * 3, 67
    w, s, b = _quantized((N, K), gs, bits, mx.bfloat16)
    for threads in (1, 2):
        kernels.set_threads(threads)
        M = int(RNG.integers(100, 300))
        x = _x((M, K), mx.float32)
        ours = kernels.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
        _check(ours, _ref_qmm(x, w, s, b, gs, bits), mx.float32, f"prefill M={M} t={threads}")
    E, k, T = 6, 4, 40
    we, se, be = _quantized((E, N, K), gs, bits, mx.float32)
    flat = np.sort(RNG.integers(0, E, T * k)).astype(np.uint32)
    xs = _x((T * k, 1, K), mx.float32)
    ours = kernels.gather_qmm(xs, we, se, be, mx.array(flat), group_size=gs, bits=bits)
    ref = mx.gather_qmm(xs, we, se, be, rhs_indices=mx.array(flat), transpose=True,
                        group_size=gs, bits=bits)
    _check(ours, ref, mx.float32, "prefill MoE sorted")


def test_every_isa_this_cpu_runs():
    """The same parity for each instruction set this CPU can run (forced)."""
    tried = []
    for isa in ("avx512", "avx2", "neon", "scalar"):
        if not kernels.set_isa(isa):
            continue
        tried.append(isa)
        for bits, gs in itertools.product(BITS, (32, 128)):
            K, N = gs * 3, 19
            w, s, b = _quantized((4, N, K), gs, bits, mx.bfloat16)
            x = _x((5, 1, K), mx.float32)
            idx = mx.array(RNG.integers(0, 4, 5).astype(np.uint32))
            ours = kernels.gather_qmm(x, w, s, b, idx, group_size=gs, bits=bits)
            _check(ours, _ref_gather(x, w, s, b, idx, gs, bits), mx.float32,
                   f"isa={isa} bits={bits} gs={gs}")
    assert "scalar" in tried


def test_strided_and_broadcast_inputs():
    gs, bits, K, N = 64, 4, 256, 33
    w, s, b = _quantized((N, K), gs, bits, mx.float32)
    xt = _x((K, 3), mx.float32).T  # non-contiguous activations
    _check(kernels.quantized_matmul(xt, w, s, b, group_size=gs, bits=bits),
           _ref_qmm(xt, w, s, b, gs, bits), mx.float32, "transposed x")
    we, se, be = _quantized((5, N, K), gs, bits, mx.float32)
    xb = mx.broadcast_to(_x((1, 1, K), mx.float32), (4, 1, K))
    idx = mx.array([4, 0, 2, 2], dtype=mx.int32)
    _check(kernels.gather_qmm(xb, we, se, be, idx, group_size=gs, bits=bits),
           _ref_gather(xb, we, se, be, idx, gs, bits), mx.float32, "broadcast x, int32 indices")


def test_fallbacks_and_switches():
    gs, bits, K, N = 64, 4, 128, 8
    w, s, b = _quantized((N, K), gs, bits, mx.float32)
    x = _x((1, K), mx.float32)
    assert kernels.supports(x, bits, gs) and kernels.supports(x, 1, gs)
    assert not kernels.supports(x, 7, gs) and not kernels.supports(x, 4, 16)
    assert not kernels.supports(_x((1, 96), mx.float32), 4, 64)
    # Unsupported (a batch of weight matrices in quantized_matmul) -> MLX's op, same result.
    w3, s3, b3 = mx.quantize(mx.array(RNG.standard_normal((2, N, K)).astype(np.float32)), 32, 1)
    x3 = _x((2, 1, K), mx.float32)
    out = kernels.quantized_matmul(x3, w3, s3, b3, group_size=32, bits=1)
    ref = mx.quantized_matmul(x3, w3, s3, b3, transpose=True, group_size=32, bits=1)
    _check(out, ref, mx.float32, "fallback batched weights")
    info = kernels.info()
    assert info["active"] and info["isa"] in ("avx512", "avx2", "neon", "scalar")
    assert info["mode"] in ("exact", "fast") and info["threads"] >= 1
    kernels.set_enabled(False)
    assert not kernels.enabled() and not kernels.info()["active"]
    assert "set_enabled" in kernels.info()["reason"]
    kernels.set_enabled(True)
    os.environ["POCKET_MLX_KERNELS"] = "0"
    try:
        assert not kernels.enabled()
        assert "POCKET_MLX_KERNELS" in kernels.info()["reason"]
    finally:
        del os.environ["POCKET_MLX_KERNELS"]
    assert kernels.enabled()
    kernels.set_threads(1)
    assert kernels.get_threads() == 1
    kernels.set_threads(None)
    assert kernels.get_threads() >= 1
    with pytest.raises(ValueError):
        kernels.set_mode("turbo")


def test_ops_uses_kernels_on_cpu():
    from pocket_mlx.kernels import ops

    gs, bits, K, N = 32, 2, 128, 24
    w, s, b = _quantized((N, K), gs, bits, mx.bfloat16)
    x = _x((2, K), mx.float32)
    out = ops.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
    _check(out, _ref_qmm(x, w, s, b, gs, bits), mx.float32, "ops.quantized_matmul")
    we, se, be = _quantized((3, N, K), gs, bits, mx.bfloat16)
    idx = mx.array([[2, 0]], dtype=mx.uint32)
    xg = _x((1, 1, 1, K), mx.float32)
    out = ops.gather_qmm(xg, we, se, be, idx, group_size=gs, bits=bits)
    _check(out, _ref_gather(xg, we, se, be, idx, gs, bits), mx.float32, "ops.gather_qmm")


def test_fast_mode_close():
    """FAST (int8 activations) is approximate; it must stay close. It is the default unless
    POCKET_MLX_KERNEL_MODE says otherwise."""
    env = os.environ.get("POCKET_MLX_KERNEL_MODE", "").strip().lower()
    assert kernels._ext.get_mode() in (0, 1)
    assert kernels.DEFAULT_MODE == "fast" or env
    gs, K, N = 64, 512, 40
    for bits in BITS:
        w, s, b = _quantized((N, K), gs, bits, mx.bfloat16)
        x = _x((3, K), mx.float32)
        kernels.set_mode("fast")
        try:
            out = kernels.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
        finally:
            kernels.set_mode("exact")
        ref = _ref_qmm(x, w, s, b, gs, bits)
        o, r = np.array(out), np.array(ref)
        err = np.abs(o - r).max() / np.abs(r).max()
        assert err < 2e-2, f"fast mode bits={bits}: relative error {err:.3g}"


def _int8_groups(x, gs):
    """x as FAST mode sees it: int8 codes per group of gs (scale max|x|/127), dequantized."""
    a = np.array(x.astype(mx.float32))
    g = a.reshape(*a.shape[:-1], -1, gs)
    d = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = np.clip(np.rint(g * inv), -127, 127)
    return mx.array((v * d).reshape(a.shape).astype(np.float32))


def _fast_ref(x, w, s, b, gs, bits, idx=None):
    """FAST mode's exact result: sum s*q*x8 (int8 activations) + sum b*x (exact group sums)."""
    xq = _int8_groups(x, gs)
    zs = mx.zeros_like(s)
    if idx is None:
        return (_ref_qmm(xq, w, s, b, gs, bits) + _ref_qmm(x - xq, w, zs, b, gs, bits))
    return (_ref_gather(xq, w, s, b, idx, gs, bits) + _ref_gather(x - xq, w, zs, b, idx, gs, bits))


@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_fast_mode_shapes(isa):
    """FAST on every ISA variant equals the int8-activation result computed by MLX: tails (K not a multiple of the SIMD block), all group sizes,
    6-bit (VBMI or shift unpack), gathered decode with rows sharing activations, rows at the very
    end of the weight buffer."""
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available")
    try:
        for bits, gs in itertools.product((1, 2, 4, 6, 8), GROUPS):
            for K in (gs * 3, 1024 + gs):
                N = 37
                w, s, b = _quantized((N, K), gs, bits, mx.float32)
                x = _x((2, K), mx.float32)
                # The extension says which bits have FAST kernels here (8-bit needs VNNI: maddubs
                # would saturate); the others run EXACT.
                fast_here = bits in kernels.info()["fast_bits"]
                ref = np.array(_fast_ref(x, w, s, b, gs, bits) if fast_here
                               else _ref_qmm(x, w, s, b, gs, bits))
                kernels.set_mode("fast")
                try:
                    o = np.array(kernels.quantized_matmul(x, w, s, b, group_size=gs, bits=bits))
                finally:
                    kernels.set_mode("exact")
                err = np.abs(o - ref).max() / np.abs(ref).max()
                assert err < 1e-4, f"{isa} bits={bits} gs={gs} K={K}: {err:.3g}"
            we, se, be = _quantized((5, N, K), gs, bits, mx.float32)
            idx = mx.array([[[4, 0, 2, 4, 1]]], dtype=mx.uint32)
            xg = _x((1, 1, 1, 1, K), mx.float32)
            ref = np.array(_fast_ref(xg, we, se, be, gs, bits, idx) if fast_here
                           else _ref_gather(xg, we, se, be, idx, gs, bits))
            kernels.set_mode("fast")
            try:
                o = np.array(kernels.gather_qmm(xg, we, se, be, idx, group_size=gs, bits=bits))
            finally:
                kernels.set_mode("exact")
            err = np.abs(o - ref).max() / np.abs(ref).max()
            assert err < 1e-4, f"{isa} gathered bits={bits} gs={gs}: {err:.3g}"
    finally:
        restore_isa()


def test_exact_shared_activation_rows():
    """Gate/up-style gather: one token's activations used by k experts (prepared once)."""
    for bits, gs in itertools.product(BITS, (32, 64)):
        K, N = 256 + gs, 19
        we, se, be = _quantized((6, N, K), gs, bits, mx.float32)
        idx = mx.array([[[5, 1, 3, 5, 0, 2]], [[1, 1, 4, 0, 2, 3]]], dtype=mx.uint32)
        xg = _x((2, 1, 1, 1, K), mx.float32)
        out = kernels.gather_qmm(xg, we, se, be, idx, group_size=gs, bits=bits)
        _check(out, _ref_gather(xg, we, se, be, idx, gs, bits), mx.float32,
               f"shared rows bits={bits} gs={gs}")


def test_one_bit_experts_moe_block(tiny_ckpt):
    """A decode MoE block whose routed experts are 1-bit (MLX's bits=1, re-quantized from the
    tiny model's experts) runs as the extension's one node and equals the block built from MLX's
    own ops: within float32 rounding in EXACT, within FAST's tolerance in FAST."""
    import io

    from pocket_mlx.engine.loader import load
    from pocket_mlx.kernels import ops
    from pocket_mlx.models.layers import combine_experts

    model, _ = load(tiny_ckpt, device="cpu", dtype="float32")
    block = model.layers[1].mlp
    for proj in (block.switch_mlp.gate_proj, block.switch_mlp.up_proj, block.switch_mlp.down_proj):
        w = mx.dequantize(proj["weight"], proj["scales"], proj["biases"],
                          group_size=proj.group_size, bits=proj.bits)
        proj["weight"], proj["scales"], proj["biases"] = mx.quantize(w, 32, 1)
        proj.group_size, proj.bits = 32, 1
    x = _x((1, 1, model.args.hidden_size), mx.float32)
    kernels.set_enabled(False)
    try:
        ref = np.array(block(x))
    finally:
        kernels.set_enabled(True)
    # FAST: three chained int8-activation products, so against MLX's float result only loosely;
    # against the same block built from the extension's separate FAST matmuls (the path prefill
    # takes) tightly.
    for mode, tol in (("exact", 1e-4), ("fast", 5e-2)):
        kernels.set_mode(mode)
        out = block(x)
        dot = io.StringIO()
        mx.export_to_dot(dot, out)
        assert "PocketMoE" in dot.getvalue(), "1-bit experts did not run in the extension"
        err = np.abs(np.array(out) - ref).max() / np.abs(ref).max()
        assert err <= tol, f"1-bit MoE block, {mode}: relative error {err:.3g}"
        if mode == "fast":
            inds, scores = ops.moe_route(block.gate(x), block.top_k, block.norm_topk_prob)
            sep = combine_experts(block.switch_mlp(x, inds), scores, block.shared_expert_gate(x),
                                  block.shared_expert(x))
            err = np.abs(np.array(out) - np.array(sep)).max() / np.abs(np.array(sep)).max()
            assert err <= 1e-3, f"1-bit MoE block, fast vs separate fast matmuls: {err:.3g}"
    kernels.set_mode("exact")
