"""The chat TUI, driven headless by Textual's Pilot on the bundled model, on the CPU."""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from textual.app import App
from textual.screen import Screen

from pocket_mlx.engine import session as session_module
from pocket_mlx.engine.conversations import ConversationStore
from pocket_mlx.engine.devices import gpu_available
from pocket_mlx.engine.generation import GenerationStats, Response
from pocket_mlx.engine.loader import load
from pocket_mlx.engine.session import ChatSession, ContextOverflow, Settings
from pocket_mlx.engine.tokenizer import load_tokenizer
from pocket_mlx.paths import default_model_path
from pocket_mlx.tui import app as app_module
from pocket_mlx.tui.app import ChatApp
from pocket_mlx.tui.conversation import AssistantMessage, ConversationView, Notice, UserMessage
from pocket_mlx.tui.stats_panel import StatsPanel

# The bundled model writes past 300 tokens here without stopping, in both CPU layouts (panels
# and rows; "def main():" ended after 21 tokens with panels).
LONG_PROMPT = "Count from 1 to 200."
SMALL_CONTEXT = 256  # the bundled model's context in `small_ctx`: full after a few turns
# ~35 tokens as a user turn: six fill the small context
PARAGRAPH = "Tell me about the weather in a small town by the sea, with boats."
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


def notices(app: ChatApp) -> list[str]:
    """The one-line notices in the conversation pane."""
    return [str(n.render()) for n in app.query(Notice)]


@pytest.fixture(scope="module")
def small_ctx(tmp_path_factory) -> Path:
    """The bundled model with a 256-token context (a real model folder; only config.json says
    so): the context fills in a few turns."""
    dst = tmp_path_factory.mktemp("pocket-tiny-256")
    for f in default_model_path().iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = SMALL_CONTEXT
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def template_tokens(tok, messages: list[dict], system: str = "") -> int:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": m["role"], "content": m["content"]} for m in messages]
    return len(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False))


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
        # The panel redraws on the app's 0.25 s tick, which a loaded machine delays (CI once
        # read the screen before it): wait for a redraw, up to 5 s.
        for _ in range(20):
            await pilot.pause(0.25)
            text = screen_text(app)
            if "decode" in text and f"{s.generation_tps:.1f} tok/s" in text:
                break
        assert "decode" in text and f"{s.generation_tps:.1f} tok/s" in text
        assert "CPU" in text and "context" in text and "GB/s" in text

    app = run(scenario)
    saved = ConversationStore().load(app.conversation.id)
    assert [m["role"] for m in saved.messages] == ["user", "assistant"]
    assert saved.messages[1]["stats"]["generation_tokens"] == app.last_stats.generation_tokens


def test_chat_command_gives_the_app_the_folder_it_resolved(tmp_path, monkeypatch):
    """cli/chat.py resolves --model and reads the folder (and checks its chat template) before
    the UI; the app loads that folder and does not resolve the ref again (for synthetic:tiny
    that would build a model into the cache), while new conversations save the ref as the user
    gave it."""
    from pocket_mlx.cli.chat import make_app
    from pocket_mlx.cli.main import build_parser

    cache = tmp_path / "cache"
    monkeypatch.setenv("POCKET_MLX_CACHE", str(cache))
    bundled = default_model_path()
    app = make_app(build_parser().parse_args(["chat", "--model", str(bundled), "-n", "4"]))
    assert app.model_path.path == bundled and app.model_ref == str(bundled)

    async def reply(app, pilot):
        await send(app, pilot, "hi")

    done = run(reply, model="synthetic:tiny", path=bundled, model_name="tiny")
    assert done.last_stats is not None and done.last_stats.generation_tokens > 0
    assert not cache.exists()  # synthetic:tiny was never resolved (built)
    assert done.conversation.model == "synthetic:tiny"


def test_second_turn_prefills_only_new_tokens():
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


CODE = ("def add(a, b):\n    return a + b\n\n\ndef scale(points, k):\n"
        "    return [(x * k, y * k) for x, y in points]\n")


