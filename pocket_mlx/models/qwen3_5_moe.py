"""Qwen3.5-MoE (the POCKET family): hybrid Gated DeltaNet / gated full attention with sparse MoE.

One readable file, in the manner of mlx-lm's models/*.py. The module tree (and so every weight
name) mirrors mlx-lm's `qwen3_5_moe`, so MLX checkpoints move between the two unchanged:
`language_model.model.layers.{i}.{linear_attn|self_attn|mlp}...`, `language_model.lm_head`.

Differences from mlx-lm that matter:
- layers follow the config's `layer_types` (mlx-lm assumes every 4th is full attention);
- the (1 + w) RMSNorm shift of a transformers checkpoint is applied in float32 and kept in float32
  (mlx-lm shifts in the checkpoint's dtype and loses bf16 precision);
- quantized products go through `pocket_mlx.kernels.ops` (CPU kernels of the extension when present);
  on the CPU a decode token's MoE block and Gated DeltaNet core (between its projections) are one
  extension node each (`ops.moe_block`, `ops.linear_attn_step`), MLX's ops otherwise.
- `Model.fuse_projections` (inference loads only) runs projections of the same input as one
  matmul, under new names (`in_proj`, `qkv_proj`, `gate_up_proj`; see pocket_mlx/models/fusion.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx import kernels
from pocket_mlx.config import model_type, resolve_layer_types, text_config
from pocket_mlx.errors import PocketError
from pocket_mlx.kernels import ops
from pocket_mlx.models.cache import CACHE_TYPES, KVCache, LinearAttentionCache, attend_as
from pocket_mlx.models.fusion import fuse, project
from pocket_mlx.models.layers import Embedding, Linear, RMSNorm, SwitchGLU, combine_experts
from pocket_mlx.models.parallel import ExpertParallelMixin, PipelineMixin, split_evenly

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_MAY_BE_ZERO = ("mtp_num_hidden_layers",)


@dataclass
class ModelArgs:
    model_type: str = "qwen3_5_moe"
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    vocab_size: int = 248320
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    linear_num_value_heads: int = 32
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    full_attention_interval: int = 4
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    # The multi-token-prediction head (`mtp.*`): 0 when the checkpoint has none.
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        # A hand-edited config may hold anything: sizes must be positive integers, rates and
        # factors finite numbers, before any of them is used to build a layer.
        for name, f in self.__dataclass_fields__.items():
            value = getattr(self, name)
            least = 0 if name in _MAY_BE_ZERO else 1
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)
                                    or value < least):
                what = "an integer >= 0" if least == 0 else "a positive integer"
                raise PocketError(f"config: {name} must be {what}, got {value!r}")
            if f.type == "float" and (not isinstance(value, int | float) or isinstance(value, bool)
                                      or not math.isfinite(value) or value < 0):
                raise PocketError(f"config: {name} must be a number >= 0, got {value!r}")
        self.layer_types = resolve_layer_types(self.num_hidden_layers, self.layer_types,
                                               self.full_attention_interval)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise PocketError("config: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise PocketError("config: num_experts_per_tok exceeds num_experts")

    @classmethod
    def from_config(cls, config: dict) -> ModelArgs:
        """Read a Hugging Face or MLX config.json (flat or with a nested `text_config`)."""
        text = text_config(config)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        values = {k: text[k] for k in cls.__dataclass_fields__ if k in text}
        values["model_type"] = model_type(config) or ""
        if text.get("head_dim") is None and "hidden_size" in text:
            values["head_dim"] = text["hidden_size"] // text.get("num_attention_heads", 16)
        if "rope_theta" in rope:
            values["rope_theta"] = float(rope["rope_theta"])
        if "partial_rotary_factor" in rope:
            values["partial_rotary_factor"] = float(rope["partial_rotary_factor"])
        if values.get("norm_topk_prob") is None:
            values["norm_topk_prob"] = True  # absent in some configs; Qwen3.5 means True
        return cls(**values)


class RMSNormGated(nn.Module):
    """RMSNorm of the delta-rule output, gated by silu(z). Its weight is not (1 + w)-shifted."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return ops.rms_norm_gated(x, self.weight, gate, self.eps)


