"""The conversation pane: user prompts, Markdown replies that stream in, one-line notices."""

from __future__ import annotations

from markdown_it import MarkdownIt
from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

FINISH_NOTICES = {
    "cancelled": "■ stopped — the partial reply is kept",
    "length": "■ reached the max-tokens limit ({max_tokens} tokens)",
    "context": "■ reached the model's context limit",
}


def finish_notice(reason: str | None, max_tokens: int | None = None) -> str | None:
    """The line shown under a reply that did not end by itself, else None."""
    text = FINISH_NOTICES.get(reason or "")
    return text.format(max_tokens=max_tokens if max_tokens is not None else "?") if text else None


class UserMessage(Static):
    """A prompt as typed (no markup interpretation)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False)
        self.border_title = "you"


def _parser() -> MarkdownIt:
    """GFM with line breaks kept: verses, poems and unfenced code are written line by line."""
    return MarkdownIt("gfm-like", {"breaks": True})


class AssistantMessage(Markdown):
    """A reply, rendered as Markdown; `stream` is set while tokens are arriving."""

    def __init__(self, text: str = "", title: str = "assistant") -> None:
        super().__init__(text, parser_factory=_parser)
        self.border_title = title
        self.stream: MarkdownStream | None = None
        self.text = text

    def start_stream(self) -> None:
        self.stream = Markdown.get_stream(self)
        self.add_class("streaming")

    async def write(self, fragment: str) -> None:
        self.text += fragment
        if self.stream is not None:
            await self.stream.write(fragment)

    async def finish(self) -> None:
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None
        self.remove_class("streaming")


class Notice(Static):
    """A one-line remark about the reply above (stopped, limit reached, error)."""

    def __init__(self, text: str, classes: str = "") -> None:
        super().__init__(text, markup=False, classes=classes)


class ConversationView(VerticalScroll):
    """Scrolls with the newest message as long as the user has not scrolled up."""

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        widget = UserMessage(text)
        await self.mount(widget)
        return widget

    async def add_assistant(self, text: str = "", title: str = "assistant") -> AssistantMessage:
        widget = AssistantMessage(text, title)
        await self.mount(widget)
        return widget

    async def add_notice(self, text: str, classes: str = "") -> Notice:
        widget = Notice(text, classes)
        await self.mount(widget)
        return widget

    async def remove_last_reply(self) -> None:
        """Drop the last assistant message and any notices after it (for regenerate)."""
        children = list(self.children)
        for i in range(len(children) - 1, -1, -1):
            if isinstance(children[i], AssistantMessage):
                await self.remove_children(children[i:])
                return

    async def clear(self) -> None:
        await self.remove_children()
