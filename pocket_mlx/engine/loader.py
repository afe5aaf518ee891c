"""Loading a checkpoint: local folder or Hugging Face repo, any supported layout, checked by name.

Weights are read lazily (`mx.load` maps safetensors without reading them) and evaluated one
layer at a time, so peak memory while loading stays near the model's own size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from pocket_mlx.config import ModelFolder, quantization, safetensors_header
from pocket_mlx.engine import rank_shards, schemes
from pocket_mlx.engine.devices import keep_cpu_buffers, policy_dtype, resolve_device, stream_for
from pocket_mlx.engine.hub import fetch, parse_repo_id
from pocket_mlx.engine.panels import use_panels
from pocket_mlx.engine.tokenizer import load_tokenizer
from pocket_mlx.errors import PocketError
from pocket_mlx.models import apply_quantization, build_model
from pocket_mlx.models.accounting import WeightStats, weight_stats
from pocket_mlx.paths import default_model_path


def resolve_model_path(path_or_repo: str | os.PathLike | None) -> Path:
    """A local folder as is; `synthetic:NAME[:RECIPE]` as the folder `bench --synthetic` writes
    (once, into the cache: convert/synthetic.py); a repo id (`user/repo[@revision]`) through the
    Hugging Face cache, downloading only what is missing (see `pocket_mlx.engine.hub`). Every
    command resolves `--model` here."""
    if path_or_repo is not None and (path := schemes.resolve(str(path_or_repo))) is not None:
        return path
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
    if (repo := parse_repo_id(text)) is None:
        raise PocketError(f"no such model folder: {text}")
    return fetch(*repo)


def open_folder(path: Path, group=None) -> ModelFolder:
    """The model folder at a resolved `path` (`resolve_model_path`), read once: under
    --distributed (`group`), this rank's share of a sharded checkpoint (rank_shards)."""
    return ModelFolder.read(rank_shards.rank_folder(Path(path), group))


def open_model(path_or_repo: str | os.PathLike | None, group=None) -> ModelFolder:
    """`resolve_model_path` then `open_folder`: what every command loads is this one object."""
    return open_folder(resolve_model_path(path_or_repo), group)


def _folder(source: ModelFolder | Path, config: dict | None = None) -> ModelFolder:
    """`source` as a ModelFolder: a bare path is read here, unless `config` stands in for its
    config.json (convert loads what it is writing with the config it wrote)."""
    if isinstance(source, ModelFolder):
        return source
    return ModelFolder(Path(source), config) if config else ModelFolder.read(source)


def load_weights(folder: ModelFolder | Path) -> dict[str, mx.array]:
    """The checkpoint's tensors, mapped lazily, from the files of `weight_files` only (an index's
    shards: a stray copy such as consolidated.safetensors beside them is not read)."""
    folder = _folder(folder)
    path, files = folder.path, folder.weight_files
    if not files:
        raise PocketError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        safetensors_header(f)  # a truncated download fails here, by name, before any math
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise PocketError(f"cannot read {f.name}: {e}") from None
    return weights


def quantize_as_stored(model: nn.Module, quant: dict | None, weights: dict[str, mx.array]) -> None:
    """Quantize exactly the modules the checkpoint stores quantized (those whose scales exist)."""
    if quant is not None:
        stored = {k.removesuffix(".scales") for k in weights if k.endswith(".scales")}
        apply_quantization(model, quant, lambda p, _: p in stored)


def _quant_label(module: nn.Module | None) -> str:
    bits = getattr(module, "bits", None)
    return f" ({bits}-bit, group size {module.group_size})" if bits else ""


