"""The chat app's keys, its command-palette entries and its help list, in one place: the app
(tui/app.py) binds them; what each one does stays an `action_*` of the app."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from textual.app import App, SystemCommand
from textual.binding import Binding

KEYS = [
    Binding("escape", "stop", "Stop", tooltip="stop the reply, keep what was written"),
    Binding("ctrl+g", "toggle_device", "GPU/CPU",
            tooltip="switch GPU <-> CPU for the next reply (no reload)"),
    Binding("ctrl+n", "new_chat", "New", tooltip="start a new conversation"),
    Binding("ctrl+r", "regenerate", "Regenerate", tooltip="write the last reply again"),
    Binding("ctrl+o", "open_chat", "Open", tooltip="open a saved conversation"),
    Binding("ctrl+t", "toggle_thinking", "Thinking",
            tooltip="thinking on/off for the next replies (thinking models)"),
    Binding("ctrl+s", "settings", "Settings",
            tooltip="system prompt, temperature, top-p, max tokens, thinking"),
    Binding("f1", "help", "Help", tooltip="this list of keys"),
    Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="quit (everything is saved)"),
]


def help_keys(bindings: Iterable) -> list[tuple[str, str]]:
    """(key, what it does) for the help screen: the bindings, then the palette's key."""
    keys = [(b.key, b.tooltip or b.description) for b in bindings if isinstance(b, Binding)]
    keys.append(("ctrl+p", "command palette (every action by name)"))
    return keys


def system_commands(app) -> Iterator[SystemCommand]:
    """The chat's entries in Textual's command palette (after Textual's own)."""
    yield SystemCommand("Stop generation", "Stop the reply, keep what was written",
                        app.action_stop)
    yield SystemCommand("Switch device", "GPU <-> CPU for the next reply",
                        app.action_toggle_device)
    yield SystemCommand("New conversation", "Start over", app.action_new_chat)
    yield SystemCommand("Regenerate", "Write the last reply again", app.action_regenerate)
    yield SystemCommand("Open conversation", "Load a saved conversation", app.action_open_chat)
    yield SystemCommand("Thinking on/off", "Thinking models: reason before the next replies "
                        "or not", app.action_toggle_thinking)
    yield SystemCommand("Settings", "System prompt, temperature, top-p, max tokens, thinking",
                        app.action_settings)
    yield SystemCommand("Keys", "Show every key", app.action_help)


@contextmanager
def one_frame(app: App) -> Iterator[None]:
    """What is done inside (awaits included) reaches the screen in one compositor pass, with
    at most one layout, instead of one per widget it touches."""
    with app.batch_update():
        yield
    # The screens saw those repaints while the batch held them back, and ending a batch
    # does not tell them: without this they would wait for the next repaint's prompt.
    for screen in app.screen_stack:
        screen.check_idle()
