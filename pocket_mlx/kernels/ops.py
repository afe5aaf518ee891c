"""The model's entry points to the optional C++ extension (`pocket_mlx.kernels`).

The model never calls the MLX ops these stand for directly (`mx.quantized_matmul`,
`mx.gather_qmm`, `mx.fast.rms_norm`, `mx.fast.rope`, its depthwise conv and router): it calls the
functions here, so the extension's faster CPU kernels take over when generating on the CPU with
the extension built and enabled, while the GPU keeps MLX's own kernels. Without the extension
each function is exactly its MLX form; `gated_delta`, `moe_block`, `linear_attn_step` and
`linear_attn_rows` return None instead, and the caller runs its own MLX code.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx import kernels


def _cpu_kernels():
    """The extension's kernels when generating on the CPU (the device of the current stream) and
    they are built and enabled, else None."""
    if mx.default_device() != mx.cpu:
        return None
    return kernels if kernels.enabled() else None


def gated_delta(q, k, v, g, beta, state):
    """The extension's gated-delta recurrence on the CPU, else None (the model then uses its
    MLX form)."""
    k_ = _cpu_kernels()
    return k_.gated_delta(q, k, v, g, beta, state) if k_ is not None else None


def moe_block(x, mats: list, k: int, normalize: bool):
    """A whole sparse-MoE block in one node of the extension on the CPU, else None. `mats`: the
    (weight, scales, biases, bits, group_size) of router, shared-expert gate, shared gate_proj
    (or fused gate_up), [shared up_proj,] shared down_proj, experts' gate, up and down."""
    k_ = _cpu_kernels()
    return k_.moe_block(x, mats, k, normalize) if k_ is not None else None


def moe_block_parts(x, mats: list, k: int, normalize: bool, expert_lo: int, with_shared: bool):
    """Expert parallelism (engine/distributed/): `moe_block`'s parts for the experts held
    here, (parts, scores), else None; `moe_combine` of the parts summed over the ranks is
    bit-identical to `moe_block` in one process."""
    k_ = _cpu_kernels()
    if k_ is None:
        return None
    return k_.moe_block_parts(x, mats, k, normalize, expert_lo, with_shared)


def moe_combine(parts, scores):
    return kernels.moe_combine(parts, scores)


def linear_attn_step(qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, norm_w, state, *,
                     Hk: int, Dk: int, Hv: int, Dv: int, eps: float):
    """One decode token of Gated DeltaNet after its projections (conv, gates, delta rule, gated
    norm) in one node of the extension on the CPU: (out, new conv_state, new state), else None."""
    k_ = _cpu_kernels()
    if k_ is None:
        return None
    return k_.linear_attn_step(qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, norm_w, state,
                               Hk=Hk, Dk=Dk, Hv=Hv, Dv=Dv, eps=eps)


def linear_attn_rows(qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, norm_w, state, *,
                     Hk: int, Dk: int, Hv: int, Dv: int, eps: float):
    """`linear_attn_step` for the L rows of qkv, z, b, a [B, L, n] in one node (the verify
    pass): (out [L, B, Hv*Dv], the conv_state after each of the L rows, then the state after
    each) as 2L + 1 arrays, else None."""
    k_ = _cpu_kernels()
    if k_ is None:
        return None
    return k_.linear_attn_rows(qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, norm_w, state,
                               Hk=Hk, Dk=Dk, Hv=Hv, Dv=Dv, eps=eps)


def _decode_op(name: str, *args, **kwargs):
    k = _cpu_kernels()
    return k.decode_op(name, *args, **kwargs) if k is not None else None


def rms_norm(x, weight, eps: float):
    """mx.fast.rms_norm; on the CPU one node of the extension instead of MLX's composed
    fallback (~10 nodes)."""
    out = _decode_op("rms_norm", x, weight, None, eps=eps)
    return out if out is not None else mx.fast.rms_norm(x, weight, eps)


def rms_norm_gated(x, weight, gate, eps: float):
    """rms_norm(x, weight) * silu(gate), computed in float32, in x's dtype."""
    out = _decode_op("rms_norm", x, weight, gate, eps=eps)
    return out if out is not None else _gated(x, gate, mx.fast.rms_norm(x, weight, eps))


@partial(mx.compile, shapeless=True)
def _gated(x, gate, y):
    return (nn.silu(gate.astype(mx.float32)) * y.astype(mx.float32)).astype(x.dtype)


def log_softmax(logits):
    """logits - logsumexp(logits, axis=-1): sampling's log-probabilities. On the CPU one node of
    the extension (8 lanes at a time, on the pool; MLX's CPU logsumexp runs one thread with a
    scalar exp per value: ~3.2 ms a token over Qwen3.5's 248,320 logits, 5% of a 35B decode
    step), else MLX's. Each row's bits are its own (a verify pass's rows equal one-token
    decode's)."""
    out = _decode_op("log_softmax", logits)
    return out if out is not None else logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def causal_conv_silu(x, w):
    """silu(causal depthwise conv): x [B, S + K - 1, C] (K - 1 rows of history first),
    w [C, K, 1] -> [B, S, C]."""
    out = _decode_op("causal_conv_silu", x, w)
    return out if out is not None else nn.silu(depthwise_conv(x, w))


