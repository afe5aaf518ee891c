"""Writing MLX checkpoints that both pocket-mlx and stock mlx-lm load.

Everything is written into a temporary folder beside the destination and renamed into place at
the end, so an interrupted write never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from pocket_mlx.errors import PocketError
from pocket_mlx.models.fusion import unfused_parameters

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json", "vocab.json",
    "merges.txt", "added_tokens.json",
)


@contextmanager
def atomic_dir(out: Path, force: bool = False):
    """Yield a temporary folder next to `out`; on success it replaces `out` in one rename."""
    out = Path(out)
    if out.exists() and not force:
        raise PocketError(f"{out} already exists (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def mlx_config(config: dict, quantization: dict | None = None) -> dict:
    """A flat text config with model_type `qwen3_5_moe`: the form mlx-lm's loader accepts."""
    text = dict(config.get("text_config") or config)
    for k in ("quantization", "quantization_config", "text_config", "vision_config",
              "architectures", "auto_map"):
        text.pop(k, None)
    text["model_type"] = "qwen3_5_moe"
    if quantization:
        text["quantization"] = quantization
        text["quantization_config"] = quantization
    return text


def save_weights(folder: Path, weights: Iterable[tuple[str, mx.array]],
                 shard_bytes: int = 5 << 30) -> dict[str, str]:
    """Write safetensors shards of at most `shard_bytes` plus the index; arrays are evaluated
    (and freed) shard by shard. Returns the weight map."""
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name, arr in weights:
        if size and size + arr.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    n = len(shards)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(folder / fname), shard, metadata={"format": "mlx"})
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.nbytes
        shards[i] = {}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return weight_map


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)  # not copy2: keep no read-only modes


def save_model(model, config: dict, out: Path, *, src: Path | None = None,
               quantization: dict | None = None, force: bool = False,
               extra_files: dict[str, str] | None = None) -> Path:
    """Save a loaded model as an MLX checkpoint (atomic)."""
    with atomic_dir(out, force=force) as tmp:
        save_weights(tmp, unfused_parameters(model))  # the checkpoint's names, fused or not
        (tmp / "config.json").write_text(json.dumps(mlx_config(config, quantization), indent=2))
        if src is not None:
            copy_tokenizer(src, tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(out)