# Small elementwise pieces are compiled: fused into one kernel each, they cost far fewer ops per
# decoded token (per-op overhead dominates decode of small models and of the CPU path).
@partial(mx.compile, shapeless=True)
def _log_decay(A_log, a, dt_bias):
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)


@mx.compile
def gated_delta_step(q, k, v, g, beta, state):
    """One step of the gated delta rule. q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H];
    state [B, H, Dv, Dk] in float32. Returns (y [B, H, Dv], new state)."""
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


def gated_delta(q, k, v, log_g, beta, state):
    """The recurrence over a sequence: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; log_g (log of the
    decay), beta [B, T, Hv]; state [B, Hv, Dv, Dk] float32 or None. Long sequences (prefill) go
    chunk-wise, single tokens (decode) step by step; on the CPU the C++ extension's kernel,
    when built, does either at memory speed."""
    fast = ops.gated_delta(q, k, v, mx.exp(log_g), beta, state)
    if fast is not None:
        y, state = fast
        return y.astype(q.dtype), state
    if q.shape[1] >= CHUNKED_MIN_TOKENS:
        return gated_delta_chunked(q, k, v, log_g, beta, state)
    return gated_delta_sequential(q, k, v, mx.exp(log_g), beta, state)


CHUNKED_MIN_TOKENS = 16


def gated_delta_sequential(q, k, v, g, beta, state):
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    ys = []
    for t in range(T):
        y, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


def _tri_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], C a power of two: block recursion,
    log2(C) levels of batched matmuls (no O(C) Python loop)."""
    C = A.shape[-1]
    lead = A.shape[:-2]
    inv = mx.ones((*lead, C, 1, 1), A.dtype)  # inverses of the 1x1 diagonal blocks
    b = 1
    while b < C:
        nb = C // (2 * b)
        blocks = A.reshape(*lead, 2 * nb, b, 2 * nb, b)
        # Sub-diagonal blocks (i+1, i); the pairs (2m+1, 2m) are the lower-left corners.
        l21 = mx.moveaxis(mx.diagonal(blocks, offset=-1, axis1=-4, axis2=-2), -1, -3)[..., 0::2, :, :]
        inv11, inv22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        x21 = -(inv22 @ l21 @ inv11)
        top = mx.concatenate([inv11, mx.zeros_like(inv11)], axis=-1)
        bottom = mx.concatenate([x21, inv22], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        b *= 2
    return inv[..., 0, :, :]

def gated_delta_chunked(q, k, v, log_g, beta, state, chunk: int = 64):
    """The same recurrence, a chunk of tokens at a time (the WY form of Gated DeltaNet): within a
    chunk everything is batched matmuls; only the state is carried from chunk to chunk. Takes the
    log of the decay, so every factor it exponentiates is <= 1 (stable in float32).

    With S the state transposed ([Dk, Dv]) and, inside a chunk, gamma_t the cumulative decay,
    U = (I + A)^-1 (beta V - beta gamma K S) with A_tj = beta_t gamma_t/gamma_j k_t.k_j (j < t),
    Y = gamma Q S + (QK^T o decay) U, and S' = gamma_C S + ((gamma_C/gamma) K)^T U.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    dtype = q.dtype
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    C = min(chunk, 1 << (T - 1).bit_length())  # a power of two, no wider than needed
    pad = (-T) % C
    if pad:
        widths = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v = (mx.pad(x, widths) for x in (q, k, v))
        log_g, beta = (mx.pad(x, widths[:3]) for x in (log_g, beta))
    N = (T + pad) // C
    f32 = mx.float32
    def chunks(x):
        return x.astype(f32).reshape(B, N, C, Hv, -1).transpose(0, 3, 1, 2, 4)  # [B,H,N,C,D]
    q, k, v = chunks(q), chunks(k), chunks(v)
    log_g = log_g.astype(f32).reshape(B, N, C, Hv).transpose(0, 3, 1, 2)
    beta = beta.astype(f32).reshape(B, N, C, Hv).transpose(0, 3, 1, 2)
    G = mx.cumsum(log_g, axis=-1)  # [B,H,N,C]
    idx = mx.arange(C)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = G[..., :, None] - G[..., None, :]
    decay = mx.exp(mx.where(causal, diff, -mx.inf))  # gamma_t / gamma_j for j <= t
    A = mx.where(strict, beta[..., None] * (k @ k.swapaxes(-1, -2)) * decay, 0.0)
    Tinv = _tri_inverse(A)
    gamma = mx.exp(G)[..., None]
    W = Tinv @ (beta[..., None] * gamma * k)       # [B,H,N,C,Dk]
    U0 = Tinv @ (beta[..., None] * v)              # [B,H,N,C,Dv]
    QK = (q @ k.swapaxes(-1, -2)) * decay          # [B,H,N,C,C]
    Qg = q * gamma
    last = G[..., -1:]                              # [B,H,N,1]
    Kd = k * mx.exp(last - G)[..., None]           # (gamma_C / gamma_j) k_j
    gC = mx.exp(last)[..., None]                   # [B,H,N,1,1]
    P = (mx.zeros((B, Hv, Dk, Dv), f32) if state is None else state.swapaxes(-1, -2))
    ys = []
    for n in range(N):
        U = U0[:, :, n] - W[:, :, n] @ P
        ys.append(Qg[:, :, n] @ P + QK[:, :, n] @ U)
        P = gC[:, :, n] * P + Kd[:, :, n].swapaxes(-1, -2) @ U
    y = mx.stack(ys, axis=2).reshape(B, Hv, N * C, Dv)[:, :, :T].transpose(0, 2, 1, 3)
    return y.astype(dtype), P.swapaxes(-1, -2)


