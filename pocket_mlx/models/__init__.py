"""Architectures by `model_type`: one module each, like mlx-lm's models/."""

from __future__ import annotations

from pocket_mlx.errors import PocketError
from pocket_mlx.models import qwen3_5_moe

ARCHITECTURES = {t: qwen3_5_moe for t in qwen3_5_moe.MODEL_TYPES}


def get_architecture(config: dict):
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    if model_type not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise PocketError(f"unsupported model_type {model_type!r} (supported: {known})")
    return ARCHITECTURES[model_type]


def build_model(config: dict):
    """A model skeleton for a config: lazy arrays only, nothing is computed or read yet."""
    arch = get_architecture(config)
    try:
        args = arch.ModelArgs.from_config(config)
    except TypeError as e:
        raise PocketError(f"config.json does not describe a valid model: {e}") from None
    return arch.Model(args)
