"""The chat TUI, driven headless by Textual's Pilot on the bundled model, on the CPU."""

from __future__ import annotations

import asyncio
import html
import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from textual.app import App
from textual.screen import Screen

from pocket_mlx.engine.conversations import ConversationStore
from pocket_mlx.engine.devices import gpu_available
from pocket_mlx.engine.generation import GenerationStats, Response
from pocket_mlx.engine.loader import load
from pocket_mlx.engine.session import ChatSession, Settings
from pocket_mlx.tui import app as app_module
from pocket_mlx.tui.app import ChatApp
from pocket_mlx.tui.conversation import AssistantMessage, ConversationView, Notice, UserMessage
from pocket_mlx.tui.stats_panel import StatsPanel

LONG_PROMPT = "def main():"  # the bundled model writes code here without stopping
CHAT_TCSS = str(Path(app_module.__file__).with_name("chat.tcss"))


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
    from pocket_mlx.engine.loader import default_model_path
    from pocket_mlx.engine.tokenizer import load_tokenizer

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
        assert 3 <= s.generation_tokens < 1000
        reply = app.conversation.messages[-1]
        assert reply["role"] == "assistant" and reply["content"]
        assert any("stopped" in str(n.render()) for n in app.query(Notice))
        # The conversation goes on from the partial reply, reusing the cache.
        app.settings = Settings(max_tokens=8)
        await send(app, pilot, "More")
        assert app.last_stats.prompt_tokens < 20

    # Room to stop: `pilot.press` may return only ~2 s after the key (it waits for an idle CPU),
    # and 200 tokens can be written by then.
    run(scenario, settings=Settings(max_tokens=1000))


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


# ---- what the UI costs while a reply streams -------------------------------------------------

def fake_generate(tokens: int, tps: float = 100.0):
    """A `ChatSession.generate` that sleeps instead of decoding: the UI's own work, alone."""
    def generate(self, messages, settings, device, *, progress=None, should_stop=None,
                 warn=print):
        if progress:
            progress(0, 12, 0)
        time.sleep(0.05)
        t0, n = time.perf_counter(), 0
        for i in range(tokens):
            time.sleep(1 / tps)
            if should_stop and should_stop():
                break
            n += 1
            st = GenerationStats(prompt_tokens=12, prompt_tps=240.0, ttft_s=0.05,
                                 generation_tokens=n, bytes_per_token=4_000_000,
                                 generation_tps=n / (time.perf_counter() - t0), phase="decode")
            yield Response(f"word{i} ", 1, st), 12 + n
        st = replace(st, phase="done", finish_reason="length")
        yield Response("", None, st), 12 + n

    return generate


def test_reply_repaints_once_per_tick_and_lays_out_once_per_append(monkeypatch):
    monkeypatch.setattr(ChatSession, "generate", fake_generate(300))
    frames, ticks = [], []
    update, tick = Screen._on_timer_update, app_module.ChatApp._tick

    def on_timer_update(screen):
        names = {type(w).__name__ for w in screen._dirty_widgets}
        frames.append((time.perf_counter(), names, screen._layout_required))
        return update(screen)

    async def on_tick(app):
        if app.busy:
            ticks.append(time.perf_counter())
        await tick(app)

    monkeypatch.setattr(Screen, "_on_timer_update", on_timer_update)
    monkeypatch.setattr(app_module.ChatApp, "_tick", on_tick)

    async def scenario(app, pilot):
        done = app.replies_done
        app.prompt.text = "Tell me a fortune"
        await pilot.press("enter")
        while app.replies_done == done:
            await asyncio.sleep(0.1)  # not pilot.pause: it forces a screen update of its own

    # One paragraph that grows, on a screen it fits: no new blocks, no scrollbar to show.
    run(scenario, size=(100, 60), settings=Settings(max_tokens=300))
    decode = ticks[3:-1]  # past prefill and the first append (it mounts the paragraph)
    assert len(decode) >= 6
    for t, after in zip(decode, decode[1:]):
        between = [(names, layout) for ft, names, layout in frames if t <= ft < after]
        # each tick's repaint is on screen before the next tick (4 Hz), not held back a tick
        assert any("StatsPanel" in names for names, _ in between)
        # a taller reply is laid out once per append (every 2nd tick), not twice
        assert sum(layout for _, layout in between) <= 1