def test_panel_shows_accepted_drafts_per_pass(home, exact_kernels):
    """`chat --speculative lookup --num-draft-tokens 3` reaches the session (its replies are
    drafted), and the panel shows the drafts accepted per trunk pass. EXACT kernels: in FAST
    mode whether a draft of this reply is accepted depends on the ISA's rounding (none were
    under the AVX2 kernels)."""
    from pocket_mlx.cli.chat import make_app
    from pocket_mlx.cli.main import build_parser
    from pocket_mlx.tui.stats_panel import accepted_per_pass

    argv = ["chat", "--model", str(default_model_path()), "-n", "40",
            "--speculative", "lookup", "--num-draft-tokens", "3"]
    app = make_app(build_parser().parse_args(argv))
    seen = {}

    async def main() -> None:
        async with app.run_test(size=(100, 32)) as pilot:
            await until(pilot, lambda: app.ready)
            await send(app, pilot, "Repeat this code exactly:\n\n" + CODE)
            await pilot.pause(0.3)  # one panel refresh
            seen.update(text=screen_text(app), rows=dict(app.stats_panel.rows()))

    asyncio.run(main())
    spec = app.last_stats.speculative
    assert spec["method"] == "lookup" and spec["num_draft_tokens"] == 3
    assert 0 < spec["accepted"] <= spec["drafted"]
    shown = accepted_per_pass(spec)
    assert shown == f"{spec['accepted'] / spec['passes']:.2f}/pass " \
                   f"({100 * spec['accepted'] / spec['drafted']:.0f}%)"
    assert seen["rows"]["accepted"] == shown and "accepted" in seen["text"] and shown in seen["text"]


def test_panel_has_no_accepted_row_without_speculation():
    panel = StatsPanel()
    panel.stats = GenerationStats(generation_tokens=3)
    assert "accepted" not in dict(panel.rows())


def test_chat_speculative_mtp_without_head_exits_2(home, headless_asset):
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "chat", "--model",
                        str(headless_asset), "--speculative", "mtp"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no MTP head" in r.stderr and "Traceback" not in r.stderr


def test_stop_mid_reply_keeps_partial(monkeypatch):
    # The real model, slowed to ~100 tokens/s: in float32 with the CPU kernels the tiny model
    # writes 1000 tokens in about a second, less than `pilot.press` may take to return (it waits
    # for an idle CPU), and the reply would end by length before the stop arrives.
    real = session_module.stream_generate

    def slowed(*args, **kwargs):
        for r in real(*args, **kwargs):
            time.sleep(0.01)
            yield r

    monkeypatch.setattr(session_module, "stream_generate", slowed)

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


@pytest.mark.parametrize("prompt_cache_mb", [512, 0], ids=["prompt-cache", "no-prompt-cache"])
def test_save_quit_resume_same_messages(prompt_cache_mb, home):
    first = run(lambda app, pilot: _two_turns(app, pilot), prompt_cache_mb=prompt_cache_mb)
    conv = ConversationStore().load(first.conversation.id)
    assert conv.chat_messages() == first.conversation.chat_messages()
    seen = {}

    async def scenario(app, pilot):
        seen["users"] = [w.render() for w in app.query(UserMessage)]
        seen["replies"] = [w.text for w in app.query(AssistantMessage)]
        await send(app, pilot, "Once more")
        seen["prompt_tokens"] = app.last_stats.prompt_tokens

    resumed = run(scenario, conversation=conv, settings=Settings.from_dict(conv.settings),
                  prompt_cache_mb=prompt_cache_mb)
    msgs = first.conversation.messages
    assert seen["replies"] == [m["content"] for m in msgs if m["role"] == "assistant"]
    assert [str(u) for u in seen["users"]] == [m["content"] for m in msgs if m["role"] == "user"]
    cached = list((home / "prompt-cache").rglob("*.safetensors"))
    if prompt_cache_mb:
        # The first app wrote each reply's cache to the data folder; the resumed one (a new
        # engine, as after a restart) continues from it: only the new turn is prefilled.
        assert cached
        assert seen["prompt_tokens"] < 20
    else:
        # Without the prompt cache the first turn after resuming prefills everything.
        assert not cached
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


# ---- at the context limit -------------------------------------------------------------------

