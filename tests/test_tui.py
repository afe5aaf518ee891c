"""The chat TUI, driven headless by Textual's Pilot on the bundled model, on the CPU."""

from __future__ import annotations

import asyncio
import html
import json
import re
import subprocess
import sys
import time

import pytest
from pocket_mlx.tui.app import ChatApp
from pocket_mlx.tui.conversation import AssistantMessage, Notice, UserMessage
from pocket_mlx.tui.session import ChatSession, Settings

from pocket_mlx.conversations import ConversationStore
from pocket_mlx.devices import gpu_available
from pocket_mlx.loader import load

LONG_PROMPT = "def main():"  # the bundled model writes code here without stopping


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_MLX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(scenario, size=(100, 32), **app_kwargs) -> ChatApp:
    """Run `scenario(app, pilot)` inside a headless app once the model is loaded."""
    app_kwargs.setdefault("settings", Settings(max_tokens=8))
    app = ChatApp(device="cpu", **app_kwargs)

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.ready)
            await scenario(app, pilot)

    asyncio.run(main())
    return app


async def until(pilot, cond, timeout: float = 30.0) -> None:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, "timed out"
        await pilot.pause(0.05)


async def send(app: ChatApp, pilot, text: str) -> None:
    """Type a prompt, press Enter, wait for the reply to end."""
    done = app.replies_done
    app.prompt.text = text
    await pilot.press("enter")
    await until(pilot, lambda: app.replies_done > done)


def screen_text(app: ChatApp) -> str:
    """What the terminal shows, as plain text (from the SVG screenshot)."""
    svg = app.export_screenshot()
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")


def notes(app: ChatApp) -> list[str]:
    return [n.message for n in app._notifications]


def test_send_shows_reply_and_stats(home):
    async def scenario(app, pilot):
        await send(app, pilot, "Tell me a fortune")
        replies = list(app.query(AssistantMessage))
        assert len(list(app.query(UserMessage))) == 1 and len(replies) == 1
        assert replies[0].text.strip()
        s = app.last_stats
        assert s.generation_tokens > 0 and s.generation_tps > 0 and s.prompt_tps > 0
        assert s.ttft_s > 0 and s.device == "cpu"
        panel = app.stats_panel
        assert panel.stats is s and panel.context_used > s.prompt_tokens
        assert panel.phase == "idle"
        await pilot.pause(0.3)  # one panel refresh
        text = screen_text(app)
        assert "decode" in text and f"{s.generation_tps:.1f} tok/s" in text
        assert "CPU" in text and "context" in text and "GB/s" in text

    app = run(scenario)
    saved = ConversationStore().load(app.conversation.id)
    assert [m["role"] for m in saved.messages] == ["user", "assistant"]
    assert saved.messages[1]["stats"]["generation_tokens"] == app.last_stats.generation_tokens


def test_second_turn_prefills_only_new_tokens():
    from pocket_mlx.loader import default_model_path
    from pocket_mlx.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    seen = {}

    async def scenario(app, pilot):
        await send(app, pilot, "Tell me a fortune")
        first = app.last_stats
        held = first.prompt_tokens + first.generation_tokens  # what the cache took in
        await send(app, pilot, "And another one")
        full = tok.encode(tok.apply_chat_template(app.conversation.chat_messages()[:-1]),
                          add_special_tokens=False)
        seen.update(first=first, second=app.last_stats, full=len(full), held=held)

    run(scenario)
    assert seen["first"].prompt_tokens > 5
    # Only what the cache lacks: the turn's own tokens, not the whole conversation.
    assert seen["second"].prompt_tokens < seen["full"] - seen["first"].prompt_tokens
    assert abs(seen["second"].prompt_tokens - (seen["full"] - seen["held"])) <= 1


def test_stop_mid_reply_keeps_partial():
    async def scenario(app, pilot):
        done = app.replies_done
        app.prompt.text = LONG_PROMPT
        await pilot.press("enter")
        await until(pilot, lambda: app.stats_panel.stats is not None
                    and app.stats_panel.stats.generation_tokens >= 3)
        await pilot.press("escape")
        await until(pilot, lambda: app.replies_done > done, timeout=5)
        s = app.last_stats
        assert s.finish_reason == "cancelled"
        assert 3 <= s.generation_tokens < 200
        reply = app.conversation.messages[-1]
        assert reply["role"] == "assistant" and reply["content"]
        assert any("stopped" in str(n.render()) for n in app.query(Notice))
        # The conversation goes on from the partial reply, reusing the cache.
        await send(app, pilot, "More")
        assert app.last_stats.prompt_tokens < 20

    run(scenario, settings=Settings(max_tokens=200))


