"""The CPU panel layout for a whole model (POCKET_MLX_PANELS=1): the quantized matrices the
CPU kernels read are packed once when the model is to run on the CPU, one matrix at a time so the
weights are never in memory twice, and unpacked into MLX arrays before another device runs it."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx import kernels
from pocket_mlx.models.layers import QuantizedLinear, QuantizedSwitchLinear


def _panel_modules(model: nn.Module):
    """Modules whose weights only the extension's matmuls read on the CPU: quantized linear
    layers and stacked experts (not embeddings, whose rows MLX dequantizes)."""
    for _, m in model.named_modules():
        if (isinstance(m, (QuantizedLinear, QuantizedSwitchLinear)) and "biases" in m
                and getattr(m, "mode", "affine") == "affine"):
            yield m


def pack_model(model: nn.Module) -> dict:
    """Packs every such matrix (bits the layout holds; the rest stay as they are). Peak memory:
    the weights plus one matrix. Returns {"matrices", "bytes", "seconds"}."""
    t0 = time.perf_counter()
    n = total = 0
    packed = list(getattr(model, "panel_modules", []))
    for m in _panel_modules(model):
        if any(m is p for p in packed):
            continue
        mx.eval(m["weight"], m["scales"], m["biases"])
        b = kernels.pack_matrix(m["weight"], m["scales"], m["biases"], bits=m.bits,
                                group_size=m.group_size)
        if b > 0:
            packed.append(m)
            n += 1
            total += b
    object.__setattr__(model, "panel_modules", packed)
    return {"matrices": n, "bytes": total, "seconds": time.perf_counter() - t0}


def unpack_model(model: nn.Module) -> dict:
    """The MLX layout back, matrix by matrix (each one's panels freed as its arrays are
    rebuilt). Returns {"matrices", "seconds"}."""
    t0 = time.perf_counter()
    mods = list(getattr(model, "panel_modules", []))
    for m in mods:
        m.weight, m.scales, m.biases = kernels.unpack_matrix(m["weight"])
    object.__setattr__(model, "panel_modules", [])
    return {"matrices": len(mods), "seconds": time.perf_counter() - t0}


def use_panels(model: nn.Module, device: str) -> dict | None:
    """The layout follows the device: packed for the CPU when `kernels.panels_wanted()`,
    unpacked for any other device. Returns the conversion's report (also
    `model.panel_report`), None when nothing changed."""
    packed = bool(getattr(model, "panel_modules", None))
    if device == "cpu" and not packed and kernels.panels_wanted():
        report = {"to": "cpu", **pack_model(model)}
    elif device != "cpu" and packed:
        report = {"to": device, **unpack_model(model)}
    else:
        return None
    object.__setattr__(model, "panel_report", report)
    return report