def depthwise_conv(x: mx.array, w: mx.array) -> mx.array:
    """Causal depthwise conv as K shifted multiply-adds: the same sum as nn.Conv1d(groups=C),
    a handful of fused elementwise ops instead of MLX's grouped convolution (slow for one
    token)."""
    K = w.shape[1]
    S = x.shape[1] - K + 1
    w = w[:, :, 0].astype(x.dtype)
    out = x[:, 0:S] * w[:, 0]
    for j in range(1, K):
        out = out + x[:, j:j + S] * w[:, j]
    return out


def rope(x, dims: int, base: float, offset):
    """mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=offset)."""
    # Decode only (one position): a prefill's x is a transposed view the kernel would copy.
    out = (_decode_op("rope", x, dims=dims, base=base, offset=offset)
           if isinstance(offset, int) and x.shape[-2] == 1 else None)
    return out if out is not None else mx.fast.rope(
        x, dims, traditional=False, base=base, scale=1.0, offset=offset)


def rope_rows(x, dims: int, base: float, offset: int):
    """The extension's RoPE of x [B, H, L, D], position offset + l, in one node, row l with the
    bits of `rope` of that row alone at offset + l (the verify pass), else None."""
    return _decode_op("rope", x, dims=dims, base=base, offset=offset)


def decode_attention_node(q) -> bool:
    """Whether `gated_attention` of a one-row decode step runs the extension's causal kernel
    here (and so whether the verify pass may attend its rows in that one node too)."""
    return (_cpu_kernels() is not None and q.dtype == mx.float32 and q.shape[-1] % 16 == 0
            and hasattr(kernels._ext, "causal_attention"))


def gated_attention(q, k, v, gate, scale: float, mask):
    """Attention then the output gate: sdpa(q, k, v, scale, mask) as [B, L, H * D], times
    sigmoid(gate) ([B, L, H, D]). A causal float32 prefill on the CPU is one node of the
    extension (tiled kernel, output written in this layout, gate applied on the way out): MLX's
    CPU path materialises the score matrix and multiplies with the wheel's reference BLAS (~1.6 s
    per full-attention layer for a 512-token prompt of the 35B shape), and its sigmoid alone
    took ~30 ms there. A one-row decode step (no mask) runs the same node: row i of the kernel
    sees keys up to S - L + i and its sums depend on nothing else, so an L-row causal call (the
    verify pass, models/verify.py) gives each row the bits of that row's decode step, and one
    node replaces MLX's ~8 composed ones per layer."""
    B, _, L, _ = q.shape
    if L == 1 and isinstance(mask, str) and mask == "causal":
        mask = None  # one row sees every key either way (a one-row verify pass)
    causal = isinstance(mask, str) and mask == "causal"
    if causal or (mask is None and L == 1 and decode_attention_node(q)):
        out = _decode_op("causal_attention", q, k, v, gate, scale=scale)
        if out is not None:
            return out.reshape(B, L, -1)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate.reshape(B, L, -1))


def decode_attention_runs(q, k, v, gate) -> bool:
    """Whether `decode_attention` runs here for these inputs (the extension on the CPU,
    float32)."""
    return (decode_attention_node(q) and hasattr(kernels._ext, "decode_attention")
            and k.dtype == v.dtype == gate.dtype == mx.float32)


def decode_attention(q, k, v, gate, keys: list, values: list, offsets: list[int], dims: int,
                     base: float, scale: float):
    """One decode token of B sequences, row b with its own KV buffers keys[b] / values[b]
    [1, Hkv, room, D] holding offsets[b] positions, as one node of the extension on the CPU (see
    `_qkernels.decode_attention`): RoPE at each row's position, k and v written into its
    buffers, attention, output gate, with the bits of those ops run per sequence. Returns
    [out [B, 1, Hq, D], keys[0], values[0], keys[1], ...] (the buffers as written), or None when
    the extension cannot run it (the caller then runs those ops)."""
    if not decode_attention_runs(q, k, v, gate):
        return None
    try:
        return kernels._ext.decode_attention(q, k, v, gate, keys, values, offsets, dims=dims,
                                             base=base, scale=scale)
    except ValueError:  # a shape the node does not take
        return None


def moe_route(logits, k: int, normalize: bool):
    """Router: softmax over the experts, the top-k (indices, probabilities), probabilities
    renormalized over the k when `normalize`. Order within the k is unspecified."""
    out = _decode_op("moe_route", logits, k=k, normalize=normalize)
    if out is not None:
        return tuple(out)
    probs = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int):
    """x @ dequant(w).T in MLX's affine format."""
    k = _cpu_kernels()
    if k is not None and k.supports(x, bits, group_size):
        return k.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
    kernels.check_mlx_layout(w)
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
    kernels.check_mlx_layout(w)
    return mx.gather_qmm(
        x, w, scales, biases, rhs_indices=indices, transpose=True,
        group_size=group_size, bits=bits, sorted_indices=sorted_indices,
    )