def test_regenerate_replaces_last_reply():
    async def scenario(app, pilot):
        await send(app, pilot, "Tell me a fortune")
        await send(app, pilot, "And another one")
        second_text = app.conversation.messages[-1]["content"]
        second = app.last_stats
        done = app.replies_done
        await pilot.press("ctrl+r")
        await until(pilot, lambda: app.replies_done > done)
        msgs = app.conversation.messages
        assert [m["role"] for m in msgs] == ["user", "assistant"] * 2
        assert len(list(app.query(AssistantMessage))) == 2
        assert msgs[-1]["content"] == second_text  # greedy: the same reply again
        # Rewound to the cache snapshot before the last turn: only that turn is prefilled.
        assert app.last_stats.prompt_tokens == second.prompt_tokens

    run(scenario)


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU notification")
def test_switch_device_without_gpu_notifies_and_stays_on_cpu():
    async def scenario(app, pilot):
        await pilot.press("ctrl+g")
        await pilot.pause(0.1)
        assert any("No GPU" in n for n in notes(app))
        assert app.device == "cpu"
        await send(app, pilot, "Tell me a fortune")
        assert app.last_stats.device == "cpu" and app.last_stats.generation_tokens > 0

    run(scenario)


def test_settings_change_takes_effect():
    async def scenario(app, pilot):
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.screen.__class__.__name__ == "SettingsScreen")
        box = app.screen.query_one("#max_tokens")
        box.value = "3"
        app.screen.query_one("#temperature").value = "0"
        await pilot.click("#save")
        await until(pilot, lambda: app.screen.__class__.__name__ != "SettingsScreen")
        assert app.settings.max_tokens == 3
        await send(app, pilot, LONG_PROMPT)
        assert app.last_stats.generation_tokens <= 3
        assert app.last_stats.finish_reason == "length"
        assert any("max-tokens" in str(n.render()) for n in app.query(Notice))

    app = run(scenario, settings=Settings(max_tokens=50))
    assert ConversationStore().load(app.conversation.id).settings["max_tokens"] == 3


def test_settings_rejects_bad_values():
    async def scenario(app, pilot):
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.screen.__class__.__name__ == "SettingsScreen")
        app.screen.query_one("#top_p").value = "1.5"
        await pilot.click("#save")
        await pilot.pause(0.1)
        assert app.screen.__class__.__name__ == "SettingsScreen"
        assert "top-p" in str(app.screen.query_one("#settings-error").render())
        await pilot.press("escape")
        assert app.settings.top_p == 1.0

    run(scenario)


def test_save_quit_resume_same_messages():
    first = run(lambda app, pilot: _two_turns(app, pilot))
    conv = ConversationStore().load(first.conversation.id)
    assert conv.chat_messages() == first.conversation.chat_messages()
    seen = {}

    async def scenario(app, pilot):
        seen["users"] = [w.render() for w in app.query(UserMessage)]
        seen["replies"] = [w.text for w in app.query(AssistantMessage)]
        await send(app, pilot, "Once more")
        seen["prompt_tokens"] = app.last_stats.prompt_tokens

    resumed = run(scenario, conversation=conv, settings=Settings.from_dict(conv.settings))
    msgs = first.conversation.messages
    assert seen["replies"] == [m["content"] for m in msgs if m["role"] == "assistant"]
    assert [str(u) for u in seen["users"]] == [m["content"] for m in msgs if m["role"] == "user"]
    # A resumed conversation starts from an empty cache: the first turn prefills everything.
    assert seen["prompt_tokens"] > 30
    assert len(ConversationStore().load(conv.id).messages) == 6
    assert resumed.conversation.id == first.conversation.id


async def _two_turns(app, pilot):
    await send(app, pilot, "Tell me a fortune")
    await send(app, pilot, "Write a poem")


