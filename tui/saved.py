"""The conversation files the chat app writes: new conversations, saves after each turn, and
a conversation removed again when its only message is taken back (engine/conversations.py's
store does the writing).

Why apart from the app: this is bookkeeping, not UI; a failure comes back as a line for the
app to show (a chat never stops because a file could not be written).
"""

from __future__ import annotations

from pocket_mlx.engine.conversations import Conversation, ConversationStore, new_id
from pocket_mlx.engine.session import Settings
from pocket_mlx.errors import PocketError


class SavedChats:
    def __init__(self, store: ConversationStore, model_ref: str | None) -> None:
        self.store = store
        self.model_ref = model_ref  # as the user named it: saved with new ones (--resume)
        self._made: set[str] = set()  # ids of the conversations this app created

    def new(self, settings: Settings) -> Conversation:
        conv = Conversation(id=new_id(), model=str(self.model_ref or ""),
                            settings=settings.to_dict())
        self._made.add(conv.id)
        return conv

    def save(self, conv: Conversation, settings: Settings) -> str | None:
        """Write `conv` (with `settings`) unless it is empty; the error, if any."""
        if not conv.messages:
            return None
        conv.settings = settings.to_dict()
        try:
            self.store.save(conv)
        except (OSError, PocketError) as e:
            return f"could not save the conversation: {e}"
        return None

    @staticmethod
    def settings_of(conv: Conversation) -> Settings | None:
        """The settings saved with `conv`; None when they are not valid."""
        try:
            settings = Settings.from_dict(conv.settings)
            settings.validate()
        except (ValueError, TypeError, PocketError):
            return None
        return settings

    def forget_if_empty(self, conv: Conversation) -> str | None:
        """Remove `conv`'s file when its only message was taken back and this app made it (no
        empty conversation left behind); the error, if any."""
        if conv.messages or conv.id not in self._made:
            return None
        try:
            self.store.remove(conv.id)
        except (OSError, PocketError) as e:
            return f"could not remove the empty conversation: {e}"
        return None
