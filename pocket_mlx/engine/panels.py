"""The CPU panel layout for a whole model (`kernels.panels_wanted`: by default on x86, AVX2 or
AVX-512; POCKET_MLX_PANELS=0/1 to choose): the quantized matrices the CPU kernels read are packed
once when the model is to run on the CPU, one matrix at a time so the weights are never in memory
twice, and unpacked into MLX arrays before another device runs it."""

from __future__ import annotations

import time
import weakref

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx import kernels
from pocket_mlx.models.layers import QuantizedLinear, QuantizedSwitchLinear

# Models with packed matrices, so that turning the extension off (kernels.set_enabled(False): a
# script about to take gradients, a test comparing with MLX's ops) unpacks them first.
# (Keyed by id: a module is a dict, so not hashable; the finalizer below drops the entry.)
_packed_models: dict[int, weakref.ref] = {}


def _unpack_all() -> None:
    for ref in list(_packed_models.values()):
        model = ref()
        if model is not None:
            unpack_model(model)


kernels.on_disable(_unpack_all)


def _panel_modules(model: nn.Module):
    """Modules whose weights only the extension's matmuls read on the CPU: quantized linear
    layers and stacked experts (not embeddings, whose rows MLX dequantizes)."""
    for _, m in model.named_modules():
        if (isinstance(m, (QuantizedLinear, QuantizedSwitchLinear)) and "biases" in m
                and getattr(m, "mode", "affine") == "affine"):
            yield m


def _held(model: nn.Module) -> list:
    """The model's packed matrices as (module, packed weight array): one list per model for its
    lifetime (packing appends, unpacking empties it in place), which a finalizer frees the
    panels of when the model is collected (the extension holds packed matrices until told: a
    chat or server that loads another model must not keep the old one's panels). The packed
    array is kept beside its module: code may have replaced the module's arrays since."""
    held = getattr(model, "panel_modules", None)
    if held is None:
        held = []
        object.__setattr__(model, "panel_modules", held)
        weakref.finalize(model, _release, held, id(model))
    return held


def _release(held: list, key: int) -> None:
    _packed_models.pop(key, None)
    for _, w in held:
        kernels.release_matrix(w)
    held.clear()


def pack_model(model: nn.Module) -> dict:
    """Packs every such matrix (bits the layout holds; the rest stay as they are). Peak memory:
    the weights plus one matrix. Returns {"matrices", "bytes", "seconds"}."""
    t0 = time.perf_counter()
    n = total = 0
    packed = _held(model)
    for m in _panel_modules(model):
        if any(m is p for p, _ in packed):
            continue
        mx.eval(m["weight"], m["scales"], m["biases"])
        b = kernels.pack_matrix(m["weight"], m["scales"], m["biases"], bits=m.bits,
                                group_size=m.group_size)
        if b > 0:
            packed.append((m, m["weight"]))
            n += 1
            total += b
    if packed:
        _packed_models[id(model)] = weakref.ref(model)
    return {"matrices": n, "bytes": total, "seconds": time.perf_counter() - t0}


def unpack_model(model: nn.Module) -> dict:
    """The MLX layout back, matrix by matrix (each one's panels freed as its arrays are
    rebuilt). Returns {"matrices", "seconds"}."""
    t0 = time.perf_counter()
    mods = getattr(model, "panel_modules", None) or []  # never packed: nothing to track
    n = len(mods)
    while mods:
        m, w = mods.pop()
        arrays = kernels.unpack_matrix(w)
        if m["weight"] is w:  # else the module's arrays were replaced: they stay
            m.weight, m.scales, m.biases = arrays
    _packed_models.pop(id(model), None)
    return {"matrices": n, "seconds": time.perf_counter() - t0}


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