def test_chat_keeps_answering_past_the_context_limit(small_ctx, tokenizer):
    turns = 14
    seen: dict = {"prompt_tokens": [], "context": []}

    async def scenario(app, pilot):
        assert app.info.context_max == SMALL_CONTEXT
        for i in range(turns):
            await send(app, pilot, f"{i}. {PARAGRAPH}")
            msgs = app.conversation.messages
            assert msgs[-1]["role"] == "assistant", notices(app)  # every turn is answered
            assert app.last_stats.finish_reason in ("eos", "length")
            seen["prompt_tokens"].append(app.last_stats.prompt_tokens)
            seen["context"].append(app.stats_panel.context_used)
        seen["notices"] = notices(app)
        seen["shown"] = len(list(app.query(UserMessage)))
        kids = list(app.view.children)
        at = [i for i, w in enumerate(kids) if isinstance(w, Notice) and "oldest" in str(w.render())]
        # each drop notice sits between the prompt and the reply of the turn that dropped
        seen["around"] = {(type(kids[i - 1]).__name__, type(kids[i + 1]).__name__) for i in at}
        seen["text"] = screen_text(app)

    app = run(scenario, model=str(small_ctx), settings=Settings(max_tokens=8))
    # Fourteen turns take more than twice the context...
    assert template_tokens(tokenizer, app.conversation.messages) > 2 * SMALL_CONTEXT
    dropped = [n for n in seen["notices"] if "oldest message" in n]
    assert len(dropped) >= 2, seen["notices"]
    assert all("dropped" in n and "from the model's context to fit" in n for n in dropped)
    assert "from the model's context to fit" in seen["text"]
    assert seen["around"] == {("UserMessage", "AssistantMessage")}
    assert all(0 < c <= SMALL_CONTEXT for c in seen["context"])
    # After a drop, the next turn continues from the rebuilt cache: only its own tokens are
    # prefilled (the drop leaves room for more than one turn), not the whole window again.
    full = [i for i, n in enumerate(seen["prompt_tokens"]) if i and n > 60]
    assert full and any(i + 1 < turns and seen["prompt_tokens"][i + 1] < 50 for i in full)
    # ...and the saved conversation keeps every message, all on screen too.
    saved = ConversationStore().load(app.conversation.id)
    assert [m["role"] for m in saved.messages] == ["user", "assistant"] * turns
    assert [m["content"] for m in saved.messages[::2]] == [f"{i}. {PARAGRAPH}" for i in range(turns)]
    assert all("stats" in m for m in saved.messages[1::2])
    assert seen["shown"] == turns

    async def resumed(app, pilot):  # the panel shows what the model will hold of it, not 0
        await until(pilot, lambda: app.stats_panel.context_used > 0)
        seen["resumed"] = app.stats_panel.context_used

    run(resumed, model=str(small_ctx), conversation=saved, settings=Settings(max_tokens=8))
    whole = template_tokens(tokenizer, saved.messages)
    target = SMALL_CONTEXT - SMALL_CONTEXT // 4 - 8  # where a drop leaves the window
    turn = template_tokens(tokenizer, saved.messages[-2:])
    assert target - turn < seen["resumed"] <= target < whole
    tail = next(saved.messages[i:] for i in range(0, len(saved.messages), 2)
                if template_tokens(tokenizer, saved.messages[i:]) == seen["resumed"])
    assert tail[0]["role"] == "user"  # the count of whole turns from the newest back


def test_one_turn_longer_than_the_context_is_refused_and_not_saved(small_ctx, home):
    too_long = " ".join([PARAGRAPH] * 20)  # ~400 tokens: far over 256

    async def scenario(app, pilot):
        await send(app, pilot, too_long)
        assert app.conversation.messages == []
        assert not list(app.query(UserMessage)) and not list(app.query(AssistantMessage))
        refused = [n for n in notices(app) if "not sent" in n]
        assert len(refused) == 1 and "ctrl+n" in refused[0] and "\n" not in refused[0]
        assert "context" in refused[0] and f"{SMALL_CONTEXT:,}" in refused[0]
        assert app.prompt.text == too_long  # back in the prompt, to shorten
        await pilot.pause(0.2)
        assert "not sent" in screen_text(app)  # in view above the taller prompt box
        assert not (home / "conversations" / f"{app.conversation.id}.json").exists()
        # The chat goes on: a short message is answered, then a long one is refused again
        # without touching what was saved.
        app.prompt.text = ""
        await send(app, pilot, "Tell me a fortune")
        assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"]
        before = ConversationStore().load(app.conversation.id).messages
        await send(app, pilot, too_long)
        assert len([n for n in notices(app) if "not sent" in n]) == 2
        assert ConversationStore().load(app.conversation.id).messages == before
        assert len(list(app.query(UserMessage))) == 1
        app.prompt.text = ""
        await send(app, pilot, "And another one")
        assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"] * 2

    run(scenario, model=str(small_ctx), settings=Settings(max_tokens=8))


