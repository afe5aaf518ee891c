"""What the header says about a model: name, parameters, experts, recipe, size. No Textual here.

`pocket.json` (written by the pruning/quantization tools, possibly absent) knows what the config
cannot: how many experts the model had before pruning and the quantization recipe's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ModelInfo:
    name: str
    params_total: int
    params_active: int
    experts: int
    experts_original: int | None  # before pruning, when pocket.json says
    top_k: int
    recipe: str
    disk_bytes: int
    bytes_per_token: int
    bytes_total: int
    context_max: int

    @property
    def experts_label(self) -> str:
        if self.experts_original and self.experts_original != self.experts:
            return f"{self.experts}/{self.experts_original} experts (top-{self.top_k})"
        return f"{self.experts} experts (top-{self.top_k})"


def read_pocket_json(path: Path) -> dict:
    try:
        data = json.loads((Path(path) / "pocket.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def recipe_of(config: dict, pocket: dict) -> str:
    """pocket.json's recipe, else "4-bit" / "mixed" from the config's quantization, else dtype."""
    recipe = pocket.get("recipe")
    if isinstance(recipe, dict):  # pocket-mlx convert records {"name": ..., "rules": ...}
        recipe = recipe.get("name")
    if isinstance(recipe, str) and recipe:
        return recipe
    q = config.get("quantization") or config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization")
    if isinstance(q, dict):
        bits = {q.get("bits", 4)}
        bits |= {v.get("bits", q.get("bits", 4)) for v in q.values() if isinstance(v, dict)}
        if any(v is False for v in q.values()) or len(bits) > 1:
            return "mixed"
        return f"{bits.pop()}-bit"
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def disk_size(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    except OSError:
        return 0


def model_info(model, name: str | None = None) -> ModelInfo:
    from pocket_mlx.analysis.accounting import weight_stats
    from pocket_mlx.engine.generation import context_limit

    path = Path(getattr(model, "path", "."))
    config = getattr(model, "config", {}) or {}
    pocket = read_pocket_json(path)
    ws = weight_stats(model)
    orig = pocket.get("original_num_experts")
    return ModelInfo(
        name=name or path.name, params_total=ws.params_total, params_active=ws.params_active,
        experts=ws.experts_per_layer, experts_original=int(orig) if isinstance(orig, int) else None,
        top_k=ws.top_k, recipe=recipe_of(config, pocket), disk_bytes=disk_size(path),
        bytes_per_token=ws.bytes_per_token, bytes_total=ws.bytes_total,
        context_max=context_limit(model))


def human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def human_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def kernels_label() -> str:
    """Which matmul kernels run: the CPU extension's ISA when it is built and active, else MLX."""
    try:
        from pocket_mlx.kernels import info  # built by another module; may not exist yet
    except ImportError:
        return "MLX"
    try:
        data = info()
    except Exception:  # noqa: BLE001 - a broken extension must not break the chat
        return "MLX"
    if isinstance(data, str):
        return data or "MLX"
    if isinstance(data, dict):
        if data.get("active") is False or data.get("enabled") is False:
            return "MLX"
        isa = data.get("isa") or data.get("name") or data.get("backend")
        if not isa:
            return "MLX"
        threads = data.get("threads")
        return f"{isa} ×{threads}" if threads else str(isa)
    return "MLX"
