"""pocket-mlx's terminal chat (Textual). `ChatApp` lives in `app`; imported lazily so that the
Textual-free parts (`model_info`, `saved`) load without Textual. The chat's model side (the
session, its settings, the saved conversations) lives in pocket_mlx/engine/."""

from __future__ import annotations

__all__ = ["ChatApp"]


def __getattr__(name: str):
    if name == "ChatApp":
        from pocket_mlx.tui.app import ChatApp

        return ChatApp
    raise AttributeError(name)
