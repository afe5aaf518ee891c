"""What a model folder says about itself: one reader each for config.json's text part, its
layer types, its quantization dict, the tensor bytes of its safetensors, and pocket.json; and
`ModelFolder`, a folder read once and handed down the load.

Every module that needs one of these asks here, so a checkpoint is read one way everywhere (the
loader, `info`, `bench`, `convert`, `wired`, the chat header). Nothing here imports MLX.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pocket_mlx.errors import PocketError

# -- config.json ---------------------------------------------------------------------------------
NESTED = ("text_config", "vision_config")  # sub-configs of vision-language checkpoints


def text_config(config: dict) -> dict:
    """The language-model part of a config, flat.

    Vision-language checkpoints nest it under `text_config`; keys the nested part lacks (e.g.
    `tie_word_embeddings`, `eos_token_id`, `quantization` of some exports) are taken from the
    outer config, and the nested part wins where both have a key. A flat config comes back as a
    copy without the sub-configs.
    """
    inner = config.get("text_config")
    outer = {k: v for k, v in config.items() if k not in NESTED}
    return {**outer, **inner} if isinstance(inner, dict) else outer


def read_config(path: Path) -> dict:
    """config.json of a model folder, as a dict; PocketError (one line) when it is missing,
    unreadable, not JSON or not a JSON object."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise PocketError(f"{path} has no config.json; is it a model folder?")
    try:
        config = json.loads(cfg.read_text())
    except OSError as e:
        raise PocketError(f"cannot read {cfg}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise PocketError(f"{cfg} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise PocketError(f"{cfg} is not a JSON object")
    return config


def checkpoint_dtype(config: dict) -> str:
    """The float dtype a checkpoint declares (`torch_dtype` or `dtype`, else bfloat16): the
    dtype its activations, K/V cache and conv state take on the GPU (engine.devices'
    policy_dtype keeps it there; the CPU runs float32)."""
    text = text_config(config)
    return str(text.get("torch_dtype") or text.get("dtype") or "bfloat16").replace("torch.", "")


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a float dtype by name; 2 (the 16-bit checkpoints') if unknown."""
    return DTYPE_BYTES.get(name, 2)


def model_type(config: dict) -> str | None:
    """The outer `model_type` (the checkpoint's), else the text part's."""
    return config.get("model_type") or text_config(config).get("model_type")


# -- layer types ---------------------------------------------------------------------------------
LAYER_TYPES = ("linear_attention", "full_attention")
FULL_ATTENTION_INTERVAL = 4  # Qwen3.5: every 4th layer is full attention unless said otherwise


def resolve_layer_types(num_layers: int, layer_types: list[str] | None = None,
                        interval: int | None = FULL_ATTENTION_INTERVAL) -> list[str]:
    """The config's `layer_types` checked, or Qwen3.5's rule when absent: full attention at
    every `interval`-th layer (default 4), Gated DeltaNet (linear attention) elsewhere."""
    if not layer_types:
        n = FULL_ATTENTION_INTERVAL if interval is None else interval
        if not _is_int(n) or n < 1:
            raise PocketError(f"config: full_attention_interval must be a whole number >= 1, "
                              f"got {n!r}")
        layer_types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                       for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise PocketError(f"config: layer_types has {len(layer_types)} entries for "
                          f"{num_layers} layers")
    unknown = set(layer_types) - set(LAYER_TYPES)
    if unknown:
        raise PocketError(f"config: unknown layer type(s) {sorted(map(str, unknown))} "
                          f"(known: {', '.join(LAYER_TYPES)})")
    return layer_types


def layer_types(config: dict) -> list[str]:
    """`resolve_layer_types` of a whole config.json (flat or nested)."""
    text = text_config(config)
    try:
        n = int(text["num_hidden_layers"])
    except KeyError:
        raise PocketError("config.json lacks 'num_hidden_layers'") from None
    except (TypeError, ValueError):
        raise PocketError(f"config.json: num_hidden_layers must be a whole number, "
                          f"got {text['num_hidden_layers']!r}") from None
    return resolve_layer_types(n, text.get("layer_types"), text.get("full_attention_interval"))


# -- quantization --------------------------------------------------------------------------------
AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)  # what MLX's affine quantization packs
GROUP_SIZES = (32, 64, 128)
DEFAULT_BITS = 4  # mlx-lm's defaults when a quantization dict leaves them out
DEFAULT_GROUP_SIZE = 64
_SCALAR_KEYS = ("bits", "group_size", "mode")


def _allowed(values: tuple[int, ...]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}"


def _check_int(value, key: str, allowed: tuple[int, ...], where: str) -> int:
    # bool is an int in Python; `true` in a JSON file is never a bit width.
    if not _is_int(value) or value not in allowed:
        raise PocketError(f"{where}: {key} is {json.dumps(value)}; MLX affine quantization "
                          f"takes {key.rsplit('.', 1)[-1]} {_allowed(allowed)}")
    return value


def quantization(config: dict, where: str = "config.json") -> dict | None:
    """The checkpoint's quantization dict (mlx-lm's convention: default `bits`/`group_size`
    plus per-module entries, each a dict or a bool), checked; None for a float checkpoint.

    Looked up as mlx-lm does: `quantization`, then `quantization_config`, then the nested text
    config's. A value MLX cannot load raises PocketError naming the key and what is allowed.
    """
    q = config.get("quantization") or config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise PocketError(f"{where}: quantization must be an object, got {json.dumps(q)}")
    if "quant_method" in q:
        raise PocketError(f"{where}: unsupported quantization method {q['quant_method']!r} "
                          "(MLX affine only: convert the checkpoint with `pocket-mlx convert`)")
    if q.get("mode", "affine") != "affine":
        raise PocketError(f"{where}: unsupported quantization mode {q.get('mode')!r} "
                          "(affine only)")
    _check_int(q.get("bits", DEFAULT_BITS), "quantization.bits", AFFINE_BITS, where)
    _check_int(q.get("group_size", DEFAULT_GROUP_SIZE), "quantization.group_size", GROUP_SIZES,
               where)
    for path, entry in q.items():
        if path in _SCALAR_KEYS or isinstance(entry, bool):
            continue
        key = f"quantization[{json.dumps(path)}]"
        if not isinstance(entry, dict):
            raise PocketError(f"{where}: {key} is {json.dumps(entry)}; a module's entry is an "
                              "object with bits and group_size, or false to keep it float")
        if "bits" in entry:
            _check_int(entry["bits"], f"{key}.bits", AFFINE_BITS, where)
        if "group_size" in entry:
            _check_int(entry["group_size"], f"{key}.group_size", GROUP_SIZES, where)
    return q


def module_quantization(quant: dict | None, path: str) -> tuple[int, int] | None:
    """(bits, group_size) a checked quantization dict gives the module at `path` (its own entry,
    else the default), or None when the entry keeps it float. Whether an unlisted module is
    quantized at all is the checkpoint's business (its scales exist or not), not the dict's."""
    if not quant:
        return None
    entry = quant.get(path, True)
    if entry is False:
        return None
    default = (quant.get("bits", DEFAULT_BITS), quant.get("group_size", DEFAULT_GROUP_SIZE))
    if entry is True:
        return default
    return entry.get("bits", default[0]), entry.get("group_size", default[1])


def bits_used(quant: dict) -> list[int]:
    """The bit widths a checked quantization dict uses, ascending (the default included)."""
    bits = {quant.get("bits", DEFAULT_BITS)}
    bits |= {e.get("bits", quant.get("bits", DEFAULT_BITS)) for k, e in quant.items()
             if isinstance(e, dict)}
    return sorted(bits)


# -- safetensors ---------------------------------------------------------------------------------
def safetensors_header(file: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file; PocketError when it is not one or is
    truncated (a cut download fails here, by name, before any math)."""
    file = Path(file)
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or 8 + n > size:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError) as e:
        raise PocketError(f"{file.name} is not a valid safetensors file ({e})") from None
    if 8 + n + end > size:
        raise PocketError(f"{file.name} is truncated: {size} bytes, header says {8 + n + end}")
    return n, header


# Everything but the weights that running or converting a checkpoint reads from its folder:
# what the Hub download fetches (engine/hub.py) and convert copies (convert/writer.py).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json", "vocab.json",
    "merges.txt", "added_tokens.json",
)
METADATA_FILES = ("config.json", "pocket.json", *TOKENIZER_FILES)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


# -- which weight files a checkpoint is (the Hub download fetches the same: engine/hub.py) ------
def shards_of_index(index: dict, where: str) -> list[str]:
    """The shard names of a safetensors index, each once, in order; they must be plain names in
    the same folder (an index is data from the network: no paths out of the snapshot)."""
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise PocketError(f"{where} has no weight_map; the checkpoint's index is broken")
    shards = sorted({str(v) for v in wmap.values()})
    for s in shards:
        if "/" in s or "\\" in s or s in (".", "..") or not s.endswith(".safetensors"):
            raise PocketError(f"{where} names a shard {s!r} that is not a safetensors file "
                              "beside it")
    return shards


def pick_weights(names: Iterable[str], index: dict | None, where: str) -> list[str]:
    """The weight files of a checkpoint among `names` (a folder's or a repo's top-level files):
    the index's shards when there is an index, else `model.safetensors`, else every top-level
    `*.safetensors` (old single-folder layouts without an index)."""
    names = set(names)
    if index is not None:
        return shards_of_index(index, where)
    if SINGLE in names:
        return [SINGLE]
    return sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)


def read_index(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PocketError(f"{file} is not a readable index ({e})") from None


def weight_files(path: Path) -> list[Path]:
    """The weight files the loader reads from a local folder (see `pick_weights`); an index that
    names a missing shard fails here, by name."""
    index = read_index(path / INDEX) if (path / INDEX).is_file() else None
    names = [p.name for p in path.glob("*.safetensors")]
    files = [path / n for n in pick_weights(names, index, str(path / INDEX))]
    for f in files:
        if not f.is_file():
            raise PocketError(f"{path / INDEX} names {f.name}, which is not in {path}")
    return files


def disk_bytes(folder: Path) -> int:
    """Bytes of a folder's weight files on disk (headers included)."""
    return sum(f.stat().st_size for f in weight_files(Path(folder)))


def weights_bytes(folder: Path) -> int:
    """Bytes of tensor data in a folder's weight files (`weight_files`): the model's size as stored, which is
    also what its weights take in memory at the checkpoint's dtypes (the headers are not
    counted). This is the one "size" of a model that `info`, `bench` and the chat show."""
    return tensor_bytes(weight_files(Path(folder)))


def tensor_bytes(files: Iterable[Path]) -> int:
    """Bytes of tensor data in safetensors `files`, read off their headers."""
    total = 0
    for file in files:
        _, header = safetensors_header(file)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0]
                     for k, v in header.items() if k != "__metadata__")
    return total