class GatedDeltaNet(nn.Module):
    # The input projections, one matmul after `Model.fuse_projections` (same input x).
    FUSED = ("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = args.linear_conv_kernel_dim
        h = args.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                bias=False)
        self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(h, self.num_v_heads, bias=False)
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.zeros(self.num_v_heads)
        self.norm = RMSNormGated(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def __call__(self, x: mx.array, cache: LinearAttentionCache | None = None) -> mx.array:
        B, S, _ = x.shape
        qkv, z, b, a = project(self, x, *self.FUSED)
        if S == 1 and cache is not None and cache.state is not None:
            out = self._decode_step(qkv, z, b, a, cache)
            if out is not None:
                return self.out_proj(out)
        z = z.reshape(B, S, self.num_v_heads, self.head_v_dim)

        conv_state = cache.conv_state if cache is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, self.kernel - 1, self.conv_dim), dtype=x.dtype)
        conv_in = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            cache.conv_state = mx.contiguous(conv_in[:, -(self.kernel - 1):, :])
        conv_out = ops.causal_conv_silu(conv_in, self.conv1d.weight)

        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(B, S, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, S, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, S, self.num_v_heads, self.head_v_dim)
        # L2-normalise q and k; fold the Dk**-0.5 read-out scale into q.
        inv = self.head_k_dim**-0.5
        q = (inv * inv) * ops.rms_norm(q, None, 1e-6 * inv * inv)
        k = inv * ops.rms_norm(k, None, 1e-6 * inv * inv)

        beta = mx.sigmoid(b)
        log_g = _log_decay(self.A_log, a, self.dt_bias)
        out, state = gated_delta(q, k, v, log_g, beta, cache.state if cache is not None else None)
        if cache is not None:
            cache.state = state
            cache.offset += S
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))

    def _decode_step(self, qkv, z, b, a, cache: LinearAttentionCache) -> mx.array | None:
        """Everything between the projections for one token as one node of the CPU extension
        (updates the cache), or None: the caller then runs the ops below."""
        if cache.conv_state is None:
            return None
        fast = ops.linear_attn_step(
            qkv, z, b, a, cache.conv_state, self.conv1d.weight, self.A_log, self.dt_bias,
            self.norm.weight, cache.state, Hk=self.num_k_heads, Dk=self.head_k_dim,
            Hv=self.num_v_heads, Dv=self.head_v_dim, eps=self.norm.eps)
        if fast is None:
            return None
        out, cache.conv_state, cache.state = fast
        cache.offset += 1
        return out