def test_refused_regenerate_keeps_the_previous_reply(small_ctx, home):
    # Fits with 8 tokens kept for the reply, not with 64 (a quarter of the context).
    long = " ".join([PARAGRAPH] * 11)

    async def scenario(app, pilot):
        await send(app, pilot, long)
        reply = app.conversation.messages[-1]
        assert reply["role"] == "assistant"
        path = home / "conversations" / f"{app.conversation.id}.json"
        before = path.read_bytes()
        app.settings = Settings(max_tokens=1000)
        done = app.replies_done
        await pilot.press("ctrl+r")
        await until(pilot, lambda: app.replies_done > done)
        assert any("not sent" in n for n in notices(app))
        assert app.conversation.messages[-1] is reply  # the previous reply is back...
        assert [w.text for w in app.query(AssistantMessage)] == [reply["content"]]
        assert app.prompt.text == ""  # ...and nothing was put in the prompt
        saved = ConversationStore().load(app.conversation.id)
        assert saved.messages == json.loads(before)["messages"]

    run(scenario, model=str(small_ctx), settings=Settings(max_tokens=8))


def test_reply_cut_by_the_context_is_labelled(small_ctx):
    async def scenario(app, pilot):
        await send(app, pilot, LONG_PROMPT)
        s = app.last_stats
        assert s.finish_reason == "context", s
        assert s.prompt_tokens + s.generation_tokens >= SMALL_CONTEXT - 1
        assert any("stopped: context full" in n for n in notices(app))
        # The next turn drops the first to make room and is answered.
        await send(app, pilot, "Tell me a fortune")
        assert app.conversation.messages[-1]["role"] == "assistant"
        assert any("dropped 2 oldest messages" in n for n in notices(app))

    # max tokens over the context: the reply's room is a quarter of it, so it runs into the end.
    app = run(scenario, model=str(small_ctx), settings=Settings(max_tokens=1000))
    saved = ConversationStore().load(app.conversation.id)
    assert saved.messages[1]["stats"]["finish_reason"] == "context"

    async def resumed(app, pilot):  # the label comes back with the conversation
        assert any("stopped: context full" in n for n in notices(app))

    run(resumed, model=str(small_ctx), conversation=saved)


def test_panel_context_follows_the_conversation_on_screen(tokenizer):
    first = run(_two_turns)
    conv = ConversationStore().load(first.conversation.id)
    expected = template_tokens(tokenizer, conv.messages)
    seen = {}

    async def resumed(app, pilot):  # as `chat --resume ID`: counted before any turn
        await until(pilot, lambda: app.stats_panel.context_used > 0)
        seen["resumed"] = app.stats_panel.context_used
        await pilot.press("ctrl+n")
        await pilot.pause(0.1)
        seen["new"] = app.stats_panel.context_used
        await pilot.pause(0.3)
        seen["new_text"] = screen_text(app)
        await pilot.press("ctrl+o")  # and opened from the dialog
        await until(pilot, lambda: app.screen.__class__.__name__ == "OpenScreen")
        await pilot.press("enter")
        await until(pilot, lambda: app.conversation.id == conv.id
                    and app.stats_panel.context_used > 0)
        seen["opened"] = app.stats_panel.context_used

    run(resumed, conversation=conv, settings=Settings.from_dict(conv.settings))
    assert seen["resumed"] == expected == seen["opened"]
    assert seen["new"] == 0 and re.search(r"context\s+0 / 2,048", seen["new_text"])


# ---- conversation files with bad contents ----------------------------------------------------

