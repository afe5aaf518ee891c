"""The prompt box: Enter sends, ctrl+j (or shift+enter) adds a line, Up/Down walk history."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, compact=True)
        self.prompts: list[str] = []
        self._browse: int | None = None  # index into history while recalling
        self._draft = ""

    def remember(self, text: str) -> None:
        if text and (not self.prompts or self.prompts[-1] != text):
            self.prompts.append(text)
        self._browse = None

    def on_key(self, event: events.Key) -> None:
        """Enter sends, ctrl+j / shift+enter add a line, Up on the first line and Down on the
        last walk the history. Runs before `TextArea`'s own key handling (Textual calls the
        subclass's handler first), which `_consume` skips: Enter would insert a newline."""
        key = event.key
        if key == "enter":
            self._consume(event)
            text = self.text.strip()
            if text:
                self.post_message(self.Submitted(text))
            return
        if key in ("ctrl+j", "shift+enter"):
            self._consume(event)
            self.insert("\n")
            return
        row = self.cursor_location[0]
        if key == "up" and row == 0 and self.prompts:
            self._consume(event)
            self._recall(-1)
            return
        if key == "down" and self._browse is not None and row == self.document.line_count - 1:
            self._consume(event)
            self._recall(+1)

    @staticmethod
    def _consume(event: events.Key) -> None:
        event.stop()
        event.prevent_default()

    def _recall(self, step: int) -> None:
        if self._browse is None:
            if step > 0:
                return
            self._draft = self.text
            self._browse = len(self.prompts)
        self._browse = max(0, self._browse + step)
        if self._browse >= len(self.prompts):
            self._browse = None
            self.text = self._draft
        else:
            self.text = self.prompts[self._browse]
        self.move_cursor(self.document.end)