class Attention(nn.Module):
    """Gated full attention: q/k RMSNorm, partial rotary RoPE, GQA, sigmoid output gate."""

    FUSED = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        h, bias = args.hidden_size, args.attention_bias
        self.q_proj = Linear(h, self.n_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope_dims = int(self.head_dim * args.partial_rotary_factor)
        self.rope_base = args.rope_theta

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(q, gate, k, v) of `x` [B, L, hidden]: q, k, v normed and [B, heads, L, dim], the
        output gate [B, L, heads, dim] (also read by the verify pass, models/verify.py)."""
        B, L, _ = x.shape
        q, k, v = project(self, x, *self.FUSED)
        q, gate = mx.split(q.reshape(B, L, self.n_heads, -1), 2, axis=-1)
        k = k.reshape(B, L, self.n_kv_heads, -1)
        v = v.reshape(B, L, self.n_kv_heads, -1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k).transpose(0, 2, 1, 3)
        return q, gate, k, v.transpose(0, 2, 1, 3)

    def decode_rows(self, q, gate, k, v, caches: list) -> mx.array | None:
        """One decode token of each row b of `heads`' q, gate, k, v against its own KVCache
        `caches[b]` (a batched step; one row is a plain step) in one node of the CPU extension
        (ops.decode_attention): [B, 1, Hq * D] before o_proj, the caches advanced. None where
        the node does not run (another device, dtype or cache): the caller runs the ops."""
        kv = getattr(caches[0], "dtype", None) or mx.float32  # one cache dtype for all rows
        if not ops.decode_attention_runs(q, k, v, gate) or not all(
                type(c) is KVCache and (c.dtype or mx.float32) == kv and (c.keys is None or (
                    c.keys.dtype == kv and c.keys.shape[0] == 1)) for c in caches):
            return None
        for c in caches:
            c.reserve(1, k.shape[1], k.shape[3], v.shape[3], kv)
        outs = ops.decode_attention(q, k, v, gate, [c.keys for c in caches],
                                    [c.values for c in caches], [c.offset for c in caches],
                                    self.rope_dims, self.rope_base, self.scale)
        if outs is None:
            return None
        for b, c in enumerate(caches):
            c.keys, c.values = outs[1 + 2 * b], outs[2 + 2 * b]
            c.offset += 1
        B, _, H, D = outs[0].shape
        return outs[0].reshape(B, 1, H * D)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q, gate, k, v = self.heads(x)
        if L == 1 and B == 1 and cache is not None:  # a decode step: one node on the CPU
            out = self.decode_rows(q, gate, k, v, [cache])
            if out is not None:
                return self.o_proj(out)
        offset = cache.offset if cache is not None else 0
        q = ops.rope(q, self.rope_dims, self.rope_base, offset)
        k = ops.rope(k, self.rope_dims, self.rope_base, offset)
        if cache is not None:
            k, v = attend_as(*cache.update_and_fetch(k, v), q.dtype)  # a half cache: float32
        mask = "causal" if L > 1 else None
        return self.o_proj(ops.gated_attention(q, k, v, gate, self.scale, mask))


class MLP(nn.Module):
    FUSED = ("gate_up_proj", ("gate_proj", "up_proj"))

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = Linear(dims, hidden_dims, bias=False)
        self.up_proj = Linear(dims, hidden_dims, bias=False)
        self.down_proj = Linear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = project(self, x, *self.FUSED)
        return self.down_proj(nn.silu(gate) * up)


class SparseMoeBlock(ExpertParallelMixin, nn.Module):
    """Softmax router, top-k routed experts, plus a shared expert behind a sigmoid gate.

    `observer`, when set, is called with (x, expert_indices, gate_scores, expert_outputs) so
    calibration (expert pruning) can measure each expert's routing and contribution. After
    `shard_experts` (models/parallel.py) it computes this rank's experts only.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(h, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(h, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(h, args.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(h, 1, bias=False)
        self.observer = None

    # The block runs as one node of the CPU extension (decode, batches, prefill: its matmuls
    # group the tokens by expert, so each routed expert's weights are unpacked once per node);
    # longer inputs go through it in slices of this many tokens (its buffers grow with them).
    FUSED_MAX_TOKENS = 1024

    def __call__(self, x: mx.array) -> mx.array:
        if self.ep is not None:
            return self.expert_parallel_call(x)
        if self.observer is None:
            mats = self._quantized_mats()
            out = self._fused(x, mats) if mats else None
            if out is not None:
                return out
        inds, scores = ops.moe_route(self.gate(x), self.top_k, self.norm_topk_prob)
        experts = self.switch_mlp(x, inds)
        if self.observer is not None:
            self.observer(x, inds, scores, experts)
        return combine_experts(experts, scores, self.shared_expert_gate(x), self.shared_expert(x))

    def _fused(self, x: mx.array, mats: list) -> mx.array | None:
        """The block as extension nodes, FUSED_MAX_TOKENS tokens at a time, or None."""
        n = self.FUSED_MAX_TOKENS
        if x.size <= n * x.shape[-1]:
            return ops.moe_block(x, mats, self.top_k, self.norm_topk_prob)
        flat = x.reshape(-1, x.shape[-1])
        parts = []
        for i in range(0, flat.shape[0], n):
            out = ops.moe_block(flat[i:i + n], mats, self.top_k, self.norm_topk_prob)
            if out is None:
                return None
            parts.append(out)
        return mx.concatenate(parts, axis=0).reshape(x.shape)

    def _quantized_mats(self) -> list | None:
        """(weight, scales, biases, bits, group_size) of every matrix in the order of
        `ops.moe_block`, or None unless all are quantized without an additive bias."""
        se, sw = self.shared_expert, self.switch_mlp
        shared = ([se.gate_up_proj] if "gate_up_proj" in se else [se.gate_proj, se.up_proj])
        layers = [self.gate, self.shared_expert_gate, *shared, se.down_proj,
                  sw.gate_proj, sw.up_proj, sw.down_proj]
        if any("scales" not in m or m.get("biases") is None or "bias" in m for m in layers):
            return None
        return [(m["weight"], m["scales"], m["biases"], m.bits, m.group_size) for m in layers]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = SparseMoeBlock(args)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, t) for t in args.layer_types]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list | None = None, *,
                 eval_layers: bool = False) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
            if eval_layers:  # see Model.prefill
                mx.eval(h, c.arrays if c is not None else [])
        return self.norm(h)


