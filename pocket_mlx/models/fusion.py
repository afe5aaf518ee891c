"""Projections that read the same input, run as one matmul (an inference-time step).

On the CPU every quantized matmul is a graph node with a fixed cost (~15-25 us) whatever its
size, and decoding one token runs a few of them per layer on the same activation: GatedDeltaNet's
four input projections, attention's q/k/v, the shared expert's gate/up. Fusing stacks such
layers' arrays along the output axis into one ordinary `QuantizedLinear` (or `Linear`) and splits
its output back at static indices: one matmul node (plus a view-only split) instead of two to four.

Fusion renames parameters (`in_proj_qkv`, ... become `in_proj`), so only inference loads do it
(`load(..., fuse=True)`); conversion, calibration and pruning keep the checkpoint's layout, and
`unfused_parameters` gives a fused model's arrays back under the checkpoint's names (as views).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from pocket_mlx.models.layers import Linear, QuantizedLinear


def _format(layer: nn.Module) -> tuple:
    """What must match for layers to be stacked: kind, quantization, and every array's dtype and
    shape past the output axis (input size, groups, scale dtype, whether a bias exists)."""
    quant = (layer.bits, layer.group_size, layer.mode) if isinstance(layer, QuantizedLinear) else None
    arrays = tuple(sorted((k, v.dtype, tuple(v.shape[1:])) for k, v in layer.items()
                          if isinstance(v, mx.array)))
    return type(layer), quant, arrays


def fuse_linears(layers: Sequence[nn.Module]) -> nn.Module | None:
    """One layer whose output is the `layers`' outputs side by side, or None when they do not
    share a format (different bits, group size, dtypes, ...): those stay separate layers."""
    first = layers[0]
    if type(first) not in (Linear, QuantizedLinear):
        return None
    if any(_format(layer) != _format(first) for layer in layers[1:]):
        return None
    arrays = {k: mx.concatenate([layer[k] for layer in layers], axis=0)
              for k, v in first.items() if isinstance(v, mx.array)}
    out_dims = arrays["weight"].shape[0]
    has_bias = "bias" in first
    if isinstance(first, QuantizedLinear):
        in_dims = first.weight.shape[1] * 32 // first.bits
        fused = QuantizedLinear(in_dims, out_dims, has_bias, first.group_size, first.bits,
                                first.mode)
    else:
        fused = Linear(first.weight.shape[1], out_dims, bias=has_bias)
    # The constructors' random arrays are lazy and never evaluated: replaced here.
    fused.update(arrays)
    fused.train(first.training)
    return fused


def fuse(owner: nn.Module, name: str, parts: Sequence[str]) -> nn.Module | None:
    """Replace `owner`'s layers `parts` by one fused layer `name` (None, and nothing changed,
    when they cannot be fused). The parts are dropped, so once the fused arrays are evaluated
    the originals are freed: memory holds one copy."""
    layers = [owner[p] for p in parts]
    fused = fuse_linears(layers)
    if fused is None:
        return None
    rows = [layer.weight.shape[0] for layer in layers]
    # Plain attributes, not module entries: they must stay out of parameters() and update().
    object.__setattr__(fused, "fused_parts", tuple(zip(parts, rows)))
    object.__setattr__(fused, "split_at", list(accumulate(rows))[:-1])
    for p in parts:
        delattr(owner, p)
    setattr(owner, name, fused)
    return fused


def project(owner: nn.Module, x: mx.array, name: str, parts: Sequence[str]) -> list[mx.array]:
    """The outputs of `owner`'s layers `parts` on `x`: one matmul when they were fused into
    `name`, else one per layer."""
    fused = owner.get(name)
    if fused is None:
        return [owner[p](x) for p in parts]
    return mx.split(fused(x), fused.split_at, axis=-1)


def unfused_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    """`tree_flatten(model.parameters())` under the checkpoint's names: every fused layer's
    arrays are given back as its parts' row slices (views of the fused arrays, no copy)."""
    fused = {path: m for path, m in model.named_modules() if hasattr(m, "fused_parts")}
    out = []
    for key, value in tree_flatten(model.parameters()):
        path, leaf = key.rsplit(".", 1)
        layer = fused.get(path)
        if layer is None:
            out.append((key, value))
            continue
        owner = path.rsplit(".", 1)[0]
        start = 0
        for part, rows in layer.fused_parts:
            out.append((f"{owner}.{part}.{leaf}", value[start:start + rows]))
            start += rows
    return out
