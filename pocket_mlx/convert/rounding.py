"""Activation-aware rounding for low bits (`convert --rounding gptq|awq`).

Round-to-nearest (rtn, MLX's `mx.quantize`) minimises the error of each weight. What matters is
the error of each module's *output* on real inputs: with the inputs' second moment
H = sum x x^T, GPTQ (arXiv 2210.17323) rounds one input column at a time and moves the
rounding error onto the columns not yet rounded, where H says it can be absorbed; AWQ's clip
search (arXiv 2306.00978) shrinks each group's range when that lowers the output error on
sampled inputs. Inputs come from the float model on the calibration text (`capture`); routed
experts see only the tokens routed to them, so each expert gets its own H / samples.

What is reused from mlx-lm 0.32 (`mlx_lm.quant`) and why not more:
- AWQ: `mlx_lm.quant.awq.search_best_clip` is used as is, per matrix (for experts, per expert
  with its own routed inputs). mlx-lm's scale search (`search_best_scale`/`apply_scale`) folds
  per-channel scales into the previous norm or projection; for Qwen3.5-MoE that needs a model
  config it does not have, and a folded scale on the MoE input must be shared by the router,
  the shared expert and every expert: not done here.
- GPTQ: mlx-lm's `gptq_quantize` is a whole-model driver (wraps mlx-lm's own Linear and
  SwitchLinear types, one bit width for all, one H shared by all experts of a SwitchLinear) and
  its packer takes only 2, 4 and 8 bits. Ours below is the same algorithm per matrix (batched
  over experts, each with its own H), packs every MLX width (1-8), and rounds the scales and
  biases to the output dtype before choosing the codes, so the stored values are the ones the
  error feedback assumed. tests/test_rounding.py checks it against mlx-lm's at 2 and 4 bits.
"""

