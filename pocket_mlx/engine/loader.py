"""Loading a checkpoint: local folder or Hugging Face repo, any supported layout, checked by name.

Weights are read lazily (`mx.load` maps safetensors without reading them) and evaluated one
layer at a time, so peak memory while loading stays near the model's own size.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from pocket_mlx.errors import PocketError
from pocket_mlx.models import build_model

# What a snapshot download needs; never the original PyTorch or GGUF files.
HUB_PATTERNS = [
    "*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt", "*.md",
]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_model_path() -> Path:
    """The bundled model (assets/pocket-tiny), or $POCKET_MLX_MODEL when set."""
    env = os.environ.get("POCKET_MLX_MODEL")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "assets" / "pocket-tiny"


def resolve_model_path(path_or_repo: str | os.PathLike | None) -> Path:
    """A local folder as is; `synthetic:NAME[:RECIPE]` as the folder `bench --synthetic` writes
    (once, into the cache: convert/synthetic.py); a repo id through the Hugging Face cache
    (HF_HUB_OFFLINE honoured). Every command resolves `--model` here."""
    if str(path_or_repo or "").startswith("synthetic:"):
        return _synthetic_path(str(path_or_repo))
    if path_or_repo is None:
        path = default_model_path()
        if not path.is_dir():
            raise PocketError(f"the bundled model is missing at {path}; pass --model PATH")
        return path
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise PocketError(f"{path} is a file; --model wants a model folder")
        return path
    text = str(path_or_repo)
    if not REPO_ID.match(text) or text.startswith((".", "/")):
        raise PocketError(f"no such model folder: {text}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, network: all one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PocketError(f"{text} is not a local folder and could not be fetched "
                          f"from the Hugging Face Hub: {first}") from None


def _synthetic_path(ref: str) -> Path:
    # Lazy: the synthetic writer (numpy, the recipes) is only needed for synthetic:NAME.
    import sys

    from pocket_mlx.convert import synthetic

    name, recipe = synthetic.parse_ref(ref)
    return synthetic.build(name, recipe, progress=sys.stderr.isatty())


def read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise PocketError(f"{path} has no config.json; is it a model folder?")
    try:
        return json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PocketError(f"{cfg} is not valid JSON: {e}") from None


def check_safetensors(file: Path) -> None:
    """Header and size of a shard; a truncated download fails here, by name, before any math."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or 8 + n > size:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise PocketError(f"{file.name} is not a valid safetensors file ({e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end > size:
        raise PocketError(f"{file.name} is truncated: {size} bytes, header says {8 + n + end}")


def load_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PocketError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        check_safetensors(f)
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise PocketError(f"cannot read {f.name}: {e}") from None
    return weights


def quantization_of(config: dict) -> dict | None:
    q = config.get("quantization") or config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization")
    if q and q.get("mode", "affine") != "affine":
        raise PocketError(f"unsupported quantization mode {q.get('mode')!r} (affine only)")
    return q


def apply_quantization(model: nn.Module, quant: dict, weights: dict) -> None:
    """Quantize exactly the modules the checkpoint stores quantized (mlx-lm's convention):
    a per-module entry in the dict wins, else a module is quantized when its scales exist."""

    def predicate(path: str, module: nn.Module):
        if path in quant:
            return quant[path]
        if not hasattr(module, "to_quantized"):
            return False
        return f"{path}.scales" in weights

    nn.quantize(model, group_size=quant.get("group_size", 64), bits=quant.get("bits", 4),
                class_predicate=predicate)


def check_shapes(model: nn.Module, weights: dict[str, mx.array]) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise PocketError(f"missing tensor: {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        raise PocketError(f"unexpected tensor: {extra[0]}"
                          + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise PocketError(f"wrong shape for {k}: {tuple(v.shape)}, "
                              f"config implies {tuple(expected[k].shape)}")


def _cast_dtype(name: str, stored: mx.Dtype, ndim: int, stored_of: dict[str, mx.Dtype],
                dtype: mx.Dtype) -> mx.Dtype:
    """The dtype parameter `name` (stored as `stored`) gets when the model runs in `dtype`.

    Float parameters take `dtype`, except the (1 + w) norms, which stay float32 for precision,
    and the scales and biases of quantized matrices: they set no activation dtype, and in their
    stored 16-bit form they are fewer bytes to read per token (the CPU kernels take them as
    they are). The embedding's do set it (its rows are dequantized into the residual stream)."""
    if not mx.issubdtype(stored, mx.floating):
        return stored
    if ndim == 1 and stored == mx.float32 and name.endswith("norm.weight"):
        return stored
    owner = name[: -len(".scales")]  # ".biases" has the same length
    if (name.endswith((".scales", ".biases")) and not owner.endswith("embed_tokens")
            and stored_of.get(owner + ".weight") == mx.uint32):
        return stored
    return dtype


def cast_model(model: nn.Module, dtype: str | None) -> int:
    """Run `model` in `dtype` ("float32", ...; None: the checkpoint's own dtypes) by casting
    its float parameters in place, lazily (see `_cast_dtype`). The dtypes the checkpoint stored
    are kept on the model (`stored_dtypes`), so casting back restores them exactly (bf16 and
    fp16 values are exact in float32): a device switch needs no reload. Returns the number of
    arrays cast."""
    stored: dict[str, tuple[mx.Dtype, int]] = model.stored_dtypes
    stored_of = {k: d for k, (d, _) in stored.items()}
    target = getattr(mx, dtype) if dtype is not None else None
    changed = []
    for k, v in tree_flatten(model.parameters()):
        d, ndim = stored[k]
        want = d if target is None else _cast_dtype(k, d, ndim, stored_of, target)
        if v.dtype != want:
            changed.append((k, v.astype(want)))
    if changed:
        model.update(tree_unflatten(changed))
    object.__setattr__(model, "run_dtype", dtype)
    return len(changed)


def use_device(model: nn.Module, device: str) -> bool:
    """Make `model` the model of `device` under the dtype policy (`devices.policy_dtype`),
    unless `load(..., dtype=...)` fixed its dtype. Cheap when nothing changes; a switch casts
    the float parameters (the small non-quantized ones on a quantized model; milliseconds on
    the bundled model) and evaluates them. Returns True when parameters were cast."""
    from pocket_mlx.engine.devices import policy_dtype, resolve_device

    device = resolve_device(device)
    model.device = device
    if getattr(model, "dtype_override", None) is not None or not hasattr(model, "stored_dtypes"):
        return False
    want = policy_dtype(device)
    if want == getattr(model, "run_dtype", None):
        return False
    if cast_model(model, want):
        mx.eval(model.parameters())
        return True
    return False


def load_model(path: Path, config: dict | None = None, dtype: str | None = None,
               lazy: bool = False, fuse: bool = False) -> nn.Module:
    """The model of a checkpoint folder, its float parameters cast to `dtype` (see
    `cast_model`). `fuse` (inference only) runs projections that read the same input as one
    matmul (`Model.fuse_projections`); the parameters are then no longer the checkpoint's, so
    converting, calibrating and saving load without it."""
    config = config or read_config(path)
    model = build_model(config)
    weights = model.sanitize(load_weights(path))
    if (quant := quantization_of(config)) is not None:
        apply_quantization(model, quant, weights)
    check_shapes(model, weights)
    model.update(tree_unflatten(list(weights.items())))
    del weights
    model.eval()
    if fuse:
        # Lazily: the fused arrays are computed from the mapped files by the per-layer
        # evaluation below (after any cast), so the separate projections never stay in memory.
        model.fuse_projections(evaluate=False)
    # object.__setattr__: nn.Module would file a dict attribute among its parameters.
    object.__setattr__(model, "stored_dtypes", {
        k: (v.dtype, v.ndim) for k, v in tree_flatten(model.parameters())})
    cast_model(model, dtype)
    # An explicit dtype sticks; None lets generation apply the device's policy (`use_device`).
    object.__setattr__(model, "dtype_override", dtype)
    if not lazy:
        # One layer at a time: transient stacks (per-expert checkpoints) never pile up.
        lm = model.language_model
        for layer in lm.model.layers:
            mx.eval(layer.parameters())
        mx.eval(model.parameters())
    object.__setattr__(model, "config", config)
    model.path = path
    return model


def load(path_or_repo: str | os.PathLike | None = None, device: str | None = None,
         dtype: str | None = None, lazy: bool = False, fuse: bool = False):
    """Load a model and its tokenizer: `(model, tokenizer)`.

    `device` ("gpu"/"cpu"/None) is checked and recorded as the model's default generation device;
    weights live in unified memory, so the same model can generate on either. The float dtype
    follows the device (`devices.policy_dtype`: float32 on the CPU, the checkpoint's on the GPU)
    and follows it again when generation runs on another device; `dtype` ("float32",
    "bfloat16", "float16") fixes it instead. `fuse=True` (for generation and evaluation, fewer
    matmuls per token) fuses projections: see `load_model`.
    """
    from pocket_mlx.engine.devices import policy_dtype, resolve_device
    from pocket_mlx.engine.tokenizer import load_tokenizer

    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise PocketError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    device = resolve_device(device)
    path = resolve_model_path(path_or_repo)
    config = read_config(path)
    model = load_model(path, config, dtype=dtype or policy_dtype(device), lazy=lazy, fuse=fuse)
    model.device = device
    object.__setattr__(model, "dtype_override", dtype)
    tokenizer = load_tokenizer(path, config)
    return model, tokenizer