def test_open_dialog_reports_corrupt_file_and_opens_good_one(home):
    store = ConversationStore()
    store.root.mkdir(parents=True)
    bad = store.root / "20260101-000000-dead.json"
    bad.write_text("{not json")
    good = run(lambda app, pilot: send(app, pilot, "Tell me a fortune"))

    async def scenario(app, pilot):
        await pilot.press("ctrl+o")
        await until(pilot, lambda: app.screen.__class__.__name__ == "OpenScreen")
        assert any("corrupt" in n for n in notes(app))
        await pilot.press("enter")  # the highlighted (only readable) conversation
        await until(pilot, lambda: app.conversation.id == good.conversation.id)
        assert len(list(app.query(AssistantMessage))) == 1

    run(scenario)
    assert bad.read_text() == "{not json"  # reported, never touched


def test_small_terminal_renders(home):
    async def scenario(app, pilot):
        await send(app, pilot, "Tell me a fortune")
        await pilot.press("f1")
        await pilot.pause(0.1)
        assert app.screen.__class__.__name__ == "HelpScreen"
        assert "ctrl+r" in screen_text(app)
        await pilot.press("escape")
        app.export_screenshot()

    run(scenario, size=(80, 24))


def test_prompt_history_recall():
    async def scenario(app, pilot):
        await send(app, pilot, "Tell me a fortune")
        await pilot.press("up")
        assert app.prompt.text == "Tell me a fortune"
        await pilot.press("down")
        assert app.prompt.text == ""
        await pilot.press("a", "ctrl+j", "b")
        assert app.prompt.text == "a\nb"

    run(scenario)


def test_resume_unknown_id_exits_2(home):
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "chat", "--resume", "nonexistent"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "nonexistent" in lines[0] and "error" in lines[0]
    assert r.stdout == ""


def test_resume_corrupt_id_exits_2_and_keeps_file(home):
    root = home / "conversations"
    root.mkdir(parents=True)
    (root / "broken.json").write_text(json.dumps({"id": "broken", "messages": "oops"}))
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "chat", "--resume", "broken"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "corrupt" in r.stderr
    assert json.loads((root / "broken.json").read_text())["messages"] == "oops"


# ---- the engine's session, without the UI ----------------------------------------------------

@pytest.fixture(scope="module")
def session():
    return ChatSession(*load())


def reply(session, messages, settings=None, **kw):
    text, last = "", None
    for r, _ in session.generate(messages, settings or Settings(max_tokens=6), "cpu", **kw):
        text += r.text
        last = r
    return text, last.stats


def test_session_reuse_regenerate_and_edit(session):
    session.reset()
    turn1 = [{"role": "user", "content": "Tell me a fortune"}]
    a, s1 = reply(session, turn1)
    assert session.plan_kind == "fresh"
    turn2 = turn1 + [{"role": "assistant", "content": a},
                     {"role": "user", "content": "Another"}]
    b, s2 = reply(session, turn2)
    assert session.plan_kind == "cache" and s2.prompt_tokens < s1.prompt_tokens + 6
    b2, s3 = reply(session, turn2)  # regenerate: rewind to the snapshot before turn 2
    assert session.plan_kind == "snapshot" and b2 == b and s3.prompt_tokens == s2.prompt_tokens
    full = len(session.conversation_ids(turn2, "Be kind."))
    _, s4 = reply(session, turn2, Settings(max_tokens=6, system="Be kind."))  # an edit
    assert session.plan_kind == "fresh" and s4.prompt_tokens == full


def test_session_stop_during_prefill_rolls_back(session, exact_kernels):
    # EXACT kernels: FAST mode quantizes activations per call, so a continued cache and a fresh
    # prefill of the same tokens may pick a different greedy token.
    session.reset()
    turn1 = [{"role": "user", "content": "Tell me a fortune"}]
    a, _ = reply(session, turn1)
    held = list(session.cache_tokens)
    turn2 = turn1 + [{"role": "assistant", "content": a},
                     {"role": "user", "content": "Another one, please"}]
    _, s = reply(session, turn2, should_stop=lambda: True)
    assert s.finish_reason == "cancelled" and s.generation_tokens == 0
    assert session.cache_tokens == held  # back to the state before the cancelled turn
    b, s2 = reply(session, turn2)
    assert session.plan_kind == "cache" and b
    session.reset()
    assert reply(session, turn2)[0] == b  # same as from scratch