from __future__ import annotations

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


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes [..., K] (0 <= c < 2**bits) as MLX's affine weights [..., K*bits/32]
    uint32: each row one little-endian bit stream (3, 5, 6 bits straddle words)."""
    k = codes.shape[-1]
    if (k * bits) % 32:
        raise ValueError(f"a row of {k} {bits}-bit codes does not fill whole words")
    c = codes.astype(np.uint32)
    stream = (c[..., None] >> np.arange(bits, dtype=np.uint32)) & 1  # [..., K, bits]
    stream = stream.reshape(*codes.shape[:-1], k * bits // 32, 32).astype(np.uint64)
    return (stream << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


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
    for _ in range(iters):
        q = _codes(w, s, b, bits)
        qm, wm = q.mean(-1, keepdims=True), w.mean(-1, keepdims=True)
        var = ((q - qm) ** 2).sum(-1, keepdims=True)
        cov = ((q - qm) * (w - wm)).sum(-1, keepdims=True)
        ok = var > 0
        s_new = np.where(ok, cov / np.where(ok, var, 1), s)
        ok &= np.abs(s_new) > 1e-12
        s = np.where(ok, s_new, s)
        b = np.where(ok, wm - s * qm, b)
        s = np.array(mx.array(s.astype(np.float32)).astype(dtype).astype(mx.float32))
        b = np.array(mx.array(b.astype(np.float32)).astype(dtype).astype(mx.float32))
    return s, b


def _codes(w: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    return np.clip(np.round((w - b) / s), 0, 2**bits - 1)


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


def gptq(w: np.ndarray, H: np.ndarray, bits: int, group_size: int, dtype: mx.Dtype = mx.float32,
         fit: bool | None = None, damp: float = DAMP) -> tuple[mx.array, mx.array, mx.array]:
    """GPTQ of w [..., N, K] with input moments H [..., K, K] (leading axes: experts):
    MLX affine (weight, scales, biases), scales and biases in `dtype`. `fit`: least-squares
    levels per group (fit_levels; default at FIT_BITS and below) instead of MLX's min/max
    (which mlx-lm's GPTQ uses: at 1 bit it loses to plain rounding, fitted it wins by 10x)."""
    fit = bits <= FIT_BITS if fit is None else fit
    W = w.astype(np.float64).copy()
    U = inverse_hessian_factor(H, damp)
    K = W.shape[-1]
    scales, biases, codes = [], [], np.zeros(W.shape, np.float64)
    for i in range(0, K, group_size):
        j = i + group_size
        if fit:
            s, b = fit_levels(W[..., i:j], bits, dtype)
        else:
            s, b = _scales_biases(mx.array(W[..., i:j].astype(np.float32)), bits, group_size,
                                  dtype)
        scales.append(s)
        biases.append(b)
        err = np.zeros_like(W[..., i:j])
        for k in range(i, j):
            d = U[..., k, k][..., None, None]  # [..., 1, 1]
            col = W[..., k:k + 1]
            q = _codes(col, s, b, bits)
            codes[..., k:k + 1] = q
            e = (col - (s * q + b)) / d
            W[..., k:j] -= e @ U[..., k:k + 1, k:j]
            err[..., k - i:k - i + 1] = e
        W[..., j:] -= err @ U[..., i:j, j:]
    s = np.concatenate(scales, -1)
    b = np.concatenate(biases, -1)
    return (mx.array(pack(codes.astype(np.uint32), bits)), mx.array(s).astype(dtype),
            mx.array(b).astype(dtype))


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
    `max_rows` sampled rows (for AWQ); for routed experts one of each per expert."""

    H: np.ndarray  # [K, K] or [E, K, K]
    rows: list[np.ndarray] = field(default_factory=list)  # [R, K], one per expert for experts
    count: np.ndarray | None = None  # input rows seen (per expert for experts); None: plenty


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
        H = inputs.H
        if inputs.count is not None:
            few = np.asarray(inputs.count) < MIN_ROWS_PER_INPUT * H.shape[-1]
            if few.any():
                eye = np.eye(H.shape[-1]) * np.maximum(
                    np.einsum("...ii->...", H) / H.shape[-1], 1e-12)[..., None, None]
                H = np.where(few[..., None, None], eye, H)
        return gptq(np.array(w.astype(mx.float32)), H, bits, group_size, dtype)
    stacked = w.ndim == 3
    mats = [w[e] for e in range(w.shape[0])] if stacked else [w]
    out = []
    for e, m in enumerate(mats):
        x = inputs.rows[e] if e < len(inputs.rows) else None
        out.append(mx.quantize(m, group_size, bits) if x is None or len(x) == 0
                   else awq_clip(m, mx.array(x), bits, group_size, dtype))
    if not stacked:
        return out[0]
    return tuple(mx.stack([o[i] for o in out]) for i in range(3))


def _sample(x: np.ndarray, max_rows: int) -> np.ndarray:
    if len(x) <= max_rows:
        return x
    return x[np.linspace(0, len(x) - 1, max_rows).round().astype(int)]


class _Catcher(nn.Module):
    """Stands in for a Linear during capture: accumulates its inputs, then runs it."""

    def __init__(self, module: nn.Module, store: dict, path: str, max_rows: int):
        super().__init__()
        self.module = module
        self._store, self._path, self._max = store, path, max_rows

    def __call__(self, x: mx.array) -> mx.array:
        xf = np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32), np.float64)
        got = self._store.setdefault(self._path,
                                     Inputs(np.zeros((xf.shape[1],) * 2), [[]], np.array(0)))
        got.H += xf.T @ xf
        got.count = got.count + len(xf)
        got.rows[0].append(xf)
        return self.module(x)


def capture(model, chunks: list[list[int]], max_rows: int = 512) -> dict[str, Inputs]:
    """Run the float model on the calibration windows and record every quantizable matrix's
    inputs (routed experts: per expert, only its tokens). Loads nothing; small models only."""
    from mlx.utils import tree_unflatten

    store: dict[str, Inputs] = {}
    moe: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    layers = model.language_model.model.layers
    wrapped = []
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear) and ".switch_mlp." not in path:
            wrapped.append((path, _Catcher(m, store, path, max_rows)))
    originals = [(p, c.module) for p, c in wrapped]
    model.update_modules(tree_unflatten(wrapped))

    def observer(i: int):
        def observe(x, inds, scores, experts) -> None:
            moe.setdefault(i, []).append(
                (np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32), np.float64),
                 np.array(inds.reshape(-1, inds.shape[-1]))))
        return observe

    try:
        for i, layer in enumerate(layers):
            layer.mlp.observer = observer(i)
        for c in chunks:
            mx.eval(model(mx.array(c, mx.int32)[None]))
    finally:
        for layer in layers:
            layer.mlp.observer = None
        model.update_modules(tree_unflatten(originals))
    for got in store.values():
        got.rows = [_sample(np.concatenate(got.rows[0]), max_rows)]
    for i, parts in moe.items():
        x = np.concatenate([p[0] for p in parts])
        inds = np.concatenate([p[1] for p in parts])
        sw = layers[i].mlp.switch_mlp
        E = sw.gate_proj.weight.shape[0]
        prefix = f"language_model.model.layers.{i}.mlp.switch_mlp"
        wg = np.array(sw.gate_proj.weight.astype(mx.float32), np.float64)
        wu = np.array(sw.up_proj.weight.astype(mx.float32), np.float64)
        K, Ki = x.shape[1], wg.shape[1]
        hin, hmid = np.zeros((E, K, K)), np.zeros((E, Ki, Ki))
        rin, rmid, count = [], [], np.zeros(E, np.int64)
        for e in range(E):
            xe = x[(inds == e).any(-1)]
            count[e] = len(xe)
            g, u = xe @ wg[e].T, xe @ wu[e].T
            mid = g / (1 + np.exp(-g)) * u  # the SwiGLU that feeds down_proj
            hin[e], hmid[e] = xe.T @ xe, mid.T @ mid
            rin.append(_sample(xe, max_rows))
            rmid.append(_sample(mid, max_rows))
        store[f"{prefix}.gate_proj"] = store[f"{prefix}.up_proj"] = Inputs(hin, rin, count)
        store[f"{prefix}.down_proj"] = Inputs(hmid, rmid, count)
    return store


def select(inputs: Inputs, kept: list[int]) -> Inputs:
    """The inputs of the experts a pruning kept, in their new order."""
    return Inputs(inputs.H[kept], [inputs.rows[e] for e in kept],
                  None if inputs.count is None else inputs.count[kept])
