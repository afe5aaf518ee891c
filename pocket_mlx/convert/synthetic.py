"""Synthetic POCKET-shaped checkpoints: exact shapes and quantization, random values.

Why: benchmarks and `info` need the 35B shape (40 layers, 256 or 128 experts, vocab 248320) on
machines that hold no real weights. The checkpoint is written directly in quantized form from
random uint32 words plus small scales/biases; bf16 weights are never materialized, so the 11.5 GB
256-expert build fits in far less RAM than its bf16 form (70 GB). Values are kept sane: scales
are chosen so each projection roughly preserves activation variance and biases centre the
dequantized weights on zero, norms are ones, A_log/dt_bias follow the reference initialisation.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from pocket_mlx.config import module_quantization, quantization
from pocket_mlx.convert import recipes
from pocket_mlx.convert.writer import atomic_dir, copy_tokenizer, mlx_config, save_weights
from pocket_mlx.errors import PocketError
from pocket_mlx.models import apply_quantization, build_model
from pocket_mlx.models.accounting import param_bytes
from pocket_mlx.paths import BUNDLED_MODEL, cache_dir
from pocket_mlx.progress import progress as progress_bar

GROUP_SIZE = 64

# Qwen3.5-35B-A3B text shape (transformers' Qwen3_5MoeConfig defaults).
_QWEN35_35B = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144,
}
# A few-MB model for smoke runs and tests (same families, tiny sizes).
_TINY = {
    "vocab_size": 8192, "hidden_size": 128, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "max_position_embeddings": 4096,
}
_COMMON = {
    "model_type": "qwen3_5_moe", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "norm_topk_prob": True, "hidden_act": "silu", "dtype": "bfloat16",
    "partial_rotary_factor": 0.25, "eos_token_id": 8191, "pad_token_id": 8189,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                        "mrope_section": [11, 11, 10]},
}
SHAPES: dict[str, dict] = {
    "pocket-35b": _QWEN35_35B,
    "pocket-35b-e128": {**_QWEN35_35B, "num_experts": 128},
    "tiny": _TINY,
    # tiny with Qwen3.5's multi-token-prediction head (`mtp.*`), for the head's tests.
    "tiny-mtp": {**_TINY, "mtp_num_hidden_layers": 1},
}


# The built-in recipes of `pocket-mlx convert` (recipes.py), those that quantize.
RECIPES = tuple(n for n in recipes.BUILTIN_NAMES if n not in ("bf16", "float"))
DEFAULT_RECIPE = "pocket-2bit"


def config_for(name: str) -> dict:
    """Full flat config of a named synthetic shape."""
    if name not in SHAPES:
        raise PocketError(f"unknown synthetic model {name!r} (known: {', '.join(SHAPES)})")
    return {**_COMMON, **SHAPES[name]}


PREFIX = "synthetic:"


def parse_ref(model: str | None) -> tuple[str, str] | None:
    """(name, recipe) of a `synthetic:NAME[:RECIPE]` model reference (checked), else None."""
    text = str(model) if model is not None else ""
    if not text.startswith(PREFIX):
        return None
    name, _, recipe = text[len(PREFIX):].partition(":")
    config_for(name)  # validates the name
    recipe = recipe or DEFAULT_RECIPE
    if recipe not in RECIPES:
        raise PocketError(f"unknown recipe {recipe!r} for {text} (known: {', '.join(RECIPES)})")
    return name, recipe


def resolve(ref: str) -> Path:
    """The folder of `synthetic:NAME[:RECIPE]`, built into the cache the first time: the
    loader's `synthetic:` scheme (registered in pocket_mlx/__init__.py)."""
    name, recipe = parse_ref(ref)
    # Always on: a multi-GB build takes minutes, and in a pipe progress.py prints plain lines
    # (nothing at all when the folder is already built).
    return build(name, recipe, progress=True)


def original_experts(name: str) -> int:
    """Experts per layer of the unpruned model a synthetic shape stands for."""
    return _QWEN35_35B["num_experts"] if name.startswith("pocket-35b") else SHAPES[name]["num_experts"]


def _quantizable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return hasattr(module, "to_quantized") and w is not None and w.shape[-1] % GROUP_SIZE == 0