def _write_conversation(home: Path, conv_id: str, **over) -> Path:
    data = {"version": 1, "id": conv_id, "model": "", "created": 0.0, "updated": 0.0,
            "settings": {"system": "", "temperature": 0.0, "top_p": 1.0, "max_tokens": 8},
            "messages": [{"role": "user", "content": "Tell me a fortune"},
                         {"role": "assistant", "content": "You will win.",
                          "stats": {"generation_tokens": 4, "device": "cpu",
                                    "finish_reason": "length"}}]}
    data.update(over)
    root = home / "conversations"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{conv_id}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("name, value, shown", [
    ("temperature", "hot", "invalid setting temperature='hot'"),
    ("max_tokens", -5, "invalid setting max_tokens=-5"),
    ("top_p", 2.0, "invalid setting top_p=2.0"),
    ("colour", "blue", "unknown setting colour='blue'"),
])
def test_resume_with_bad_setting_exits_2_one_line_file_untouched(home, name, value, shown):
    settings = {"system": "", "temperature": 0.0, "top_p": 1.0, "max_tokens": 8, name: value}
    path = _write_conversation(home, "bad-settings", settings=settings)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "chat", "--resume", "bad-settings"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and r.stdout == ""
    assert f"conversation bad-settings has an {shown}; fix or delete {path}" in lines[0]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_bad_reply_stats_are_dropped_not_a_crash(home):
    odd = _write_conversation(home, "20260101-000000-0dd5")
    data = json.loads(odd.read_text())
    data["messages"][1]["stats"] = "fast"
    data["messages"] += [{"role": "user", "content": "Again"},
                         {"role": "assistant", "content": "Still winning.",
                          "stats": {"device": 5, "finish_reason": ["length"],
                                    "generation_tokens": "many", "ttft_s": 0.1}}]
    odd.write_text(json.dumps(data))
    digest = hashlib.sha256(odd.read_bytes()).hexdigest()

    async def opened(app, pilot):
        await pilot.press("ctrl+o")
        await until(pilot, lambda: app.screen.__class__.__name__ == "OpenScreen")
        await pilot.press("enter")
        await until(pilot, lambda: app.conversation.id == "20260101-000000-0dd5")
        assert [w.text for w in app.query(AssistantMessage)] == ["You will win.",
                                                                 "Still winning."]
        warned = [n for n in notes(app) if "stats" in n]
        assert any("not an object" in n for n in warned), notes(app)
        assert any("device" in n and "finish_reason" in n and "generation_tokens" in n
                   for n in warned)
        await send(app, pilot, "Once more")  # and the conversation goes on
        assert app.conversation.messages[-1]["role"] == "assistant"

    run(opened)
    saved = ConversationStore().load("20260101-000000-0dd5")
    assert saved.warnings == [] and len(saved.messages) == 6
    assert saved.messages[3]["stats"] == {"ttft_s": 0.1}

    _write_conversation(home, "20260101-000000-0dd6", messages=data["messages"])

    async def resumed(app, pilot):  # `chat --resume`: the same, shown at start
        assert len(list(app.query(AssistantMessage))) == 2
        assert any("not an object" in n for n in notes(app))

    conv = ConversationStore().load("20260101-000000-0dd6")
    run(resumed, conversation=conv)
    assert hashlib.sha256(odd.read_bytes()).hexdigest() != digest  # written by the new turn


def test_crash_report_does_not_dump_the_conversation(capsys):
    secret = "my very private message"

    async def scenario(app, pilot):
        await send(app, pilot, secret)

        def boom() -> None:
            messages = app.conversation.messages  # noqa: F841 - a local the report must not show
            raise RuntimeError("a bug")

        app.call_later(boom)
        await pilot.pause(0.2)

    app = ChatApp(device="cpu", settings=Settings(max_tokens=4))

    async def main() -> None:
        async with app.run_test(size=(100, 32)) as pilot:
            await until(pilot, lambda: app.ready)
            await scenario(app, pilot)

    capsys.readouterr()
    with pytest.raises(RuntimeError):
        asyncio.run(main())
    err = capsys.readouterr().err  # Textual's crash report goes to stderr
    assert "a bug" in err and "RuntimeError" in err and "boom" in err
    assert secret not in err  # Textual's own report shows every frame's locals: this one


def test_private_textual_overrides_match_the_installed_textual():
    """tui/textual_private.py overrides private Textual methods: each one's signature there must
    still be Textual's, and what QuietCrash reads must still exist (a Textual upgrade that
    changes them fails here, not in a user's terminal)."""
    import inspect

    from pocket_mlx.tui import textual_private

    for (cls, name), params in textual_private.PRIVATE_API.items():
        assert tuple(inspect.signature(getattr(cls, name)).parameters) == params, (cls, name)
    assert isinstance(App()._exit_renderables, list)
    assert ChatApp._fatal_error is textual_private.QuietCrash._fatal_error


