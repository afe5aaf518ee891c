"""The chunked (WY) form of the gated delta rule equals the step-by-step recurrence."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pocket_mlx.models.qwen3_5_moe import gated_delta_chunked, gated_delta_sequential


@pytest.mark.parametrize("B,T,Hk,Hv,D,with_state", [
    (1, 100, 2, 4, 32, True), (2, 64, 2, 2, 16, False), (1, 17, 1, 3, 8, True),
    (1, 130, 2, 4, 32, False),
])
def test_chunked_equals_sequential(B, T, Hk, Hv, D, with_state):
    rng = np.random.default_rng(T)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k = arr(B, T, Hk, D), arr(B, T, Hk, D)
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * D**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = arr(B, T, Hv, D)
    log_g = -mx.array(rng.uniform(0, 0.5, (B, T, Hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0, 1, (B, T, Hv)).astype(np.float32))
    s0 = arr(B, Hv, D, D) * 0.1 if with_state else None
    y1, s1 = gated_delta_sequential(q, k, v, mx.exp(log_g), beta, s0)
    y2, s2 = gated_delta_chunked(q, k, v, log_g, beta, s0, chunk=32)
    np.testing.assert_allclose(np.array(y2), np.array(y1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(s2), np.array(s1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [
    (1, 1, 16, 32, 128, 128), (1, 1, 2, 4, 40, 24), (1, 37, 2, 4, 32, 32), (2, 5, 1, 3, 12, 20), (1, 300, 2, 2, 64, 16),
    (2, 37, 2, 4, 128, 34), (1, 9, 1, 2, 256, 6),  # prefill kernel (AVX-512): Dk 128 and 256
])
def test_cpu_kernel_equals_sequential_and_leaves_held_state_alone(B, T, Hk, Hv, Dk, Dv,
                                                                    kernels_ext):
    kernels = kernels_ext
    if not kernels.enabled():  # built, but switched off by POCKET_MLX_KERNELS=0
        pytest.skip(f"C++ kernels not active: {kernels.info().get('reason')}")
    rng = np.random.default_rng(Dk + T)

    def arr(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    q, k, v = arr(B, T, Hk, Dk, scale=0.2), arr(B, T, Hk, Dk, scale=0.2), arr(B, T, Hv, Dv)
    g = mx.array(rng.uniform(0.5, 1, (B, T, Hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0, 1, (B, T, Hv)).astype(np.float32))
    s0 = arr(B, Hv, Dv, Dk, scale=0.1)
    before = np.array(s0)
    y1, s1 = gated_delta_sequential(q, k, v, g, beta, s0)
    y2, s2 = kernels.gated_delta(q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.array(y2), np.array(y1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(s2), np.array(s1), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.array(s0), before)  # held by us: not updated in place
    # A chain of single steps, each state handed over (donated), gives the same end state.
    s = mx.array(before)
    for t in range(T):
        _, s = kernels.gated_delta(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                   beta[:, t:t + 1], s)
        mx.eval(s)
    np.testing.assert_allclose(np.array(s), np.array(s1), rtol=1e-4, atol=1e-5)
