"""Saved chat conversations: one JSON file per conversation in the user data folder.

Why its own module, free of Textual: the CLI checks `--resume ID` before any UI starts, and tests
exercise saving and loading without a terminal. Writes go to a temp file then `os.replace`, so a
kill at any moment leaves either the previous or the new version, never half a file. Corrupt
files are reported and skipped; nothing here ever deletes or overwrites them.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pocket_mlx.errors import PocketError

FORMAT_VERSION = 1
HOME_ENV = "POCKET_MLX_HOME"


def data_dir() -> Path:
    """pocket-mlx's user data folder: $POCKET_MLX_HOME, else the platform's usual place."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "pocket-mlx"
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "pocket-mlx"


class CorruptConversation(PocketError):
    """A conversation file exists but cannot be read back; it is left untouched."""


@dataclass
class Conversation:
    """What a chat needs to resume: model, settings, messages (assistant ones with stats)."""

    id: str
    model: str = ""
    settings: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    @property
    def title(self) -> str:
        """First user prompt, one line: what the open dialog lists."""
        first = next((m["content"] for m in self.messages if m.get("role") == "user"), "")
        line = " ".join(first.split())
        return (line[:60] + "…") if len(line) > 60 else (line or "(empty)")

    def chat_messages(self) -> list[dict]:
        """Messages as the chat template wants them: role and content only."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "id": self.id, "model": self.model,
                "settings": self.settings, "messages": self.messages,
                "created": self.created, "updated": self.updated}

    @classmethod
    def from_dict(cls, data: dict) -> Conversation:
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ValueError("not a conversation object")
        msgs = data.get("messages", [])
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
            and isinstance(m.get("content"), str) for m in msgs
        ):
            raise ValueError("malformed messages")
        settings = data.get("settings") or {}
        if not isinstance(settings, dict):
            raise ValueError("malformed settings")
        return cls(id=data["id"], model=str(data.get("model", "")), settings=settings,
                   messages=msgs, created=float(data.get("created", 0.0)),
                   updated=float(data.get("updated", 0.0)))


def new_id() -> str:
    """Sortable by time, unique enough for one user: 20261130-021311-3fa2."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


class ConversationStore:
    """The folder of conversation files (`<data_dir>/conversations/<id>.json`)."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else data_dir() / "conversations"

    def path_for(self, conv_id: str) -> Path:
        if not conv_id or "/" in conv_id or "\\" in conv_id or conv_id.startswith("."):
            raise PocketError(f"invalid conversation id {conv_id!r}")
        return self.root / f"{conv_id}.json"

    def save(self, conv: Conversation) -> Path:
        """Write atomically (temp file in the same folder, fsync, os.replace)."""
        conv.updated = time.time()
        path = self.path_for(conv.id)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{conv.id}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(conv.to_dict(), f, ensure_ascii=False, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    def load(self, conv_id: str) -> Conversation:
        """The conversation, or PocketError (unknown id) / CorruptConversation (unreadable)."""
        path = self.path_for(conv_id)
        if not path.is_file():
            raise PocketError(f"no saved conversation {conv_id!r} in {self.root}")
        return self._read(path)

    @staticmethod
    def _read(path: Path) -> Conversation:
        try:
            conv = Conversation.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError) as e:
            raise CorruptConversation(f"conversation file {path} is corrupt ({e}); "
                                      "left as is") from None
        if conv.id != path.stem:
            raise CorruptConversation(f"conversation file {path} holds id {conv.id!r}; left as is")
        return conv

    def list(self) -> tuple[list[Conversation], list[str]]:
        """All readable conversations, newest first, and one error line per corrupt file."""
        if not self.root.is_dir():
            return [], []
        convs, errors = [], []
        for path in sorted(self.root.glob("*.json")):
            try:
                convs.append(self._read(path))
            except CorruptConversation as e:
                errors.append(str(e))
        convs.sort(key=lambda c: c.updated, reverse=True)
        return convs, errors
