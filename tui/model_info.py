"""What the header says about a model: name, parameters, recipe, size. No Textual here.

The facts come from their one home each: parameters and bytes per token from
`models.accounting`, the recipe's label (with the experts kept by pruning, from pocket.json)
and the size as stored from `pocket_mlx.config`; `pocket-mlx info` and `bench` use the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pocket_mlx import units
from pocket_mlx.config import ModelFolder
from pocket_mlx.engine.generation import context_limit
from pocket_mlx.engine.loader import model_weight_stats


@dataclass
class ModelInfo:
    name: str
    params_total: int
    params_active: int
    top_k: int
    recipe: str  # e.g. "pocket-3bit (24/32 experts)"
    size_bytes: int  # the weights as stored
    bytes_per_token: int
    context_max: int
    thinking_switch: bool = False  # the chat template has `enable_thinking` (set by the chat)

    def header_parts(self) -> list[str]:
        """The header's fields after the name, in the wording `info` and `bench` use."""
        return [f"{units.count(self.params_total)} params, {units.count(self.params_active)} "
                f"active (top-{self.top_k})", self.recipe, units.size(self.size_bytes)]


def model_info(model, name: str | None = None) -> ModelInfo:
    """The header's facts about a loaded model (its folder is `model.folder`, read once by the
    loader; `model.path` for a model loaded otherwise)."""
    path = Path(getattr(model, "path", "."))
    folder = getattr(model, "folder", None)
    if folder is None:
        folder = ModelFolder(path, getattr(model, "config", {}) or {})
    ws = model_weight_stats(model)  # the chat's generations reuse it
    return ModelInfo(
        name=name or path.name, params_total=ws.params_total, params_active=ws.params_active,
        top_k=ws.top_k, recipe=folder.recipe_label, size_bytes=folder.weights_bytes,
        bytes_per_token=ws.bytes_per_token, context_max=context_limit(model))