class LanguageModel(PipelineMixin, nn.Module):
    """After `pipeline` (models/parallel.py) its forward runs this rank's layers only."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list | None = None,
                 return_hidden: bool = False) -> mx.array | tuple[mx.array, mx.array]:
        if self.pipe is not None:
            if return_hidden:
                raise PocketError("the trunk's hidden states are not kept in a pipelined run")
            return self.pipeline_call(inputs, cache)
        with kernels.pinned():  # ~570 reads of the environment a token otherwise
            h = self.model(inputs, cache)
            logits = self.logits(h)
        return (logits, h) if return_hidden else logits

    def logits(self, h: mx.array) -> mx.array:
        """The vocabulary logits of post-norm hidden states (the trunk's or the MTP head's)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)


class MTP(nn.Module):
    """Qwen3.5's multi-token-prediction head (`mtp.*`; vLLM's Qwen3_5MultiTokenPredictor):
    from the trunk's post-norm hidden at position t and the embedding of token t+1, the hidden
    that predicts token t+2. fc(concat[pre_fc_norm_embedding(embed), pre_fc_norm_hidden(h)])
    (embedding first, as vLLM concatenates), one decoder layer that is always gated full
    attention with its own MoE block (and its own KV cache), then `norm`. embed_tokens and
    lm_head are the trunk's."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, "full_attention")
                       for _ in range(args.mtp_num_hidden_layers)]
        self.norm = RMSNorm(h, eps=args.rms_norm_eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache: list | None = None,
                 step: int = 0) -> mx.array:
        """hidden, embeds [B, T, H] -> post-norm hidden [B, T, H]. `step`: the draft depth
        (vLLM's spec_step_idx), which picks the layer when there are several."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeds),
                            self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        i = step % len(self.layers)
        x = self.layers[i](x, cache[i] if cache is not None else None)
        return self.norm(x)


# transformers names -> ours, applied to keys after the language-model prefix is normalised.
_NORM_SUFFIXES = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
    ".q_norm.weight", ".k_norm.weight",
    "mtp.norm.weight", ".pre_fc_norm_embedding.weight", ".pre_fc_norm_hidden.weight",
)
_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = LanguageModel(args)
        # None (a plain attribute, no parameters) when the checkpoint has no head.
        self.mtp = MTP(args) if args.mtp_num_hidden_layers > 0 else None

    def __call__(self, inputs: mx.array, cache: list | None = None,
                 return_hidden: bool = False) -> mx.array | tuple[mx.array, mx.array]:
        """Logits [B, T, V]; with `return_hidden`, (logits, the trunk's post-norm hidden
        [B, T, H]): what the MTP head takes (`mtp_logits`)."""
        return self.language_model(inputs, cache, return_hidden)

    def mtp_logits(self, hidden: mx.array, next_tokens: mx.array, cache: list | None = None,
                   step: int = 0) -> tuple[mx.array, mx.array]:
        """The MTP head's (logits [B, T, V], hidden [B, T, H]) for position t+2 from the
        hidden at t ([B, T, H]: the trunk's post-norm hidden, or the head's own output when
        drafting deeper) and token t+1 ([B, T] ids). `cache`: `make_mtp_cache()`, advanced by
        T positions (fill it over the prompt, as the trunk's)."""
        if self.mtp is None:
            raise PocketError("this model has no multi-token-prediction head")
        embeds = self.language_model.model.embed_tokens(next_tokens)
        h = self.mtp(hidden, embeds, cache, step)
        return self.language_model.logits(h), h

    def make_mtp_cache(self) -> list:
        """One KV cache per MTP layer (the head's attention has its own)."""
        if self.mtp is None:
            raise PocketError("this model has no multi-token-prediction head")
        return [KVCache() for _ in self.mtp.layers]

    def prefill(self, inputs: mx.array, cache: list) -> None:
        """Feed a prompt chunk into `cache`, evaluated, computing no logits: one layer at a
        time. Why: evaluated as one graph, a chunk's 40 layers hold their scratch together
        (measured on the 35B shape, a 512-token chunk on the CPU: peak 0.79 GiB of MLX
        arrays, 0.9 GiB of RSS, over what was resident before it) where one layer at a time
        holds 0.2 GiB (0.29 GiB RSS), and that peak is what a long prompt adds to `serve`'s
        memory beside its cache (issue 28). One sync per layer is nothing beside a chunk's
        matmuls. A pipeline rank runs its layers as usual (its sends are part of the graph)."""
        lm = self.language_model
        if lm.pipe is not None:
            lm(inputs, cache)
        else:
            lm.model(inputs, cache, eval_layers=True)
        mx.eval([a for c in cache for a in c.arrays])

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.language_model.model.layers

    def fuse_projections(self, evaluate: bool = True) -> int:
        """Run each group of projections that read the same input (see the FUSED of
        GatedDeltaNet, Attention and MLP) as one matmul; groups whose parts differ in format
        (mixed bits, say) stay separate. Inference only: it renames those parameters, so nothing
        that saves or converts weights may see a fused model (`fusion.unfused_parameters` gives
        the checkpoint's names back). With `evaluate`, each layer's fused arrays are computed
        before the next layer is fused, so the originals are freed as it goes (peak memory: one
        layer's projections more). Returns the number of groups fused."""
        count = 0
        for layer in [*self.layers, *(self.mtp.layers if self.mtp is not None else [])]:
            mixer = layer.linear_attn if layer.is_linear else layer.self_attn
            fused = [f for m in (mixer, layer.mlp.shared_expert) if (f := fuse(m, *m.FUSED))]
            if evaluate:
                mx.eval([f.parameters() for f in fused])
            count += len(fused)
        return count

    def pipeline(self, group: mx.distributed.Group, ranges: list[tuple[int, int]]) -> None:
        """Keep only this rank's layers, `ranges[group.rank()]` (engine/distributed/ decides
        them; see models/parallel.py): before anything is evaluated, so the rest is never read.
        The MTP head is dropped: distributed runs do not draft."""
        self.drop_mtp()
        self.language_model.pipeline(group, ranges)

    def shard_experts(self, group: mx.distributed.Group, loaded: bool = False) -> None:
        """Keep this rank's even block of every layer's routed experts (`loaded`: the weights
        are a per-rank shard holding that block already); rank i mod N computes layer i's
        shared expert. See models/parallel.py. The MTP head is dropped (no drafting)."""
        self.drop_mtp()
        rank, size = group.rank(), group.size()
        lo, hi = split_evenly(self.args.num_experts, size, rank)
        for i, layer in enumerate(self.layers):
            layer.mlp.shard_experts(group, lo, hi, shared=i % size == rank, loaded=loaded)

    # What the full-attention layers' KV caches store (`set_cache_type`): None, the activations'
    # dtype (float32 on the CPU, exact), or float16 / bfloat16 (opt-in: half the bytes).
    kv_cache_dtype: mx.Dtype | None = None
    kv_cache_type = "f32"

    def set_cache_type(self, name: str) -> None:
        """`--cache-type-k/--cache-type-v` (llama.cpp's names): "f32" (the activations' dtype),
        "f16" or "bf16", for the caches made from now on."""
        if name not in CACHE_TYPES:
            raise PocketError(f"unknown KV cache type {name!r}: use {', '.join(CACHE_TYPES)}")
        object.__setattr__(self, "kv_cache_type", name)
        object.__setattr__(self, "kv_cache_dtype", CACHE_TYPES[name])
        object.__setattr__(self, "_cache_dtypes", None)  # loader.cache_dtypes traces again

    def make_cache(self) -> list:
        # models/cache.KVCache mirrors mlx-lm's (preallocating, trimmable: the chat app rewinds
        # to the end of the last prompt) without importing mlx_lm, which imports transformers.
        return [LinearAttentionCache() if l.is_linear else KVCache(self.kv_cache_dtype)
                for l in self.layers]

    @staticmethod
    def is_transformers_layout(weights: dict[str, mx.array]) -> bool:
        """transformers stores conv1d as [C, 1, K]; MLX as [C, K, 1]."""
        return any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map any supported checkpoint layout onto this module tree's names and conventions."""
        hf = self.is_transformers_layout(weights)
        out: dict[str, mx.array] = {}
        experts: dict[tuple[str, str], dict[int, mx.array]] = {}
        keep_mtp = self.mtp is not None
        for key, value in weights.items():
            if key.startswith(("model.visual", "visual.", "vision_tower")):
                continue
            if key.startswith(("mtp.", "model.mtp.")):
                if not keep_mtp:  # a head the config does not declare is dropped, as before
                    continue
                key = key.removeprefix("model.")
            elif key.startswith("model.language_model."):
                key = "language_model.model." + key[len("model.language_model."):]
            elif key.startswith("language_model."):
                pass
            else:
                key = "language_model." + key
            m = _PER_EXPERT.match(key)
            if m:
                experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
                continue
            if key.endswith(".mlp.experts.gate_up_proj"):
                prefix = key[: -len(".experts.gate_up_proj")]
                mid = value.shape[-2] // 2
                out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
                out[f"{prefix}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
                continue
            if key.endswith(".mlp.experts.down_proj"):
                out[key[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = value
                continue
            if key.endswith("conv1d.weight") and value.shape[-1] != 1:
                value = value.moveaxis(2, 1)
            if hf and key.endswith(_NORM_SUFFIXES) and value.ndim == 1:
                value = value.astype(mx.float32) + 1.0
            out[key] = value
        for (prefix, proj), by_index in experts.items():
            n = self.args.num_experts
            missing = [e for e in range(n) if e not in by_index]
            if missing:
                raise PocketError(
                    f"missing tensor: {prefix}.experts.{missing[0]}.{proj}.weight "
                    f"({len(missing)} expert(s) of {n} absent)"
                )
            if len(by_index) > n:
                extra = sorted(set(by_index) - set(range(n)))[0]
                raise PocketError(f"unexpected tensor: {prefix}.experts.{extra}.{proj}.weight "
                                  f"(config has {n} experts)")
            out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([by_index[e] for e in range(n)])
        if self.args.tie_word_embeddings:
            out.pop("language_model.lm_head.weight", None)
        if keep_mtp and not any(k.startswith("mtp.") for k in out):
            self.drop_mtp()  # declared but not stored (stock mlx-lm conversions drop it)
        return out

    def drop_mtp(self) -> None:
        """Forget the MTP head: Qwen3.5 configs declare `mtp_num_hidden_layers: 1`, but a
        checkpoint converted by stock mlx-lm (or transformers) holds none of its tensors."""
        self.mtp = None
        self.args.mtp_num_hidden_layers = 0
