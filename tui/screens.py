"""Modal screens: help, settings, and the list of saved conversations."""

from __future__ import annotations

import time

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option

from pocket_mlx.engine.conversations import Conversation
from pocket_mlx.engine.reasoning import parse_reasoning_mode
from pocket_mlx.engine.session import Settings
from pocket_mlx.errors import PocketError

PROMPT_KEYS = [
    ("enter", "send the prompt"),
    ("ctrl+j / shift+enter", "new line in the prompt"),
    ("up / down", "recall earlier prompts"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, what in PROMPT_KEYS + self.keys:
            table.add_row(key, what)
        with Vertical(id="help-box", classes="dialog"):
            yield Label("Keys", classes="dialog-title")
            yield Static(table)
            yield Label("escape closes this help", classes="dialog-hint")


# Thinking models: the template's default, or enable_thinking on / off (Settings.thinking).
THINKING = ("auto", "on", "off")


class SettingsScreen(ModalScreen[Settings | None]):
    """Edit the system prompt and sampling; dismisses with new Settings, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="settings-box", classes="dialog"):
            yield Label("Settings", classes="dialog-title")
            yield Label("System prompt")
            yield Input(s.system, placeholder="(none)", id="system")
            with Horizontal(classes="fields"):
                with Vertical():
                    yield Label("Temperature")
                    yield Input(str(s.temperature), type="number", id="temperature")
                with Vertical():
                    yield Label("Top-p")
                    yield Input(str(s.top_p), type="number", id="top_p")
                with Vertical():
                    yield Label("Max tokens")
                    yield Input(str(s.max_tokens), type="integer", id="max_tokens")
                with Vertical():
                    yield Label("Thinking")
                    yield Select([(m, m) for m in THINKING], allow_blank=False, id="thinking",
                                 value={None: "auto", True: "on", False: "off"}[s.thinking])
            yield Static("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_input_submitted(self) -> None:
        self._save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self._save()
        else:
            self.dismiss(None)

    def _save(self) -> None:
        def value(name: str) -> str:
            return self.query_one(f"#{name}", Input).value.strip()

        try:
            new = Settings(system=self.query_one("#system", Input).value,
                           temperature=float(value("temperature") or 0),
                           top_p=float(value("top_p") or 1),
                           max_tokens=int(value("max_tokens") or 0),
                           thinking=parse_reasoning_mode(
                               str(self.query_one("#thinking", Select).value)))
            new.validate()
        except (ValueError, PocketError) as e:
            self.query_one("#settings-error", Static).update(Text(str(e), style="bold red"))
            return
        self.dismiss(new)


class OpenScreen(ModalScreen[str | None]):
    """Pick a saved conversation; dismisses with its id, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__()
        self.conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical(id="open-box", classes="dialog"):
            yield Label("Open a saved conversation", classes="dialog-title")
            if self.conversations:
                yield OptionList(*[self._option(c) for c in self.conversations], id="open-list")
            else:
                yield Label("No saved conversations yet.")
            yield Label("enter opens · escape cancels", classes="dialog-hint")

    @staticmethod
    def _option(c: Conversation) -> Option:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
        n = sum(1 for m in c.messages if m.get("role") == "assistant")
        label = Text.assemble((when, "dim"), "  ", c.title,
                              (f"  ({n} repl{'y' if n == 1 else 'ies'})", "dim"))
        return Option(label, id=c.id)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)