def quantization_for(model: nn.Module, recipe: str) -> dict:
    """mlx-lm's quantization dict for a built-in recipe: the recipe's default plus one entry per
    module that differs (`false` for one that must stay float)."""
    r = recipes.builtin(recipe) if recipe in RECIPES else None
    if r is None:
        raise PocketError(f"unknown recipe {recipe!r} (known: {', '.join(RECIPES)})")
    quant: dict = {**r.default.as_dict(), "mode": "affine"}
    for path, module in model.named_modules():
        w = getattr(module, "weight", None)
        if not hasattr(module, "to_quantized") or w is None:
            continue
        spec, _ = r.resolve(path, w.shape[-1])
        if spec is None:
            quant[path] = False
        elif spec != r.default:
            quant[path] = spec.as_dict()
    return quant


def quantize_skeleton(model: nn.Module, quant: dict, dtype: mx.Dtype = mx.bfloat16) -> None:
    """Turn a lazy skeleton into the quantized module tree of `quant`, shapes only.

    Nothing is evaluated: `mx.quantize` of the lazy random weights is itself lazy, and only the
    shapes and dtypes of the result are read afterwards. Float arrays are cast to `dtype`.
    """

    apply_quantization(model, quant, lambda _, m: _quantizable(m))
    model.update(tree_map(
        lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
        model.parameters()))


def skeleton(config: dict, quant: dict | None = None, dtype: mx.Dtype = mx.bfloat16):
    """Lazy model of `config` quantized as `quant` (or as its own config says)."""
    model = build_model(config)
    q = quant or quantization(config)
    if q:
        quantize_skeleton(model, q, dtype)
    else:
        model.update(tree_map(
            lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters()))
    return model


def _values(name: str, shape: tuple[int, ...], dtype: mx.Dtype, quant: dict,
            rng: np.random.Generator) -> mx.array:
    """Random but well-behaved values for one tensor of the checkpoint."""
    module, leaf = name.rsplit(".", 1)
    if dtype == mx.uint32:  # packed weights: uniformly random codes
        words = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        return mx.array(words)
    if leaf in ("scales", "biases"):
        bits, gs = module_quantization(quant, module)
        levels = 2**bits - 1
        fan_in = shape[-1] * gs
        # Uniform codes in [0, levels] have variance levels*(levels+2)/12; aim at var(w)*fan_in=1
        # (embeddings: rows of unit-ish RMS as well).
        s = math.sqrt(12.0 / (fan_in * levels * (levels + 2)))
        scales = (s * rng.uniform(0.8, 1.2, size=shape)).astype(np.float32)
        if leaf == "scales":
            return mx.array(scales).astype(dtype)
        return mx.array(-scales * levels / 2).astype(dtype)
    if name.endswith("A_log"):
        return mx.array(np.log(rng.uniform(1, 16, size=shape)).astype(np.float32)).astype(dtype)
    if name.endswith("dt_bias") or name.endswith("norm.weight"):
        return mx.ones(shape, dtype)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    bound = 1.0 / math.sqrt(fan_in)  # conv1d and any unquantized projection
    return mx.array(rng.uniform(-bound, bound, size=shape).astype(np.float32)).astype(dtype)


def iter_tensors(model: nn.Module, quant: dict, seed: int = 0
                 ) -> Iterator[tuple[str, mx.array]]:
    """(name, values) for every parameter of the skeleton, generated one tensor at a time."""
    rng = np.random.default_rng(seed)
    for name, arr in tree_flatten(model.parameters()):
        yield name, _values(name, tuple(arr.shape), arr.dtype, quant, rng)


def cache_root() -> Path:
    return cache_dir() / "synthetic"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def build(name: str, recipe: str = DEFAULT_RECIPE, *, out: Path | None = None,
          force: bool = False, progress: bool = True, seed: int = 0,
          shard_bytes: int = 1 << 30) -> Path:
    """The checkpoint folder of a synthetic model, written once (atomically) and reused."""
    out = Path(out) if out else cache_root() / f"{_safe(name)}-{_safe(recipe)}"
    if (out / "config.json").is_file() and not force:
        return out
    config = config_for(name)
    model = build_model(config)
    quant = quantization_for(model, recipe)
    quantize_skeleton(model, quant, mx.bfloat16)
    total = param_bytes(model)
    bar = progress_bar(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}",
                       enabled=progress)
    try:
        with atomic_dir(out, force=True) as tmp:
            save_weights(tmp, iter_tensors(model, quant, seed), shard_bytes, bar.update,
                         expected_bytes=total)
            (tmp / "config.json").write_text(json.dumps(mlx_config(config, quant), indent=2))
            copy_tokenizer(BUNDLED_MODEL, tmp)
            (tmp / "pocket.json").write_text(json.dumps(
                {"synthetic": name, "recipe": recipe, "seed": seed,
                 "original_num_experts": original_experts(name)}, indent=2))
    finally:
        bar.close()
    return out
