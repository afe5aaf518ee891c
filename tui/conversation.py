"""The conversation pane: user prompts, Markdown replies that stream in (a thinking model's
reasoning above its reply, dimmed and collapsible), one-line notices."""

from __future__ import annotations

from markdown_it import MarkdownIt
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownBlock

from pocket_mlx.tui.textual_private import SteadySize

FINISH_NOTICES = {
    "cancelled": "■ stopped — the partial reply is kept",
    "length": "■ reached the max-tokens limit ({max_tokens} tokens)",
    "context": "■ stopped: context full — the next message drops the oldest turns",
}


def finish_notice(reason: str | None, max_tokens: int | None = None) -> str | None:
    """The line shown under a reply that did not end by itself, else None."""
    text = FINISH_NOTICES.get(reason or "")
    return text.format(max_tokens=max_tokens if max_tokens is not None else "?") if text else None


_STEADY: dict[type, type] = {}


def steady(cls: type) -> type:
    """`cls` with `SteadySize` (one subclass per class, same name so the same CSS applies)."""
    if cls not in _STEADY:
        _STEADY[cls] = type(cls.__name__, (SteadySize, cls), {"__module__": cls.__module__})
    return _STEADY[cls]


class UserMessage(SteadySize, Static):
    """A prompt as typed (no markup interpretation)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False)
        self.border_title = "you"


def _parser() -> MarkdownIt:
    """GFM with line breaks kept: verses, poems and unfenced code are written line by line.

    markdown-it's `breaks` option only changes its HTML renderer; Textual draws the tokens itself
    and shows a soft break as a space, so soft breaks are turned into hard ones here."""
    md = MarkdownIt("gfm-like")
    md.core.ruler.push("keep_line_breaks", _hard_breaks)
    return md


def _hard_breaks(state) -> None:
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


def _stream_parser() -> MarkdownIt:
    """The same without linkify, while a reply streams in: every append re-parses the last block,
    and linkify is ~90% of that parse (9 ms vs 1 ms for a 60-line paragraph). Links are made
    when the reply ends (`AssistantMessage.finish`)."""
    return _parser().disable("linkify")


def thought_title(seconds: float, tokens: int, done: bool) -> str:
    """The reasoning block's title: "thought for 12 s, 340 tokens" (while it streams:
    "thinking… 3.1 s, 42 tokens")."""
    when = f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    count = f"{tokens:,} token{'' if tokens == 1 else 's'}"
    return f"thought for {when}, {count}" if done else f"thinking… {when}, {count}"


class ThoughtBlock(Collapsible):
    """A reply's reasoning, dimmed, open while it streams and collapsed once the answer starts
    (enter or a click on its title opens it again)."""

    def __init__(self, text: str = "", title: str = "thinking…", collapsed: bool = False) -> None:
        self.body = Static(text, markup=False, classes="thought-text")
        super().__init__(self.body, title=title, collapsed=collapsed)
        self.text = text

    def write(self, fragment: str) -> None:
        if fragment:
            self.text += fragment
            self.body.update(self.text)


class AssistantMessage(SteadySize, Markdown):
    """A reply, rendered as Markdown; `streaming` while tokens are arriving.

    The app already batches text (a few appends a second), so fragments go straight to
    `Markdown.append` rather than through a `MarkdownStream`: no extra task whose appends would
    land outside the app's tick and cost a compositor pass of their own."""

    def __init__(self, text: str = "", title: str = "assistant") -> None:
        super().__init__(text, parser_factory=self._make_parser)
        self.border_title = title
        self.streaming = False
        self.text = text
        self._stream_md: MarkdownIt | None = None
        self.thought: ThoughtBlock | None = None  # the reasoning above it, if any

    @property
    def reasoning(self) -> str:
        return self.thought.text if self.thought is not None else ""

    async def think(self, fragment: str) -> None:
        """Reasoning, streamed into the block above the reply (mounted on the first piece)."""
        if not fragment:
            return
        if self.thought is None:
            self.thought = ThoughtBlock()
            await self.parent.mount(self.thought, before=self)
        self.thought.write(fragment)

    def show_thought(self, seconds: float, tokens: int, done: bool) -> None:
        """The block's title; collapsed once the reasoning is done and an answer follows."""
        if self.thought is not None:
            self.thought.title = thought_title(seconds, tokens, done)
            if done and self.text:
                self.thought.collapsed = True

    async def discard(self) -> None:
        """Remove the reply and its reasoning (a turn taken back)."""
        if self.thought is not None:
            await self.thought.remove()
        await self.remove()

    def get_block_class(self, block_name: str) -> type[MarkdownBlock]:
        return steady(super().get_block_class(block_name))

    def _make_parser(self) -> MarkdownIt:
        # Textual asks for a parser on every append: building one costs about as much as parsing
        # the last block, so the streaming one is made once per reply.
        if not self.streaming:
            return _parser()
        if self._stream_md is None:
            self._stream_md = _stream_parser()
        return self._stream_md

    def start_stream(self) -> None:
        self.streaming = True
        self.add_class("streaming")

    async def write(self, fragment: str) -> None:
        if not fragment:
            return
        self.text += fragment  # before any await: appends keep the order of the calls
        await self.append(fragment)

    async def finish(self) -> None:
        """End streaming; render once more with links if the text has any (after decode)."""
        if self.streaming:
            self.streaming = False
            parser = _parser()
            if parser.linkify.test(self.text):
                await self.update(self.text)
        self.remove_class("streaming")


class Notice(SteadySize, Static):
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

    async def add_assistant(self, text: str = "", title: str = "assistant",
                            reasoning: str = "", stats: dict | None = None) -> AssistantMessage:
        """A reply; a saved one's reasoning (with its `stats`) goes above it, collapsed."""
        widget = AssistantMessage(text, title)
        if reasoning:
            stats = stats or {}
            widget.thought = ThoughtBlock(reasoning, collapsed=True, title=thought_title(
                stats.get("reasoning_s", 0.0), stats.get("reasoning_tokens", 0), True))
            await self.mount(widget.thought)
        await self.mount(widget)
        return widget

    async def add_notice(self, text: str, classes: str = "") -> Notice:
        widget = Notice(text, classes)
        await self.mount(widget)
        return widget

    async def add_notice_before(self, text: str, before: Widget | None,
                                classes: str = "") -> Notice:
        """A notice above `before` (the reply being written), or at the end."""
        widget = Notice(text, classes)
        if before is not None and before.parent is self:
            await self.mount(widget, before=before)
        else:
            await self.mount(widget)
        return widget

    async def remove_last_user(self) -> None:
        """Drop the last prompt and everything after it (a turn that got no reply)."""
        children = list(self.children)
        for i in range(len(children) - 1, -1, -1):
            if isinstance(children[i], UserMessage):
                await self.remove_children(children[i:])
                return

    async def remove_last_reply(self) -> None:
        """Drop the last assistant message and any notices after it (for regenerate)."""
        children = list(self.children)
        for i in range(len(children) - 1, -1, -1):
            if isinstance(children[i], AssistantMessage):
                if i and isinstance(children[i - 1], ThoughtBlock):
                    i -= 1
                await self.remove_children(children[i:])
                return

    async def clear(self) -> None:
        await self.remove_children()
