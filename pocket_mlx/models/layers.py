"""Norm, linear, embedding and expert layers whose CPU forms go through `pocket_mlx.kernels.ops`.

Parameter names (`weight`, `scales`, `biases`) and the affine format are MLX's, so checkpoints
written by mlx-lm load here and ours load there. The only difference from `mlx.nn` is where the
quantized product is computed: `ops` may hand it to the CPU kernels of the C++ extension.
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx.kernels import ops


class RMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return ops.rms_norm(x, self["weight"], self.eps)


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        x = ops.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits,
        )
        if "bias" in self:
            x = x + self["bias"]
        return x


class Linear(nn.Linear):
    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        if mode != "affine":
            raise ValueError(f"only affine quantization is supported, not {mode!r}")
        out_dims, in_dims = self.weight.shape
        q = QuantizedLinear(in_dims, out_dims, "bias" in self, group_size, bits)
        q.weight, q.scales, q.biases = mx.quantize(self.weight, group_size, bits)
        if "bias" in self:
            q.bias = self.bias
        return q


class QuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return ops.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits,
        )


class Embedding(nn.Embedding):
    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        if mode != "affine":
            raise ValueError(f"only affine quantization is supported, not {mode!r}")
        n, d = self.weight.shape
        q = QuantizedEmbedding(n, d, group_size, bits)
        q.weight, q.scales, q.biases = mx.quantize(self.weight, group_size, bits)
        return q


class SwitchLinear(nn.Module):
    """All experts' weights of one projection in one [E, out, in] tensor."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return mx.gather_mm(
            x, self["weight"].swapaxes(-1, -2), rhs_indices=indices,
            sorted_indices=sorted_indices,
        )

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        if mode != "affine":
            raise ValueError(f"only affine quantization is supported, not {mode!r}")
        e, out_dims, in_dims = self.weight.shape
        q = QuantizedSwitchLinear(in_dims, out_dims, e, group_size, bits)
        q.weight, q.scales, q.biases = mx.quantize(self.weight, group_size, bits)
        return q


class QuantizedSwitchLinear(nn.Module):
    def __init__(self, input_dims: int, output_dims: int, num_experts: int,
                 group_size: int = 64, bits: int = 4):
        super().__init__()
        self.group_size, self.bits = group_size, bits
        # Zeros, not random: the real values always come from a checkpoint.
        self.weight = mx.zeros((num_experts, output_dims, input_dims * bits // 32), mx.uint32)
        self.scales = mx.zeros((num_experts, output_dims, input_dims // group_size))
        self.biases = mx.zeros((num_experts, output_dims, input_dims // group_size))
        self.freeze()

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return ops.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), indices,
            group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices,
        )


@partial(mx.compile, shapeless=True)
def combine_experts(experts, scores, shared_gate, shared):
    """Routed experts weighted by their scores, plus the sigmoid-gated shared expert."""
    return (experts * scores[..., None]).sum(axis=-2) + mx.sigmoid(shared_gate) * shared


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


class SwitchGLU(nn.Module):
    """The routed experts: gate/up/down projections applied to each token's top-k experts."""

    def __init__(self, dims: int, hidden_dims: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden_dims, num_experts)
        self.up_proj = SwitchLinear(dims, hidden_dims, num_experts)
        self.down_proj = SwitchLinear(hidden_dims, dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        # x [..., D], indices [..., k] -> [..., k, D]
        x = mx.expand_dims(x, (-2, -3))
        # With many tokens, sort them by expert so each expert's weights are read once.
        do_sort = indices.size >= 64
        idx, inv_order = indices, None
        if do_sort:
            k = indices.shape[-1]
            flat = indices.flatten()
            order = mx.argsort(flat)
            inv_order = mx.argsort(order)
            x = x.flatten(0, -3)[order // k]
            idx = flat[order]
        up = self.up_proj(x, idx, sorted_indices=do_sort)
        gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        x = self.down_proj(swiglu(gate, up), idx, sorted_indices=do_sort)
        if do_sort:
            x = mx.unflatten(x[inv_order], 0, indices.shape)
        return x.squeeze(-2)