def test_no_private_textual_override_outside_textual_private():
    """Every class of tui/ that defines a private (single-underscore) method a Textual class in
    its MRO also defines is in tui/textual_private.py, where the test above checks it."""
    import importlib
    import inspect
    import pkgutil

    import pocket_mlx.tui as tui

    found = set()
    for info in pkgutil.iter_modules(tui.__path__):
        module = importlib.import_module(f"pocket_mlx.tui.{info.name}")
        for cls in vars(module).values():
            if not inspect.isclass(cls):
                continue
            textual = [b for b in cls.__mro__ if b.__module__.startswith("textual.")]
            ours = [b for b in cls.__mro__ if b.__module__.startswith("pocket_mlx.tui.")]
            for k in ours:
                for name, value in vars(k).items():
                    if (name.startswith("_") and not name.startswith("__")
                            and inspect.isfunction(value)
                            and any(inspect.isfunction(vars(b).get(name)) for b in textual)):
                        found.add(f"{k.__module__}.{k.__qualname__}.{name}")
    assert found == {"pocket_mlx.tui.textual_private.QuietCrash._fatal_error",
                     "pocket_mlx.tui.textual_private.SteadySize._size_updated"}, found


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
                 warn=print, trimmed=None):
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
    late, twice = [], []
    for t, after in zip(decode, decode[1:]):
        between = [(names, layout) for ft, names, layout in frames if t <= ft < after]
        # each tick's repaint is on screen before the next tick (4 Hz), not held back a tick
        if not any("StatsPanel" in names for names, _ in between):
            late.append(t)
        # a taller reply is laid out once per append (every 2nd tick), not twice
        if sum(layout for _, layout in between) > 1:
            twice.append(t)
    # One interval in five may miss (a loaded machine delays the event loop now and then: one
    # full-suite run failed on a single late tick, 5 runs alone passed); held back or doubled
    # every tick, as the bugs this guards against did, fails.
    allowed = max(1, (len(decode) - 1) // 5)
    assert len(late) <= allowed, f"{len(late)} of {len(decode) - 1} ticks repainted late"
    assert len(twice) <= allowed, f"{len(twice)} of {len(decode) - 1} intervals laid out twice"


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
            panel.wired = "12.0 GiB"
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
                  "tokens    50", "context   62 / 2,048", "weights   3.81 MiB/tok",
                  "bandwidth 0.22 GB/s", "active", "peak", "wired     12.0 GiB",
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


def test_session_window_drops_oldest_turns_and_rebuilds_the_cache(small_ctx, exact_kernels):
    small = ChatSession(*load(small_ctx))
    settings = Settings(max_tokens=8)
    msgs: list[dict] = []
    drops = []
    for i in range(8):
        msgs.append({"role": "user", "content": f"{i}. {PARAGRAPH}"})
        text, last = "", None
        for r, used in small.generate(msgs, settings, "cpu",
                                      trimmed=lambda n, out: drops.append((n, out))):
            text += r.text
            last = r
            assert used <= SMALL_CONTEXT
        msgs.append({"role": "assistant", "content": text})
    assert drops and all(n % 2 == 0 and out % 2 == 0 for n, out in drops)
    start = drops[-1][1]
    assert msgs[start]["role"] == "user"
    # What the model saw is the kept turns only: a fresh session given just them writes the same
    # last reply (the cache was rebuilt from them, nothing of the dropped turns left in it).
    kept = msgs[start:-1]
    assert [m["content"] for m in small.dropped] == [m["content"] for m in msgs[:start]]
    fresh = ChatSession(small.model, small.tokenizer)
    again = "".join(r.text for r, _ in fresh.generate(kept, settings, "cpu"))
    assert again == msgs[-1]["content"]
    assert last.stats.prompt_tokens <= SMALL_CONTEXT


def test_session_refuses_a_turn_that_cannot_fit(small_ctx):
    small = ChatSession(*load(small_ctx))
    msgs = [{"role": "user", "content": " ".join([PARAGRAPH] * 20)}]
    with pytest.raises(ContextOverflow, match="ctrl\\+n"):
        next(small.generate(msgs, Settings(max_tokens=8), "cpu"))
    assert small.cache is None and small.cache_tokens == []  # nothing touched
    # room for the reply counts: a message that fits only without it is refused too
    short = [{"role": "user", "content": " ".join([PARAGRAPH] * 11)}]
    n = template_tokens(small.tokenizer, short)
    assert n + 8 <= SMALL_CONTEXT < n + 64
    assert len(small.window(short, Settings(max_tokens=8)).ids) == n
    with pytest.raises(ContextOverflow):  # 64: a quarter of the context, the most kept free
        small.window(short, Settings(max_tokens=1000))
