"""One-line model header: name, parameters, experts, quantization recipe, size on disk."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from pocket_mlx.tui.model_info import ModelInfo, human_bytes, human_count


class ModelHeader(Static):
    def show_loading(self, name: str) -> None:
        self.update(Text.assemble(("pocket-mlx ", "bold"), f"loading {name}…"))

    def show_model(self, info: ModelInfo) -> None:
        self.update(Text.assemble(
            ("pocket-mlx ", "bold"), (info.name, "bold cyan"),
            ("  ·  ", "dim"), f"{human_count(info.params_total)} params, "
            f"{human_count(info.params_active)} active",
            ("  ·  ", "dim"), info.experts_label,
            ("  ·  ", "dim"), info.recipe,
            ("  ·  ", "dim"), human_bytes(info.disk_bytes),
        ))
