"""Activation-aware rounding for low bits (`convert --rounding gptq|awq`).

Round-to-nearest (rtn, MLX's `mx.quantize`) minimises the error of each weight. What matters is
the error of each module's *output* on real inputs: with the inputs' second moment
H = sum x x^T, GPTQ (arXiv 2210.17323) rounds one input column at a time and moves the
rounding error onto the columns not yet rounded, where H says it can be absorbed; AWQ's clip
search (arXiv 2306.00978) shrinks each group's range when that lowers the output error on
sampled inputs. Inputs come from the float model on the calibration text, one layer at a
time (convert/layerwise.py); routed experts see only the tokens routed to them, so each expert
gets its own H / samples, made when that expert is rounded.

What is reused from mlx-lm 0.32 (`mlx_lm.quant`) and why not more:
- AWQ: `mlx_lm.quant.awq.search_best_clip` is used as is, per matrix (for experts, per expert
  with its own routed inputs). mlx-lm's scale search (`search_best_scale`/`apply_scale`) folds
  per-channel scales into the previous norm or projection; for Qwen3.5-MoE that needs a model
  config it does not have, and a folded scale on the MoE input must be shared by the router,
  the shared expert and every expert: not done here.
- GPTQ: mlx-lm's `gptq_quantize` is a whole-model driver (wraps mlx-lm's own Linear and
  SwitchLinear types, one bit width for all, one H shared by all experts of a SwitchLinear) and
  its packer takes only 2, 4 and 8 bits. Ours below is the same algorithm per matrix (each
  expert with its own H, a block of rows at a time), packs every MLX width (1-8), and rounds the scales and
  biases to the output dtype before choosing the codes, so the stored values are the ones the
  error feedback assumed. tests/test_rounding.py checks it against mlx-lm's at 2 and 4 bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pocket_mlx.errors import PocketError

METHODS = ("rtn", "gptq", "awq")
MAX_BITS = 3  # the auto recipes use activation-aware rounding at this width and below
FIT_BITS = 3  # GPTQ refits scales and biases (fit_levels) at this width and below
# GPTQ's damping, a fraction of the mean diagonal of H. mlx-lm and AutoGPTQ use 0.01; on the
# reference model 0.1 gave lower error on held-out text for every module tried.
DAMP = 0.1
# GPTQ's error feedback needs H to be well estimated: with fewer input rows than this many times
# the input width (a routed expert sees ~k/E of the tokens), it fits the calibration text and
# loses on held-out text (reference model, 2-bit experts: 1.38x RTN's error with feedback, 0.77x
# with fitted levels alone). Such matrices get the fitted levels without feedback (H = I).
MIN_ROWS_PER_INPUT = 4
# Working memory of one block: float64 rows being rounded, or pack's bit stream. A 35B layer's
# 256 experts (or the 248320-row lm_head) go through in blocks of this size, not all at once
# (which took E x 2048^2 x 8 B = 4 GB and more per matrix).
BLOCK_BYTES = 64 << 20
# Sampled input rows per matrix (per expert for experts) for AWQ's clip search.
AWQ_ROWS = 512


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes [..., K] (0 <= c < 2**bits) as MLX's affine weights [..., K*bits/32]
    uint32: each row one little-endian bit stream (3, 5, 6 bits straddle words). Rows go
    through in blocks: the bit stream takes 8 x bits bytes a code (a 35B layer's experts at
    once would take 4 GB)."""
    k = codes.shape[-1]
    if (k * bits) % 32:
        raise ValueError(f"a row of {k} {bits}-bit codes does not fill whole words")
    flat = codes.reshape(-1, k)
    out = np.empty((len(flat), k * bits // 32), np.uint32)
    step = max(1, BLOCK_BYTES // (8 * bits * k))
    for r in range(0, len(flat), step):
        c = flat[r:r + step].astype(np.uint32)
        if 32 % bits == 0:  # whole codes per word: code j of a word at bit j * bits
            per = 32 // bits
            c = c.reshape(len(c), k // per, per) << (np.arange(per, dtype=np.uint32) * bits)
            out[r:r + step] = c.sum(-1, dtype=np.uint32)  # disjoint bits: the sum is the OR
            continue
        stream = (c[..., None] >> np.arange(bits, dtype=np.uint32)) & 1  # [n, K, bits]
        stream = stream.reshape(len(c), k * bits // 32, 32).astype(np.uint64)
        out[r:r + step] = (stream << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return out.reshape(*codes.shape[:-1], k * bits // 32)


def _scales_biases(w: mx.array, bits: int, group_size: int, dtype: mx.Dtype
                   ) -> tuple[np.ndarray, np.ndarray]:
    """MLX's own scale and bias per group (min/max), rounded to the stored dtype."""
    _, s, b = mx.quantize(w, group_size, bits)
    return (np.array(s.astype(dtype).astype(mx.float32)),
            np.array(b.astype(dtype).astype(mx.float32)))


def fit_levels(w: np.ndarray, bits: int, dtype: mx.Dtype, iters: int = 4
               ) -> tuple[np.ndarray, np.ndarray]:
    """Scale and bias per row of w [..., G] (one group each) by a few Lloyd steps from MLX's
    min/max start: round to the levels, then refit scale and bias by least squares on the
    codes. Min/max puts the outermost levels on the extreme weights, which at 1 and 2 bits
    wastes most of the range; the least-squares levels sit where the weights are."""
    s, b = _scales_biases(mx.array(w.astype(np.float32)), bits, w.shape[-1], dtype)
    wm = w.mean(-1, keepdims=True)
    wc = w - wm
    for _ in range(iters):
        q = _codes(w, s, b, bits)
        qm = q.mean(-1, keepdims=True)
        q -= qm
        var = (q * q).sum(-1, keepdims=True)
        cov = (q * wc).sum(-1, keepdims=True)
        ok = var > 0
        s_new = np.where(ok, cov / np.where(ok, var, 1), s)
        ok &= np.abs(s_new) > 1e-12
        s = np.where(ok, s_new, s)
        b = np.where(ok, wm - s * qm, b)
        s = np.array(mx.array(s.astype(np.float32)).astype(dtype).astype(mx.float32))
        b = np.array(mx.array(b.astype(np.float32)).astype(dtype).astype(mx.float32))
    return s, b


def _codes(w: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    c = w - b  # in place from here: this runs over every weight, several times
    c /= s
    np.round(c, out=c)
    return np.clip(c, 0, 2**bits - 1, out=c)


def inverse_hessian_factor(H: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """Upper Cholesky factor of (H + damp I)^-1, batched over leading axes (as mlx-lm's
    `compute_inverse_hessian`); dead inputs (zero diagonal) get a unit diagonal first."""
    H = H.astype(np.float64).copy()
    diag = np.einsum("...ii->...i", H)
    dead = diag == 0
    diag[dead] = 1.0  # a column no input ever reached: its error costs nothing, any rounding
    diag += damp * diag.mean(-1, keepdims=True)
    Hinv = np.linalg.inv(H)
    Hinv = (Hinv + np.swapaxes(Hinv, -1, -2)) / 2
    return np.swapaxes(np.linalg.cholesky(Hinv), -1, -2)


def _round_rows(W: np.ndarray, U: np.ndarray | None, bits: int, group_size: int,
                dtype: mx.Dtype, fit: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ of the rows W [n, K] (float64, changed in place): (codes uint8, scales, biases
    float32). U: upper Cholesky factor of H's damped inverse; None when H is a multiple of I
    (U diagonal: no error moves to other columns, so each group's levels and round to nearest
    give the very codes the column loop would)."""
    n, K = W.shape
    if U is None:  # all groups at once: each group's levels, then round to nearest
        Wg = W.reshape(n, K // group_size, group_size)
        if fit:
            s, b = fit_levels(Wg, bits, dtype)
        else:
            s, b = _scales_biases(mx.array(Wg.astype(np.float32)), bits, group_size, dtype)
        codes = _codes(Wg, s, b, bits).astype(np.uint8).reshape(n, K)
        return codes, s[..., 0], b[..., 0]
    codes = np.empty((n, K), np.uint8)
    scales, biases = [], []
    for i in range(0, K, group_size):
        j = i + group_size
        if fit:
            s, b = fit_levels(W[:, i:j], bits, dtype)
        else:
            s, b = _scales_biases(mx.array(W[:, i:j].astype(np.float32)), bits, group_size,
                                  dtype)
        scales.append(s)
        biases.append(b)
        err = np.zeros_like(W[:, i:j])
        for k in range(i, j):
            col = W[:, k:k + 1]
            q = _codes(col, s, b, bits)
            codes[:, k:k + 1] = q
            e = (col - (s * q + b)) / U[k, k]
            W[:, k:j] -= e @ U[k:k + 1, k:j]
            err[:, k - i:k - i + 1] = e
        W[:, j:] -= err @ U[i:j, j:]
    return codes, np.concatenate(scales, -1), np.concatenate(biases, -1)


def _gptq_np(w, H: np.ndarray | None, bits: int, group_size: int, dtype: mx.Dtype, fit: bool,
             damp: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`gptq` in numpy (packed codes, float32 scales and biases), BLOCK_BYTES of float64 rows
    at a time. w: [..., N, K] numpy, or an mx.array read a block at a time."""
    *lead, N, K = w.shape
    E = int(np.prod(lead, dtype=np.int64))
    q = np.empty((E, N, K * bits // 32), np.uint32)
    s = np.empty((E, N, K // group_size), np.float32)
    b = np.empty_like(s)
    w3 = w.reshape(E, N, K)
    rows = max(1, BLOCK_BYTES // (8 * K))
    if H is None:  # no feedback: rows are independent, so all matrices' rows go together
        flat = w3.reshape(E * N, K)
        qf, sf, bf = q.reshape(E * N, -1), s.reshape(E * N, -1), b.reshape(E * N, -1)
        for r in range(0, E * N, rows):
            c, sf[r:r + rows], bf[r:r + rows] = _round_rows(
                _float64(flat[r:r + rows]), None, bits, group_size, dtype, fit)
            qf[r:r + rows] = pack(c, bits)
    else:
        H3 = H.reshape(E, K, K)
        for e in range(E):
            U = inverse_hessian_factor(H3[e], damp)
            for r in range(0, N, rows):
                c, s[e, r:r + rows], b[e, r:r + rows] = _round_rows(
                    _float64(w3[e, r:r + rows]), U, bits, group_size, dtype, fit)
                q[e, r:r + rows] = pack(c, bits)
    return (q.reshape(*lead, N, -1), s.reshape(*lead, N, -1), b.reshape(*lead, N, -1))


def _float64(w) -> np.ndarray:
    """A float64 copy of a block of weights (numpy or mx, any float dtype)."""
    if isinstance(w, mx.array):
        w = np.array(w.astype(mx.float32))
    return w.astype(np.float64)


def gptq(w: np.ndarray, H: np.ndarray | None, bits: int, group_size: int,
         dtype: mx.Dtype = mx.float32, fit: bool | None = None, damp: float = DAMP
         ) -> tuple[mx.array, mx.array, mx.array]:
    """GPTQ of w [..., N, K] with input moments H [..., K, K] (leading axes: experts; None:
    H a multiple of I, levels alone): MLX affine (weight, scales, biases), scales and biases
    in `dtype`. `fit`: least-squares levels per group (fit_levels; default at FIT_BITS and
    below) instead of MLX's min/max (which mlx-lm's GPTQ uses: at 1 bit it loses to plain
    rounding, fitted it wins by 10x). Each matrix, and each block of its rows, is rounded on
    its own (GPTQ treats rows independently), so the working memory is one H's factor and a
    block of rows, whatever the number of experts or rows."""
    fit = bits <= FIT_BITS if fit is None else fit
    q, s, b = _gptq_np(w, H, bits, group_size, dtype, fit, damp)
    return mx.array(q), mx.array(s).astype(dtype), mx.array(b).astype(dtype)


def awq_clip(w: mx.array, x: mx.array, bits: int, group_size: int, dtype: mx.Dtype
             ) -> tuple[mx.array, mx.array, mx.array]:
    """AWQ's clip search for one matrix w [N, K] on inputs x [R, K], then MLX's rounding."""
    # Lazy: mlx_lm imports transformers (seconds), needed only for this option.
    from mlx_lm.quant.awq import search_best_clip

    def qdq(v: mx.array) -> mx.array:
        return mx.dequantize(*mx.quantize(v, group_size, bits), group_size, bits)

    holder = nn.Module()
    holder.weight = w.astype(mx.float32)
    holder.input_feat = x.astype(mx.float32)[None]
    best = search_best_clip(holder, qdq, group_size, n_grid=20)
    q, s, b = mx.quantize(best.astype(dtype), group_size, bits)
    return q, s, b


@dataclass
class Inputs:
    """What one quantizable matrix saw on the calibration text: H = sum x x^T and up to
    AWQ_ROWS sampled rows (for AWQ); for routed experts one of each per expert, or, from a
    streamed capture (convert/layerwise.py), `expert_rows`: expert e's input rows, from which
    its H or sample is made when that expert is rounded (E x K^2 x 8 B of H's at once is
    8.6 GB for a 35B layer)."""

    H: np.ndarray | None  # [K, K] or [E, K, K]; None: built per expert from expert_rows
    rows: list[np.ndarray] = field(default_factory=list)  # [R, K], one per expert for experts
    count: np.ndarray | None = None  # input rows seen (per expert for experts); None: plenty
    expert_rows: Callable[[int], np.ndarray] | None = None

    def expert_H(self, e: int) -> np.ndarray:
        if self.H is not None:
            return self.H[e]
        x = self.expert_rows(e)
        return x.T @ x

    def expert_sample(self, e: int) -> np.ndarray | None:
        if e < len(self.rows):
            return self.rows[e]
        return None if self.expert_rows is None else sample_rows(self.expert_rows(e), AWQ_ROWS)


def _few(inputs: Inputs, width: int) -> np.ndarray:
    """Whether each matrix (expert) saw too few rows for GPTQ's error feedback."""
    if inputs.count is None:
        return np.zeros((), bool)
    return np.asarray(inputs.count) < MIN_ROWS_PER_INPUT * width


def quantize_matrix(w: mx.array, bits: int, group_size: int, method: str,
                    inputs: Inputs | None) -> tuple[mx.array, mx.array, mx.array]:
    """(weight, scales, biases) of w ([N, K], or [E, N, K] experts) by `method`; rtn when
    there are no inputs to be aware of. Scales and biases in w's dtype, as mx.quantize."""
    if method == "rtn" or inputs is None:
        return mx.quantize(w, group_size, bits)
    if method not in METHODS:
        raise PocketError(f"unknown rounding {method!r} (known: {', '.join(METHODS)})")
    dtype = w.dtype
    if method == "gptq":
        if w.ndim == 3:
            return _gptq_experts(w, bits, group_size, inputs)
        # Too few rows: H taken as a multiple of I (no error feedback, fitted levels alone).
        H = None if _few(inputs, w.shape[-1]).any() else inputs.H
        return gptq(w, H, bits, group_size, dtype)
    stacked = w.ndim == 3
    out = []
    for e in range(w.shape[0] if stacked else 1):
        m = w[e] if stacked else w
        x = inputs.expert_sample(e) if stacked else (inputs.rows[0] if inputs.rows else None)
        out.append(mx.quantize(m, group_size, bits) if x is None or len(x) == 0
                   else awq_clip(m, mx.array(x), bits, group_size, dtype))
        mx.eval(out[-1])
    if not stacked:
        return out[0]
    return tuple(mx.stack([o[i] for o in out]) for i in range(3))


def _gptq_experts(w: mx.array, bits: int, group_size: int, inputs: Inputs
                  ) -> tuple[mx.array, mx.array, mx.array]:
    """GPTQ of experts w [E, N, K]: those that saw too few rows (most of a many-expert layer)
    together, levels alone; each of the others with its own H, built when it is rounded."""
    E, N, K = w.shape
    few = np.broadcast_to(_few(inputs, K), (E,))
    fit = bits <= FIT_BITS
    q = np.empty((E, N, K * bits // 32), np.uint32)
    s = np.empty((E, N, K // group_size), np.float32)
    b = np.empty_like(s)
    plain = np.flatnonzero(few)
    per = max(1, BLOCK_BYTES // (8 * N * K))
    for c in range(0, len(plain), per):
        ids = plain[c:c + per]
        q[ids], s[ids], b[ids] = _gptq_np(w[mx.array(ids)], None, bits, group_size, w.dtype,
                                          fit, DAMP)
    for e in np.flatnonzero(~few):
        q[e], s[e], b[e] = _gptq_np(w[int(e)], inputs.expert_H(int(e)), bits, group_size,
                                    w.dtype, fit, DAMP)
    return mx.array(q), mx.array(s).astype(w.dtype), mx.array(b).astype(w.dtype)


def sample_rows(x: np.ndarray, max_rows: int) -> np.ndarray:
    if len(x) <= max_rows:
        return x
    return x[np.linspace(0, len(x) - 1, max_rows).round().astype(int)]


def select(inputs: Inputs, kept: list[int]) -> Inputs:
    """The inputs of the experts a pruning kept, in their new order."""
    ids = list(kept)
    rows = inputs.expert_rows
    return Inputs(None if inputs.H is None else inputs.H[ids],
                  [inputs.rows[e] for e in ids] if inputs.rows else [],
                  None if inputs.count is None else np.asarray(inputs.count)[ids],
                  None if rows is None else (lambda e: rows(ids[e])))
