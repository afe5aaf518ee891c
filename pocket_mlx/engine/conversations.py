"""Saved chat conversations: one JSON file per conversation in the user data folder.

Why its own module, free of Textual: the CLI checks `--resume ID` before any UI starts, and tests
exercise saving and loading without a terminal. Writes go to a temp file then `os.replace`, so a
kill at any moment leaves either the previous or the new version, never half a file. Corrupt
files are reported and skipped; nothing here ever deletes or overwrites them.

Files are hand-editable JSON, so everything read back is checked here, before any UI sees it:
settings with a bad value refuse the file (one line naming the setting and the file); a reply's
`stats` are only a record of how it was written, so bad ones are dropped with a warning
(`Conversation.warnings`) rather than costing the user the conversation.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from pocket_mlx.engine.params import check_max_tokens, check_temperature, check_top_p, valid
from pocket_mlx.errors import PocketError
from pocket_mlx.paths import data_dir

FORMAT_VERSION = 1
class CorruptConversation(PocketError):
    """A conversation file exists but cannot be read back; it is left untouched."""


class InvalidSetting(ValueError):
    """A saved setting of the wrong type or out of range (or unknown)."""

    def __init__(self, name: str, value: Any, known: bool = True) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:39] + "…"
        super().__init__(f"{'invalid' if known else 'unknown'} setting {name}={shown}")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The settings a conversation saves (engine.session.Settings) and what each may hold: the ranges
# of engine/params.py, so a file that passes here resumes without another error.
SETTING_CHECKS: dict[str, Callable[[Any], bool]] = {
    "system": lambda v: isinstance(v, str),
    "temperature": partial(valid, check_temperature),
    "top_p": partial(valid, check_top_p),
    "max_tokens": partial(valid, check_max_tokens),
    "thinking": lambda v: v is None or isinstance(v, bool),  # on / off / the template's default
}

# A reply's stats (engine.generation.GenerationStats.to_dict) by type; unknown keys are kept.
STATS_CHECKS: dict[str, Callable[[Any], bool]] = {
    **{k: lambda v: _integer(v) and v >= 0 for k in (
        "prompt_tokens", "generation_tokens", "bytes_per_token", "prefill_done",
        "reasoning_tokens")},
    **{k: lambda v: _number(v) and v >= 0 for k in (
        "prompt_tps", "ttft_s", "generation_tps", "peak_memory_gb", "reasoning_s")},
    "device": lambda v: v in ("cpu", "gpu"),
    "phase": lambda v: isinstance(v, str),
    "finish_reason": lambda v: v is None or isinstance(v, str),
}


def check_settings(settings: Any) -> dict:
    """The settings dict if every key is known and every value valid, else InvalidSetting."""
    if not isinstance(settings, dict):
        raise ValueError("malformed settings")
    for name, value in settings.items():
        check = SETTING_CHECKS.get(name)
        if check is None:
            raise InvalidSetting(name, value, known=False)
        if not check(value):
            raise InvalidSetting(name, value)
    return settings


def clean_stats(stats: Any, where: str, warnings: list[str]) -> dict | None:
    """A reply's stats with wrong-typed fields dropped (each noted in `warnings`); None if it is
    not an object at all."""
    if stats is None:
        return None
    if not isinstance(stats, dict):
        warnings.append(f"{where}: stats is not an object ({stats!r:.40}); dropped")
        return None
    bad = [k for k, v in stats.items() if k in STATS_CHECKS and not STATS_CHECKS[k](v)]
    if bad:
        warnings.append(f"{where}: bad stats field{'s' if len(bad) > 1 else ''} "
                        f"{', '.join(bad)}; dropped")
    return {k: v for k, v in stats.items() if k not in bad}


@dataclass
class Conversation:
    """What a chat needs to resume: model, settings, messages (assistant ones with stats, and
    with `reasoning`: the thinking of a reasoning model, kept apart from its `content`)."""

    id: str
    model: str = ""
    settings: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    # What loading fixed (bad stats dropped), for the app to show; never saved.
    warnings: list[str] = field(default_factory=list, compare=False)

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
        settings = check_settings(data.get("settings") or {})
        warnings: list[str] = []
        for i, m in enumerate(msgs):
            if "reasoning" in m and not isinstance(m["reasoning"], str):
                warnings.append(f"message {i + 1}: reasoning is not text "
                                f"({m['reasoning']!r:.40}); dropped")
                del m["reasoning"]
            if "stats" in m:
                stats = clean_stats(m["stats"], f"message {i + 1}", warnings)
                if stats is None:
                    del m["stats"]
                else:
                    m["stats"] = stats
        times = [data.get(k, 0.0) for k in ("created", "updated")]
        if not all(_number(t) for t in times):
            raise ValueError("malformed created/updated times")
        if not isinstance(data.get("model", ""), str):
            raise ValueError("malformed model")
        return cls(id=data["id"], model=data.get("model", ""), settings=settings,
                   messages=msgs, created=float(times[0]), updated=float(times[1]),
                   warnings=warnings)


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

    def remove(self, conv_id: str) -> None:
        """Delete a conversation's file: only for one this app made and emptied again (a first
        message that was refused), never for a file it could not read."""
        try:
            self.path_for(conv_id).unlink()
        except FileNotFoundError:
            pass

    @staticmethod
    def _read(path: Path) -> Conversation:
        try:
            conv = Conversation.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except InvalidSetting as e:
            raise CorruptConversation(f"conversation {path.stem} has an {e}; fix or delete "
                                      f"{path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError,
                RecursionError) as e:
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
