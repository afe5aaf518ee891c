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
    """The reply ended (stats.finish_reason says how) or failed (`error`); `refused`: the turn
    was not even started (it cannot fit the model's context)."""

    def __init__(self, text: str, stats: GenerationStats | None, context: int,
                 error: str | None = None, refused: bool = False, reasoning: str = "") -> None:
        super().__init__()
        self.text, self.stats, self.context, self.error = text, stats, context, error
        self.refused = refused
        self.reasoning = reasoning  # reasoning not yet handed over through LiveReply


class ContextTrimmed(Message):
    """The oldest messages were dropped from the model's context for this turn."""

    def __init__(self, dropped: int, left_out: int) -> None:
        super().__init__()
        self.dropped, self.left_out = dropped, left_out


class ContextMeasured(Message):
    """How many tokens the model holds for conversation `conv_id` (after it was opened)."""

    def __init__(self, conv_id: str, tokens: int) -> None:
        super().__init__()
        self.conv_id, self.tokens = conv_id, tokens


class EngineNotice(Message):
    """A warning from the engine (e.g. the wired-memory hint) to show as a notification."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
