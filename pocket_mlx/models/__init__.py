"""Architectures by `model_type`: one module each, like mlx-lm's models/."""

from __future__ import annotations

from pocket_mlx.config import model_type
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
    try:
        args = arch.ModelArgs.from_config(config)
    except TypeError as e:
        raise PocketError(f"config.json does not describe a valid model: {e}") from None
    return arch.Model(args)
