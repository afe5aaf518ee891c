"""Writing MLX checkpoints that both pocket-mlx and stock mlx-lm load.

Everything is written into a temporary folder beside the destination and renamed into place at
the end, so an interrupted write never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
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
DEFAULT_SHARD_BYTES = 5 << 30  # mlx-lm's and transformers' default shard size
_ST_DTYPES = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
    mx.uint32: "U32", mx.int32: "I32", mx.uint8: "U8", mx.int8: "I8", mx.int64: "I64",
    mx.uint16: "U16", mx.int16: "I16", mx.bool_: "BOOL", mx.uint64: "U64",
}


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


class ShardWriter:
    """Streams tensors into safetensors shards of at most `shard_bytes` (a tensor larger than
    that gets a shard of its own). Each tensor's bytes are appended to a raw `.shard-N.data`
    file as it comes; `close` writes each shard (header, then the data copied over), names them
    as mlx-lm and transformers do and writes the index. Memory use: the tensor being written."""

    def __init__(self, folder: Path, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder, self.shard_bytes = Path(folder), shard_bytes
        self.shards: list[dict] = []  # {"data": Path, "header": {}, "size": int}
        self._f = None

    def _new_shard(self) -> None:
        if self._f:
            self._f.close()
        data = self.folder / f".shard-{len(self.shards)}.data"
        self.shards.append({"data": data, "header": {}, "size": 0})
        self._f = open(data, "wb")

    def add(self, name: str, arr: mx.array) -> None:
        """Evaluate `arr` and append it to the current shard (starting a new one when full)."""
        if arr.dtype not in _ST_DTYPES:
            raise PocketError(f"cannot write {name}: dtype {arr.dtype} has no safetensors type")
        mx.eval(arr)
        nbytes = arr.nbytes
        if not self.shards or (self.shards[-1]["size"]
                               and self.shards[-1]["size"] + nbytes > self.shard_bytes):
            self._new_shard()
        shard = self.shards[-1]
        mv = memoryview(arr)
        if not mv.c_contiguous:
            arr = mx.contiguous(arr)
            mx.eval(arr)
            mv = memoryview(arr)
        self._f.write(mv)
        start = shard["size"]
        shard["header"][name] = {"dtype": _ST_DTYPES[arr.dtype], "shape": list(arr.shape),
                                 "data_offsets": [start, start + nbytes]}
        shard["size"] += nbytes

    def close(self) -> dict[str, str]:
        """Write the shards and `model.safetensors.index.json`; returns the weight map."""
        if self._f:
            self._f.close()
            self._f = None
        n = len(self.shards)
        weight_map, total = {}, 0
        for i, shard in enumerate(self.shards):
            fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            header = {"__metadata__": {"format": "mlx"}, **shard["header"]}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            with open(self.folder / fname, "wb") as out, open(shard["data"], "rb") as data:
                out.write(len(raw).to_bytes(8, "little"))
                out.write(raw)
                shutil.copyfileobj(data, out, 64 << 20)
            shard["data"].unlink()
            for k in shard["header"]:
                weight_map[k] = fname
            total += shard["size"]
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return weight_map


def save_weights(folder: Path, weights: Iterable[tuple[str, mx.array]],
                 shard_bytes: int = DEFAULT_SHARD_BYTES,
                 on_bytes: Callable[[int], None] | None = None) -> dict[str, str]:
    """Write `weights` as safetensors shards plus the index into `folder` (meant to be an
    `atomic_dir`), one tensor in memory at a time; `on_bytes` is told each tensor's size
    (progress bars). Returns the weight map."""
    writer = ShardWriter(folder, shard_bytes)
    for name, arr in weights:
        writer.add(name, arr)
        if on_bytes is not None:
            on_bytes(arr.nbytes)
    return writer.close()


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
