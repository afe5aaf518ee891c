"""Quantized matmul entry points used by every quantized layer of the model.

The model never calls `mx.quantized_matmul` / `mx.gather_qmm` directly: it calls these two
functions, so a faster CPU kernel (the optional C++ extension, `pocket_mlx.kernels`) can take over
on the CPU device while the GPU keeps MLX's own kernels. Without the extension these are exactly
MLX's ops.
"""

from __future__ import annotations

import mlx.core as mx


def _cpu_kernels():
    """The extension's kernels when generating on the CPU (the device of the current stream) and
    they are built and enabled, else None."""
    if mx.default_device() != mx.cpu:
        return None
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels if kernels.enabled() else None


def gated_delta(q, k, v, g, beta, state):
    """The extension's gated-delta recurrence on the CPU, else None (the model then uses its
    MLX form)."""
    k_ = _cpu_kernels()
    return k_.gated_delta(q, k, v, g, beta, state) if k_ is not None else None


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int):
    """x @ dequant(w).T in MLX's affine format."""
    k = _cpu_kernels()
    if k is not None and k.supports(x, bits, group_size):
        return k.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=group_size, bits=bits
    )


def gather_qmm(x, w, scales, biases, indices, *, group_size: int, bits: int,
               sorted_indices: bool = False):
    """Per-token expert matmul: x[..., 1, K] against dequant(w[indices]).T."""
    k = _cpu_kernels()
    if k is not None and k.supports(x, bits, group_size):
        return k.gather_qmm(x, w, scales, biases, indices, group_size=group_size, bits=bits,
                            sorted_indices=sorted_indices)
    return mx.gather_qmm(
        x, w, scales, biases, rhs_indices=indices, transpose=True,
        group_size=group_size, bits=bits, sorted_indices=sorted_indices,
    )