def test_stats_panel_shows_everything_without_moving():
    class PanelApp(App):
        CSS_PATH = CHAT_TCSS

        def compose(self):
            yield StatsPanel(id="stats")

    def lines(app) -> list[str]:
        return [s.text for s in app.screen._compositor.render_strips()]

    async def main():
        app = PanelApp()
        async with app.run_test(size=(30, 24)) as pilot:
            panel = app.query_one(StatsPanel)
            panel.context_max, panel.bytes_per_token = 2048, 4_000_000
            panel.device_label = "GPU (a label far too long for the panel)"
            panel.wired = "12.0 GB of 48 GB"
            panel.set_phase("idle")
            panel.redraw()
            await pilot.pause(0.05)
            idle = lines(app)
            panel.set_phase("prefill")
            panel.set_prefill(6, 12, 6)
            panel.redraw()
            await pilot.pause(0.05)
            prefill = lines(app)
            for n in range(1, 6):
                panel.set_stats(GenerationStats(
                    prompt_tokens=12, prompt_tps=240.0, ttft_s=0.05, generation_tokens=10 * n,
                    generation_tps=50.0 + n, bytes_per_token=4_000_000, phase="decode"), 12 + 10 * n)
                panel.redraw()
                await pilot.pause(0.05)
            decoding = lines(app)
        return idle, prefill, decoding

    idle, prefill, decoding = asyncio.run(main())
    assert "● idle" in idle[1] and "● prefill" in prefill[1] and "● decoding" in decoding[1]
    assert "━" in prefill[2] and "50%" in prefill[2] and not idle[2].strip("│ ")
    text = "\n".join(decoding)
    for field in ("TTFT      0.05 s", "prefill   240 tok/s", "decode    55.0 tok/s",
                  "tokens    50", "context   62 / 2,048", "weights   4.0 MB/tok",
                  "bandwidth 0.22 GB/s", "active", "peak", "wired     12.0 GB of 48 GB",
                  "kernels"):
        assert field in text, field
    assert "device    GPU (a label fa… │" in text  # cut to the panel, not wrapped
    assert any(c in text for c in "▁▂▃▄▅▆▇█")  # the decode tok/s sparkline
    # Same rows in every phase: nothing below the phase line moves (no layout on change).
    for screen in (idle, prefill):
        assert [row.find("TTFT") for row in screen] == [row.find("TTFT") for row in decoding]
        assert [row.find("kernels") for row in screen] == [row.find("kernels") for row in decoding]


def test_streamed_markdown_looks_as_rendered_at_once():
    md = ("A plan:\n\n1. first, a long item that wraps around the message box at least once\n"
          "2. second\n   - nested, also long enough to wrap onto a second line in the box\n\n"
          "```python\ndef main():\n    return 0\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
          "> a quote\n\nThe end, with https://example.com in it.\n") * 2

    class ViewApp(App):
        CSS_PATH = CHAT_TCSS

        def compose(self):
            yield ConversationView(id="conversation")

    async def shot(chunk: int | None) -> list[str]:
        app = ViewApp()
        async with app.run_test(size=(80, 90)) as pilot:
            view = app.query_one(ConversationView)
            if chunk is None:
                await view.add_assistant(md, "t")
            else:
                reply = await view.add_assistant(title="t")
                reply.start_stream()
                for i in range(0, len(md), chunk):
                    await reply.write(md[i:i + chunk])
                    await pilot.pause(0.01)
                await reply.finish()
            await pilot.pause(0.1)
            return [s.text for s in app.screen._compositor.render_strips()]

    once = asyncio.run(shot(None))
    assert "def main():" in "\n".join(once)
    for chunk in (5, 60):
        assert asyncio.run(shot(chunk)) == once


def test_single_newlines_in_a_reply_stay_line_breaks():
    """Verses and unfenced code keep their lines (Textual would show a soft break as a space)."""
    class ViewApp(App):
        CSS_PATH = CHAT_TCSS

        def compose(self):
            yield ConversationView(id="conversation")

    async def lines() -> list[str]:
        app = ViewApp()
        async with app.run_test(size=(80, 20)) as pilot:
            await app.query_one(ConversationView).add_assistant("roses are red\nviolets are blue", "t")
            await pilot.pause(0.1)
            return [s.text for s in app.screen._compositor.render_strips()]

    shown = asyncio.run(lines())
    assert any("roses are red" in line and "violets" not in line for line in shown)
    assert any("violets are blue" in line for line in shown)
