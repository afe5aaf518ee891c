"""Every override of a private Textual method, in one place.

Why here: a private method may change in any Textual release without notice. Keeping the three
overrides together, with `PRIVATE_API` naming each one's Textual signature, lets one test
(tests/test_tui.py) check them against the installed Textual, and pyproject.toml bounds textual
below its next major version. The app and its widgets take these as mixins and otherwise stay on public API (the prompt
box's keys, for one, go through the public `on_key` and `prevent_default`).
"""

from __future__ import annotations

from rich.segment import Segments
from rich.traceback import Traceback
from textual.app import App
from textual.widget import Widget

#: (class, method) -> the parameter names (self first) its override here was written for. Also
#: used: `App._exit_renderables` (a list) and `App._close_messages_no_wait()` (QuietCrash).
PRIVATE_API: dict[tuple[type, str], tuple[str, ...]] = {
    (App, "_fatal_error"): ("self",),
    (App, "_close_messages_no_wait"): ("self",),
    (Widget, "_size_updated"): ("self", "size", "virtual_size", "container_size", "layout"),
}


class QuietCrash:
    """Mixin for the `App`: on an unexpected exception, Textual's crash report without its local
    variables.

    Textual prints a traceback with every frame's locals, which for the chat is the whole
    conversation (messages, replies) dumped on the terminal. The code and the error are still
    shown."""

    def _fatal_error(self) -> None:
        self.bell()
        traceback = Traceback(show_locals=False, width=None)
        self._exit_renderables.append(
            Segments(self.console.render(traceback, self.console.options))
        )
        self._close_messages_no_wait()


class SteadySize:
    """Mixin for a widget that cannot scroll: when a layout changes its size, it does not ask for
    another layout.

    Textual stores a widget's new size as a reactive that requests a layout, so every append that
    makes the reply taller costs two layouts of the whole screen (the second changes nothing: the
    first already placed everything at the new size). The size is only needed again for
    scrolling, which these widgets do not do. Falls back to the default if the call does not
    look as expected."""

    def _size_updated(self, *args, **kwargs):
        styles = self.styles
        if styles.overflow_x == "hidden" and styles.overflow_y == "hidden":
            if len(args) == 4:
                args = (*args[:3], False)
            elif len(args) == 3:
                kwargs["layout"] = False
        return super()._size_updated(*args, **kwargs)