# -- pocket.json and the recipe's name -------------------------------------------------------------
def read_pocket_json(folder: Path) -> dict:
    """pocket.json of a model folder (written by `pocket-mlx convert` and the synthetic builder):
    what the config cannot say, e.g. the recipe and the experts before pruning. {} when absent
    or unreadable: it is a description, and a model loads without it."""
    try:
        data = json.loads((Path(folder) / "pocket.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def recipe_name(config: dict, pocket: dict | None = None) -> str:
    """The recipe's short name: pocket.json's (a string, or convert's {"name": ..., "rules":
    ...}), else one read off the quantization dict (`uniform-4`, `mixed-3/4/6`), else the float
    dtype (`bf16`)."""
    recipe = (pocket or {}).get("recipe")
    if isinstance(recipe, dict):
        recipe = recipe.get("name")
    if isinstance(recipe, str) and recipe:
        return recipe
    q = quantization(config)
    if q:
        bits = bits_used(q)
        if len(bits) == 1 and not any(e is False for e in q.values()):
            return f"uniform-{bits[0]}"
        return "mixed-" + "/".join(map(str, bits))
    dtype = checkpoint_dtype(config)
    return _DTYPE_NAMES.get(dtype, dtype)


def recipe_label(config: dict, pocket: dict | None = None) -> str:
    """What `info`, `bench` and the chat header call a build: the recipe's short name, plus the
    experts kept of the original when pocket.json says it was pruned, e.g.
    `pocket-3bit (24/32 experts)`."""
    name = recipe_name(config, pocket)
    orig = (pocket or {}).get("original_num_experts")
    kept = text_config(config).get("num_experts")
    if _is_int(orig) and _is_int(kept) and orig != kept:
        return f"{name} ({kept}/{orig} experts)"
    return name


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- a model folder, read once -------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ModelFolder:
    """A model folder as one object: its path and config.json read once (`read`), its weight
    files, pocket.json and sizes read on first use and kept. The loader, `serve`, `chat`,
    `bench`, `info` and `convert` hand this down instead of the path, so no step resolves the
    folder or reads its config.json again. `path` is the folder the files are in (under
    --distributed, this rank's share: engine/rank_shards.py)."""

    path: Path
    config: dict

    @classmethod
    def read(cls, path: Path | str) -> ModelFolder:
        """The folder at `path` with its config.json (`read_config`: one line when it is
        missing or broken)."""
        return cls(Path(path), read_config(Path(path)))

    @cached_property
    def weight_files(self) -> list[Path]:
        """`weight_files` of the folder: the index's shards, a missing one failing by name."""
        return weight_files(self.path)

    @cached_property
    def pocket(self) -> dict:
        """pocket.json (`read_pocket_json`; {} when absent)."""
        return read_pocket_json(self.path)

    @cached_property
    def weights_bytes(self) -> int:
        """The model's size as stored (see `weights_bytes`)."""
        return tensor_bytes(self.weight_files)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the weight files on disk (see `disk_bytes`)."""
        return sum(f.stat().st_size for f in self.weight_files)

    @property
    def tokenizer_files(self) -> list[Path]:
        """The folder's tokenizer files (those of TOKENIZER_FILES it has)."""
        return [f for n in TOKENIZER_FILES if (f := self.path / n).is_file()]

    @property
    def recipe_label(self) -> str:
        """`recipe_label` of the folder (config.json and pocket.json)."""
        return recipe_label(self.config, self.pocket)
