"""The conversation store: atomic saves, listing, corrupt files reported and left alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pocket_mlx.engine.conversations import (
    Conversation,
    ConversationStore,
    CorruptConversation,
    new_id,
)
from pocket_mlx.errors import PocketError
from pocket_mlx.paths import data_dir


@pytest.fixture
def store(tmp_path, monkeypatch) -> ConversationStore:
    monkeypatch.setenv("POCKET_MLX_HOME", str(tmp_path / "home"))
    return ConversationStore()


def conv(**kw) -> Conversation:
    c = Conversation(id=kw.pop("id", new_id()), model="assets/pocket-tiny",
                     settings={"system": "", "temperature": 0.0, "top_p": 1.0, "max_tokens": 8})
    c.messages = kw.pop("messages", [
        {"role": "user", "content": "Tell me a fortune"},
        {"role": "assistant", "content": "You will **win**.", "stats": {"generation_tokens": 4}},
    ])
    return c


def test_data_dir_env_and_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_MLX_HOME", str(tmp_path / "x"))
    assert data_dir() == tmp_path / "x"
    monkeypatch.delenv("POCKET_MLX_HOME")
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_dir() == tmp_path / "xdg" / "pocket-mlx"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert data_dir() == Path.home() / ".local" / "share" / "pocket-mlx"
    monkeypatch.setattr("sys.platform", "darwin")
    assert data_dir() == Path.home() / "Library" / "Application Support" / "pocket-mlx"


def test_save_load_roundtrip(store):
    c = conv()
    path = store.save(c)
    assert path == store.root / f"{c.id}.json" and path.parent.parent == data_dir()
    back = store.load(c.id)
    assert back.messages == c.messages and back.settings == c.settings
    assert back.model == c.model and back.title == "Tell me a fortune"
    assert back.chat_messages()[1] == {"role": "assistant", "content": "You will **win**."}
    assert json.loads(path.read_text())["version"] == 1


def test_save_is_atomic_and_leaves_no_temp_files(store, monkeypatch):
    c = conv()
    store.save(c)
    before = (store.root / f"{c.id}.json").read_text()
    c.messages.append({"role": "user", "content": "x" * 100})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        store.save(c)
    assert (store.root / f"{c.id}.json").read_text() == before  # old version intact
    assert [p.name for p in store.root.iterdir()] == [f"{c.id}.json"]


def test_list_newest_first_and_reports_corrupt(store):
    a, b = conv(id="20260101-000000-aaaa"), conv(id="20260102-000000-bbbb")
    store.save(a)
    store.save(b)
    a.messages.append({"role": "user", "content": "later"})
    store.save(a)
    bad = store.root / "20260103-000000-cccc.json"
    bad.write_text("{truncated")
    wrong = store.root / "20260104-000000-dddd.json"
    wrong.write_text(json.dumps({"id": "someone-else", "messages": []}))
    convs, errors = store.list()
    assert [c.id for c in convs] == [a.id, b.id]
    assert len(errors) == 2 and all("corrupt" in e or "holds id" in e for e in errors)
    assert bad.read_text() == "{truncated"  # never deleted or rewritten
    with pytest.raises(CorruptConversation):
        store.load("20260103-000000-cccc")


def test_unknown_and_invalid_ids(store):
    assert store.list() == ([], [])
    with pytest.raises(PocketError, match="no saved conversation"):
        store.load("nope")
    for bad in ("../etc/passwd", ".hidden", ""):
        with pytest.raises(PocketError):
            store.path_for(bad)


@pytest.mark.parametrize("payload", [
    [1, 2],
    {"id": "x"} | {"messages": [{"role": "robot", "content": "hi"}]},
    {"id": "x", "messages": [{"role": "user"}]},
    {"id": "x", "settings": "hot"},
])
def test_malformed_is_corrupt(store, payload):
    store.root.mkdir(parents=True)
    (store.root / "x.json").write_text(json.dumps(payload))
    with pytest.raises(CorruptConversation):
        store.load("x")


def test_settings_roundtrip_and_validation():
    from pocket_mlx.engine.session import Settings

    s = Settings(system="be brief", temperature=0.7, top_p=0.9, max_tokens=64)
    assert Settings.from_dict(s.to_dict()) == s
    assert Settings.from_dict({}) == Settings()
    for bad in (Settings(temperature=-1), Settings(top_p=0), Settings(max_tokens=0),
                Settings(temperature=float("nan")), Settings(temperature=float("inf"))):
        with pytest.raises(PocketError):
            bad.validate()


@pytest.mark.parametrize("name, value, shown", [
    ("temperature", "hot", "invalid setting temperature='hot'"),
    ("temperature", float("nan"), "invalid setting temperature=nan"),
    ("temperature", -0.5, "invalid setting temperature=-0.5"),
    ("top_p", 0, "invalid setting top_p=0"),
    ("max_tokens", -3, "invalid setting max_tokens=-3"),
    ("max_tokens", 2.5, "invalid setting max_tokens=2.5"),
    ("max_tokens", True, "invalid setting max_tokens=True"),
    ("system", ["a"] * 50, "invalid setting system=['a', 'a', "),
    ("seed", 1, "unknown setting seed=1"),
])
def test_bad_setting_refuses_the_file_in_one_line(store, name, value, shown):
    c = conv(id="x")
    c.settings[name] = value
    store.save(c)
    before = (store.root / "x.json").read_bytes()
    with pytest.raises(CorruptConversation) as e:
        store.load("x")
    line = str(e.value)
    assert "\n" not in line and len(line) < 200 + len(str(store.root))
    assert line.startswith(f"conversation x has an {shown}")
    assert line.endswith(f"; fix or delete {store.root / 'x.json'}")
    assert (store.root / "x.json").read_bytes() == before
    assert store.list() == ([], [line])  # the open dialog reports it the same way


def test_bad_reply_stats_are_dropped_with_a_warning(store):
    c = conv(id="y", messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "stats": "fast"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "stats": {
            "generation_tokens": "many", "device": 5, "finish_reason": ["eos"],
            "ttft_s": -1.0, "prompt_tps": 12.5, "future_field": {"x": 1}}},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f", "stats": None},
    ])
    store.save(c)
    back = store.load("y")
    assert "stats" not in back.messages[1] and "stats" not in back.messages[5]  # null: no stats
    assert back.messages[3]["stats"] == {"prompt_tps": 12.5, "future_field": {"x": 1}}
    assert len(back.warnings) == 2
    assert back.warnings[0].startswith("message 2: stats is not an object")
    assert back.warnings[1] == ("message 4: bad stats fields generation_tokens, device, "
                                "finish_reason, ttft_s; dropped")
    assert [m["content"] for m in back.messages] == list("abcdef")
    store.save(back)  # saving the fixed conversation writes no warnings
    assert "warnings" not in json.loads((store.root / "y.json").read_text())
    assert store.load("y").warnings == []


def test_remove(store):
    c = conv(id="z")
    store.save(c)
    store.remove("z")
    store.remove("z")  # already gone: fine
    assert not (store.root / "z.json").exists()
