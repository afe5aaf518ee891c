"""The chat TUI with a thinking model (tests/fixtures/think-model, Qwen3.5's template), driven
by Textual's Pilot: the reasoning streams apart from the answer in a collapsible block, titled
"thought for N s, M tokens" and collapsed once the answer is there; ctrl+t and the settings
switch thinking off/on for the next reply; the panel counts reasoning and answer tokens apart;
saved conversations keep the reasoning and show it again when resumed."""

from __future__ import annotations

import asyncio
import sys

import pytest
from conftest import ROOT
from test_tui import send, until
from textual.app import App
from textual.widgets import Select

from pocket_mlx.engine.conversations import ConversationStore
from pocket_mlx.engine.session import Settings
from pocket_mlx.tui.app import ChatApp
from pocket_mlx.tui.conversation import AssistantMessage, ConversationView, ThoughtBlock
from pocket_mlx.tui.screens import SettingsScreen
from pocket_mlx.tui.stats_panel import token_split

sys.path.insert(0, str(ROOT / "scripts"))
import make_think_model as tm  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "think-model"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_MLX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(scenario, **kw) -> ChatApp:
    kw.setdefault("settings", Settings(max_tokens=60))
    app = ChatApp(model=str(FIXTURE), device="cpu", **kw)

    async def main() -> None:
        async with app.run_test(size=(100, 40)) as pilot:
            await until(pilot, lambda: app.ready)
            await scenario(app, pilot)

    asyncio.run(main())
    return app


def replies(app: ChatApp) -> list[tuple[str, str, bool | None]]:
    """(reasoning, answer, collapsed) of each reply on screen, in order."""
    return [(r.reasoning, r.text, r.thought.collapsed if r.thought else None)
            for r in app.query(AssistantMessage)]


def test_reasoning_apart_collapsed_and_saved():
    async def scenario(app, pilot):
        await send(app, pilot, "What is 2 + 3?")
        assert replies(app) == [(tm.ADD_REASONING, tm.ADD_ANSWER, True)]
        (block,) = app.query(ThoughtBlock)
        title = str(block.title)
        assert title.startswith("thought for ") and title.endswith(" tokens")
        s = app.last_stats
        assert f"{s.reasoning_tokens} tokens" in title and s.reasoning_s > 0
        assert token_split(s) == [(" thought", str(s.reasoning_tokens)),
                                  (" answer", str(s.generation_tokens - s.reasoning_tokens))]
        # The second turn renders the first without its reasoning, as Qwen3.5's template does.
        await send(app, pilot, "And 4 + 4?")
        assert replies(app)[1] == (tm.MORE_REASONING, tm.MORE_ANSWER, True)

    app = run(scenario)
    saved = ConversationStore().load(app.conversation.id)
    first = saved.messages[1]
    assert (first["reasoning"], first["content"]) == (tm.ADD_REASONING, tm.ADD_ANSWER)
    assert first["stats"]["reasoning_tokens"] > 0
    assert saved.chat_messages()[1] == {"role": "assistant", "content": tm.ADD_ANSWER}

    async def resumed(app, pilot):
        assert replies(app) == [(tm.ADD_REASONING, tm.ADD_ANSWER, True),
                                (tm.MORE_REASONING, tm.MORE_ANSWER, True)]
        assert str(app.query(ThoughtBlock).first().title).startswith("thought for ")

    run(resumed, conversation=saved)


def test_ctrl_t_switches_thinking_for_the_next_reply():
    async def scenario(app, pilot):
        assert app.info.thinking_switch
        await pilot.press("ctrl+t")
        assert app.settings.thinking is False
        await send(app, pilot, "Name a colour.")
        assert replies(app) == [("", tm.COLOUR_DIRECT, None)] and not app.query(ThoughtBlock)
        assert app.last_stats.reasoning_tokens == 0
        await pilot.press("ctrl+t")
        assert app.settings.thinking is True
        await pilot.press("ctrl+n")
        await send(app, pilot, "Name a colour.")
        assert replies(app) == [(tm.COLOUR_REASONING, tm.COLOUR_ANSWER, True)]
        assert [n.message for n in app._notifications][-3:-1] == [
            "Thinking off for replies.", "Thinking on for replies."]

    run(scenario)


def test_settings_dialog_sets_thinking():
    async def scenario(app, pilot):
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        select = app.screen.query_one("#thinking", Select)
        assert select.value == "auto"
        select.value = "off"
        await pilot.click("#save")
        await until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert app.settings.thinking is False
        await send(app, pilot, "What is 2 + 3?")
        assert replies(app) == [("", tm.ADD_DIRECT, None)]

    app = run(scenario)
    assert ConversationStore().load(app.conversation.id).settings["thinking"] is False


def test_a_block_never_closed_stays_open_and_is_kept():
    """Max tokens inside the reasoning: no answer, the reasoning shown (not collapsed) and
    saved; regenerate replaces the reply with its reasoning."""
    async def scenario(app, pilot):
        await send(app, pilot, "What is 2 + 3?")
        ((reasoning, text, collapsed),) = replies(app)
        assert tm.ADD_REASONING.startswith(reasoning) and reasoning and text == ""
        assert collapsed is False and app.last_stats.finish_reason == "length"
        await pilot.press("ctrl+r")
        await until(pilot, lambda: app.replies_done == 2)
        assert len(app.query(ThoughtBlock)) == 1 and len(replies(app)) == 1

    app = run(scenario, settings=Settings(max_tokens=5))
    (_, answer) = ConversationStore().load(app.conversation.id).messages
    assert answer["content"] == "" and answer["reasoning"]


def test_thought_block_open_while_thinking_collapsed_once_answering():
    class One(App):
        def compose(self):
            yield ConversationView()

    async def main():
        app = One()
        async with app.run_test(size=(80, 24)) as pilot:
            reply = await app.query_one(ConversationView).add_assistant()
            await reply.think("Let me see")
            reply.show_thought(1.25, 3, done=False)
            await pilot.pause()
            assert reply.thought.collapsed is False
            assert str(reply.thought.title) == "thinking… 1.2 s, 3 tokens"
            await reply.write("Five.")
            reply.show_thought(12.4, 340, done=True)
            assert reply.thought.collapsed is True
            assert str(reply.thought.title) == "thought for 12 s, 340 tokens"
            await reply.discard()
            await pilot.pause()
            assert not app.query(ThoughtBlock) and not app.query(AssistantMessage)

    asyncio.run(main())


def test_saved_reasoning_of_the_wrong_type_is_dropped_with_a_warning():
    from pocket_mlx.engine.conversations import Conversation

    conv = Conversation.from_dict({"id": "x", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning": 5}]})
    assert "reasoning" not in conv.messages[1]
    assert conv.warnings == ["message 2: reasoning is not text (5); dropped"]
    old = Conversation.from_dict({"id": "y", "settings": {"max_tokens": 8}, "messages": []})
    assert Settings.from_dict(old.settings).thinking is None
