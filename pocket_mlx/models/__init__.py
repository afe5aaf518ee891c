"""Architectures by `model_type`: one module each, like mlx-lm's models/."""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn

from pocket_mlx.config import DEFAULT_BITS, DEFAULT_GROUP_SIZE, model_type
from pocket_mlx.errors import PocketError
from pocket_mlx.models import qwen3_5_moe

ARCHITECTURES = {t: qwen3_5_moe for t in qwen3_5_moe.MODEL_TYPES}


def get_architecture(config: dict):
    kind = model_type(config)
    if kind not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise PocketError(f"unsupported model_type {kind!r} (supported: {known})")
    return ARCHITECTURES[kind]


def build_model(config: dict):
    """A model skeleton for a config: lazy arrays only, nothing is computed or read yet."""
    arch = get_architecture(config)
    # A hand-edited config can hold any value ("abc" for a size, 0 heads): whatever building the
    # skeleton raises on it is the config's fault, said in one line.
    try:
        return arch.Model(arch.ModelArgs.from_config(config))
    except (TypeError, ValueError, ZeroDivisionError, KeyError) as e:
        raise PocketError(f"config.json does not describe a valid model: "
                          f"{type(e).__name__}: {e}") from None


def apply_quantization(model: nn.Module, quant: dict,
                       quantizable: Callable[[str, nn.Module], bool]) -> None:
    """Quantize a model as mlx-lm's dict says: a module's own entry wins (its bits/group size,
    or false), else `quantizable(path, module)` decides, at the dict's default bits/group size."""

    def predicate(path: str, module: nn.Module):
        if path in quant:
            return quant[path]
        return hasattr(module, "to_quantized") and quantizable(path, module)

    nn.quantize(model, group_size=quant.get("group_size", DEFAULT_GROUP_SIZE),
                bits=quant.get("bits", DEFAULT_BITS), class_predicate=predicate)
