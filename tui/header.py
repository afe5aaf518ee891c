"""One-line model header: name, parameters, quantization recipe, size as stored."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from pocket_mlx.tui.model_info import ModelInfo

SEPARATOR = ("  ·  ", "dim")


class ModelHeader(Static):
    def show_loading(self, name: str) -> None:
        self.update(Text.assemble(("pocket-mlx ", "bold"), f"loading {name}…"))

    def show_model(self, info: ModelInfo) -> None:
        parts: list = [("pocket-mlx ", "bold"), (info.name, "bold cyan")]
        for part in info.header_parts():
            parts += [SEPARATOR, part]
        self.update(Text.assemble(*parts))