def check_shapes(model: nn.Module, weights: dict[str, mx.array],
                 shapes: dict[str, tuple] | None = None) -> None:
    """Names, dtypes and shapes of the checkpoint against the (quantized) model skeleton, read
    from the safetensors headers only: a tensor that cannot work fails here, by name, before
    any forward. Quantized matrices must be packed uint32 with scales and biases of the
    shapes their bits and group size imply; float tensors must be float."""
    expected = dict(tree_flatten(model.parameters()))
    shapes = shapes or {}  # names whose shape differs from the skeleton's (one rank's experts)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise PocketError(f"missing tensor: {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        raise PocketError(f"unexpected tensor: {extra[0]}"
                          + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    modules = dict(model.named_modules())
    for k, v in weights.items():
        want = expected[k]
        owner = k.rsplit(".", 1)[0]
        quant = _quant_label(modules.get(owner))
        if want.dtype == mx.uint32 and v.dtype != mx.uint32:
            raise PocketError(f"{k} is {_dtype_name(v)} but config.json quantizes it{quant}, "
                              "which stores packed uint32: re-convert the model or fix its "
                              "quantization entry")
        if mx.issubdtype(want.dtype, mx.floating) and not mx.issubdtype(v.dtype, mx.floating):
            if k.endswith(".weight") and f"{owner}.scales" not in weights:
                raise PocketError(f"{k} is {_dtype_name(v)} (packed) but {owner}.scales is "
                                  "missing: the checkpoint is incomplete")
            raise PocketError(f"{k} is {_dtype_name(v)}; a float tensor belongs there")
        if tuple(v.shape) != tuple(shapes.get(k, want.shape)):
            raise PocketError(f"wrong shape for {k}: {tuple(v.shape)}, "
                              f"config implies {tuple(shapes.get(k, want.shape))}{quant}")


def _dtype_name(v: mx.array) -> str:
    return str(v.dtype).split(".")[-1]


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
    _forget_derived(model)
    return len(changed)


# Facts derived from the parameters' dtypes, kept on the model (computing them walks every module
# or traces a token) and dropped by `cast_model`.
_DERIVED = ("_weight_stats", "_cache_dtypes")


def _forget_derived(model: nn.Module) -> None:
    for name in _DERIVED:
        object.__setattr__(model, name, None)


def model_weight_stats(model: nn.Module) -> WeightStats:
    """`weight_stats(model)` once per model and dtype (every generation reports bytes per token
    and wires that much memory; the walk over every module is not free on a big model)."""
    stats = getattr(model, "_weight_stats", None)
    if stats is None:
        stats = weight_stats(model)
        object.__setattr__(model, "_weight_stats", stats)
    return stats


# The arrays of a conversation's cache whose dtype follows the model's (KVCache, and
# LinearAttentionCache's conv window and delta-rule state; the latter stays float32 by design).
_CACHE_ARRAYS = ("keys", "values", "conv_state", "state")


def cache_dtypes(model: nn.Module) -> list[dict[str, mx.Dtype]]:
    """Per layer, the dtype of each array a new conversation's cache holds with the model's
    current dtypes. Found by tracing one token lazily (a graph only, nothing computed), so it
    is exact whatever promotes where: a float32 norm weight makes the KV and the conv window
    float32 even in a bf16 model, and the delta-rule state is float32 always. Kept on the model
    until the next cast."""
    dtypes = getattr(model, "_cache_dtypes", None)
    if dtypes is None:
        cache = model.make_cache()
        model(mx.zeros((1, 1), mx.uint32), cache=cache)
        dtypes = [{n: a.dtype for n in _CACHE_ARRAYS
                   if isinstance(a := getattr(c, n, None), mx.array)} for c in cache]
        object.__setattr__(model, "_cache_dtypes", dtypes)
    return dtypes


def cast_cache(model: nn.Module, cache: list) -> int:
    """A conversation's cache in the dtypes a new one would have with the model's current
    dtypes (`cache_dtypes`): after a device switch, in either direction, the next token runs
    on arrays of one dtype (on the CPU: the extension's float32 nodes at once). Cheaper than
    re-prefilling the conversation; a no-op (a few comparisons) when they already agree.
    Returns the number of arrays cast (lazily)."""
    n = 0
    for c, want in zip(cache, cache_dtypes(model)):
        for name, dtype in want.items():
            a = getattr(c, name, None)
            if isinstance(a, mx.array) and a.dtype != dtype:
                setattr(c, name, a.astype(dtype))
                n += 1
    return n


def _place(model: nn.Module, device: str, pack: bool = True) -> None:
    """What a model needs on `device` besides its dtypes: the device noted, MLX's CPU buffer
    cache kept (`keep_cpu_buffers`), the weight layout of that device (`use_panels`; not for a
    lazy load, whose arrays are not read yet)."""
    model.device = device
    if device == "cpu":
        keep_cpu_buffers()
    if pack:
        use_panels(model, device)


