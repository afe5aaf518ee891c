"""FAST GEMM path (csrc/core/qk_gemm*: >= 4 activation rows per expert or plain matrix) against
the exact int8-activation result computed by MLX, on every x86 ISA variant this CPU runs: many
rows per matrix (prefill), a few (batched decode), output rows not a multiple of the panel,
every group size, gathered experts with rows both above and below the GEMM threshold, and the
k experts of a token sharing one activation row."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from conftest import restore_isa

from pocket_mlx import kernels
from tests.test_kernels import _cpu_and_defaults, _fast_ref, _quantized, _x  # noqa: F401

RNG = np.random.default_rng()


def _fast(fn, *args, **kwargs):
    kernels.set_mode("fast")
    try:
        return np.array(fn(*args, **kwargs))
    finally:
        kernels.set_mode("exact")


def _err(o, ref):
    return float(np.abs(o - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("isa", ["auto", "avx512", "avx2"])
def test_gemm_plain(isa):
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available")
    try:
        for bits, gs in itertools.product((2, 4, 6, 8), (32, 64, 128)):
            if bits not in kernels.info()["fast_bits"]:
                continue
            K = 2 * gs + (512 if gs == 64 else 0)
            N = 37
            w, s, b = _quantized((N, K), gs, bits, mx.bfloat16)
            for M in (4, 7, 70):
                x = _x((M, K), mx.float32)
                ref = np.array(_fast_ref(x, w, s, b, gs, bits))
                o = _fast(kernels.quantized_matmul, x, w, s, b, group_size=gs, bits=bits)
                assert _err(o, ref) < 1e-4, f"{isa} bits={bits} gs={gs} M={M}: {_err(o, ref):.3g}"
    finally:
        restore_isa()


@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_gemm_gathered(isa):
    """Sorted prefill-style rows (one activation row per output row) and a token's k experts
    sharing its activation row; experts with 1..30 rows (both paths in one call)."""
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available")
    try:
        for bits in (2, 4):
            gs, E, N, K = 64, 6, 40, 256
            we, se, be = _quantized((E, N, K), gs, bits, mx.float32)
            T, k = 23, 3
            inds = np.stack([RNG.choice(E, k, replace=False) for _ in range(T)]).astype(np.uint32)
            inds[:, 0] = 5  # expert 5 gets every token; others fewer
            x = _x((T, 1, 1, K), mx.float32)
            idx = mx.array(inds)
            ref = np.array(_fast_ref(x, we, se, be, gs, bits, idx))
            o = _fast(kernels.gather_qmm, x, we, se, be, idx, group_size=gs, bits=bits)
            assert _err(o, ref) < 1e-4, f"{isa} shared rows bits={bits}: {_err(o, ref):.3g}"
            flat = inds.reshape(-1)
            order = np.argsort(flat, kind="stable")
            xs = mx.array(np.array(x).reshape(T, K)[order // k].reshape(T * k, 1, K))
            si = mx.array(flat[order])
            ref = np.array(_fast_ref(xs, we, se, be, gs, bits, si))
            o = _fast(kernels.gather_qmm, xs, we, se, be, si, group_size=gs, bits=bits,
                      sorted_indices=True)
            assert _err(o, ref) < 1e-4, f"{isa} sorted bits={bits}: {_err(o, ref):.3g}"
    finally:
        restore_isa()


def _nll(logits, ids):
    t = np.array(ids)[0, 1:]
    lg = logits[0, :-1] - logits[0, :-1].max(-1, keepdims=True)
    return float((np.log(np.exp(lg).sum(-1)) - lg[np.arange(len(t)), t]).mean())


def test_fast_prefill_close_to_exact():
    """A 512-token prefill of the English validation text on the bundled (trained) model in
    FAST mode (projections, router and lm_head through the GEMM, the fused MoE block, causal
    attention) stays close to EXACT: mean token NLL within 0.02 (perplexity within 2%; measured
    +0.3%, and -0.1% / +0.07% on the code and Chinese texts) and the same top token almost
    everywhere. Exact equality is not expected: int8 activations, and a float sum in another
    order can move an activation across a rounding boundary, and a router's top-k with it."""
    from pocket_mlx.engine.loader import load
    from tests.conftest import ASSET, ROOT

    model, tok = load(str(ASSET), device="cpu", dtype="float32")
    ids = mx.array([tok.encode((ROOT / "assets" / "text" / "en.val.txt").read_text())[:512]])
    old = kernels._ext.gemm_min_rows()
    kernels.set_mode("exact")
    try:
        exact = np.array(model(ids))
        kernels.set_mode("fast")
        kernels._ext.set_gemm_min_rows(4)
        gemm = np.array(model(ids))
    finally:
        kernels._ext.set_gemm_min_rows(old)
        kernels.set_mode("exact")
    ne, ng = _nll(exact, ids), _nll(gemm, ids)
    agree = float((gemm.argmax(-1) == exact.argmax(-1)).mean())
    assert abs(ng - ne) < 0.02 and agree > 0.85, f"NLL {ng:.4f} vs {ne:.4f}, top-1 {agree:.2f}"
