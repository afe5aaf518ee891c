"""Messages the engine thread posts to the UI: the only way generation state reaches widgets."""

from __future__ import annotations

from textual.message import Message

from pocket_mlx.engine.generation import GenerationStats
from pocket_mlx.tui.model_info import ModelInfo


class ModelReady(Message):
    def __init__(self, info: ModelInfo) -> None:
        super().__init__()
        self.info = info


class ModelFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class PrefillProgress(Message):
    def __init__(self, done: int, total: int, context: int) -> None:
        super().__init__()
        self.done, self.total, self.context = done, total, context


class ReplyDone(Message):
    """The reply ended (stats.finish_reason says how) or failed (`error`)."""

    def __init__(self, text: str, stats: GenerationStats | None, context: int,
                 error: str | None = None) -> None:
        super().__init__()
        self.text, self.stats, self.context, self.error = text, stats, context, error


class EngineNotice(Message):
    """A warning from the engine (e.g. the wired-memory hint) to show as a notification."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
