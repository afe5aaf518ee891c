"""The chat's side of thinking models: the switch (ctrl+t, and the settings dialog) and the
reasoning streamed apart from the reply.

Why apart from the app: it is one feature across the app's tick, its reply's end and a key,
and the app (tui/app.py) is the UI's wiring; its helpers here take the app's parts they need.
"""

from __future__ import annotations

from dataclasses import replace

from pocket_mlx.engine.generation import GenerationStats
from pocket_mlx.tui.conversation import AssistantMessage
from pocket_mlx.tui.jobs import LiveReply


async def write_live(reply: AssistantMessage, live: LiveReply,
                     stats: GenerationStats | None) -> None:
    """The reasoning and reply text the engine published since the last tick, and the
    reasoning block's title (collapsed once the answer has started)."""
    await reply.think(live.take_reasoning())
    await reply.write(live.take_text())
    if stats is not None and reply.thought is not None:
        reply.show_thought(stats.reasoning_s, stats.reasoning_tokens, done=bool(reply.text))


def saved_reply(reply: AssistantMessage, stats: GenerationStats) -> dict:
    """The assistant message a conversation saves: the answer as `content`, the reasoning
    apart (engine/conversations.py)."""
    message = {"role": "assistant", "content": reply.text}
    if reply.reasoning:
        message["reasoning"] = reply.reasoning
    message["stats"] = stats.to_dict()
    return message


class ThinkingSwitch:
    """Mixin for the app: thinking on/off for the next replies (the chat template's
    `enable_thinking`; Settings.thinking, saved with the conversation)."""

    def action_toggle_thinking(self) -> None:
        info = self.info
        if info is not None and not info.thinking_switch:
            self.notify("This model's chat template has no thinking switch (enable_thinking).",
                        title="Thinking", severity="warning")
            return
        on = self.settings.thinking is False  # auto (the template's default: on) -> off
        self.settings = replace(self.settings, thinking=on)
        self._save()
        when = "the next reply" if self.busy else "replies"
        self.notify(f"Thinking {'on' if on else 'off'} for {when}.", title="Thinking")