def use_device(model: nn.Module, device: str, cache: list | None = None) -> bool:
    """Make `model` the model of `device` under the dtype policy (`devices.policy_dtype`),
    unless `load(..., dtype=...)` fixed its dtype, and `cache` (a conversation's, if given)
    that of the model (`cast_cache`). Cheap when nothing changes; a switch casts the float
    parameters (the small non-quantized ones on a quantized model; milliseconds on the bundled
    model) and evaluates them. The casts run on the device's stream (this thread's, see
    `devices.stream_for`). Returns True when parameters were cast."""
    device = resolve_device(device)
    _place(model, device)
    if getattr(model, "dtype_override", None) is not None or not hasattr(model, "stored_dtypes"):
        return False  # the dtypes never change, so neither do the cache's
    want = policy_dtype(device)
    switched = False
    with mx.stream(stream_for(device)):
        if want != getattr(model, "run_dtype", None) and cast_model(model, want):
            mx.eval(model.parameters())
            switched = True
        # Always, not only on a switch: a chat may hand back a snapshot taken before one.
        if cache is not None and cast_cache(model, cache):
            mx.eval([a for c in cache for a in getattr(c, "arrays", ())])
    return switched


def load_model(folder: ModelFolder | Path, config: dict | None = None, dtype: str | None = None,
               lazy: bool = False, fuse: bool = False,
               shard: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """The model of a checkpoint folder (a ModelFolder, or a path and optionally the config
    that stands for its config.json), its float parameters cast to `dtype` (see
    `cast_model`). `fuse` (inference only) runs projections that read the same input as one
    matmul (`Model.fuse_projections`); the parameters are then no longer the checkpoint's, so
    converting, calibrating and saving load without it. `shard` (a distributed run, see
    engine/distributed/) cuts the still-lazy model down to this rank's share before anything
    is evaluated, so the rest of the checkpoint is never read. A rank folder of per-rank shards
    (engine/rank_shards.py) holds only that rank's tensors: they are fitted to the skeleton
    (`rank_shards.complete`) and the model remembers the rank's entry (`rank_shard`) for
    `shard`. The model keeps the folder (`model.folder`; also `model.path`, `model.config`)."""
    folder = _folder(folder, config)
    path, config = folder.path, folder.config
    quant = quantization(config, where=str(path / "config.json"))
    model = build_model(config)
    rank = rank_shards.read_rank(path)
    if rank is not None and shard is None:
        raise PocketError(f"{path} is one rank's share of a sharded checkpoint; it loads only "
                          "under --distributed")
    files = folder.weight_files
    weights = model.sanitize(load_weights(folder))
    quantize_as_stored(model, quant, weights)
    shapes = rank_shards.complete(weights, rank, model) if rank is not None else None
    check_shapes(model, weights, shapes)
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
    # What this process mapped from disk (rank_report shows it per rank).
    object.__setattr__(model, "checkpoint_bytes", sum(f.stat().st_size for f in files))
    object.__setattr__(model, "rank_shard", rank)
    if shard is not None:
        shard(model)
    # An explicit dtype sticks; None lets generation apply the device's policy (`use_device`).
    object.__setattr__(model, "dtype_override", dtype)
    if not lazy:
        # One layer at a time: transient stacks (per-expert checkpoints) never pile up.
        lm = model.language_model
        for layer in lm.model.layers:
            mx.eval(layer.parameters())
        mx.eval(model.parameters())
    object.__setattr__(model, "config", config)
    object.__setattr__(model, "folder", folder)
    model.path = path
    return model


def load(path_or_repo: ModelFolder | str | os.PathLike | None = None,
         device: str | None = None,
         dtype: str | None = None, lazy: bool = False, fuse: bool = False,
         shard: Callable[[nn.Module], None] | None = None):
    """Load a model and its tokenizer: `(model, tokenizer)`. `path_or_repo` is what
    `--model` names, or a folder already opened (`open_model`: nothing is resolved or read
    again).

    `device` ("gpu"/"cpu"/None) is checked and recorded as the model's default generation device;
    weights live in unified memory, so the same model can generate on either. The float dtype
    follows the device (`devices.policy_dtype`: float32 on the CPU, the checkpoint's on the GPU)
    and follows it again when generation runs on another device; `dtype` ("float32",
    "bfloat16", "float16") fixes it instead. `fuse=True` (for generation and evaluation, fewer
    matmuls per token) fuses projections: see `load_model`.
    """
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise PocketError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    device = resolve_device(device)
    folder = (path_or_repo if isinstance(path_or_repo, ModelFolder)
              else open_model(path_or_repo, getattr(shard, "group", None)))
    model = load_model(folder, dtype=dtype or policy_dtype(device), lazy=lazy, fuse=fuse,
                       shard=shard)
    object.__setattr__(model, "dtype_override", dtype)
    _place(model, device, pack=not lazy)
    tokenizer = load_tokenizer(folder.path, folder.config)
    return model, tokenizer
