"""The prompt cache store on the bundled model: exact continuation from a stored prefix, the
longest-prefix choice, the RAM and disk tiers, restarts (in-process and across processes),
model identity, damaged files and concurrent use. Real arrays and real safetensors files."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import ASSET

from pocket_mlx.engine.generation import stream_generate
from pocket_mlx.engine.loader import load
from pocket_mlx.engine.prompt_cache import (
    PromptCache,
    capture,
    model_fingerprint,
    restore,
    snapshot_bytes,
)
from pocket_mlx.engine.session import ChatSession, Settings
from pocket_mlx.models.cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The old lighthouse keeper climbed the stairs each night, counting the steps and "
        "listening to the sea against the rocks below. ") * 4


@pytest.fixture(scope="module")
def tiny():
    return load(ASSET, device="cpu")


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny[1].encode(TEXT)


def prefilled(model, tokens) -> list:
    cache = model.make_cache()
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([a for c in cache for a in c.arrays])
    return cache


def arrays(cache) -> list[np.ndarray]:
    """Every array a cache holds, KV trimmed to its positions, as numpy."""
    return [np.array(a) for s in capture(cache, detach=True) for a in s.arrays if a is not None]


def assert_same_state(a, b) -> None:
    xs, ys = arrays(a), arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(x, y)


def greedy(model, tok, feed, cache, n=8) -> list[int]:
    return [r.token for r in stream_generate(model, tok, feed, max_tokens=n, cache=cache,
                                             temperature=0.0, device="cpu")
            if r.token is not None]


def test_continuation_from_a_stored_prefix_equals_a_cold_prefill(tiny, ids, exact_kernels):
    model, tok = tiny
    store = PromptCache(model, 1 << 30)
    cut = len(ids) // 2
    store.store(ids[:cut], prefilled(model, ids[:cut]))
    cache, n = store.fetch(ids)
    assert n == cut and store.stats()["hits"] == 1 and store.stats()["tokens_served"] == cut
    warm = model(mx.array(ids[n:])[None], cache=cache)[0, -1].astype(mx.float32)
    cold = model(mx.array(ids)[None], cache=model.make_cache())[0, -1].astype(mx.float32)
    np.testing.assert_allclose(np.array(warm), np.array(cold), rtol=1e-4, atol=1e-4)

    # Through the generation loop: a fetched cache + the rest gives the cold run's tokens.
    cache, n = store.fetch(ids)
    assert greedy(model, tok, ids[n:], cache) == greedy(model, tok, ids, None)


def test_end_of_reply_boundary_serves_the_next_turn(tiny, ids, exact_kernels):
    """Store what the cache holds after a reply (prompt + reply, fed_tokens); the next turn,
    which extends it, prefills only its own tokens and decodes as a cold run would."""
    model, tok = tiny
    store = PromptCache(model, 1 << 30)
    first = ids[:40]
    cache = model.make_cache()
    last = None
    for r in stream_generate(model, tok, first, max_tokens=6, cache=cache, temperature=0.0,
                             device="cpu"):
        last = r
    held = list(last.fed_tokens)
    assert len(held) > len(first) and held[:len(first)] == first
    assert store.store(held, cache)
    turn2 = held + ids[40:60]
    cache2, n = store.fetch(turn2)
    assert n == len(held)
    assert greedy(model, tok, turn2[n:], cache2) == greedy(model, tok, turn2, None)


def test_longest_stored_prefix_wins_and_non_prefixes_miss(tiny, ids):
    model, _ = tiny
    store = PromptCache(model, 1 << 30)
    for n in (10, 20, 30):
        assert store.store(ids[:n], prefilled(model, ids[:n]))
    assert not store.store(ids[:20], prefilled(model, ids[:20]))  # already there
    assert store.fetch(ids[:25])[1] == 20
    assert store.fetch(ids)[1] == 30
    assert store.fetch(ids[:30])[1] == 20  # a proper prefix: one token is left to feed
    assert store.fetch(ids[:10])[1] == 0
    other = list(ids)
    other[5] = (other[5] + 1) % 100
    assert store.fetch(other)[1] == 0
    assert store.fetch([7] + list(ids))[1] == 0
    cache, n = store.fetch([1, 2, 3])
    assert n == 0 and all(c.offset == 0 for c in cache)
    st = store.stats()
    assert (st["hits"], st["misses"], st["tokens_served"]) == (3, 4, 70)
    assert st["entries"] == 3 and st["stores"] == 3


def test_the_fetched_cache_is_a_copy(tiny, ids):
    model, _ = tiny
    store = PromptCache(model, 1 << 30)
    original = prefilled(model, ids[:30])
    store.store(ids[:30], original)
    # Rewind a fetched copy's KV layers below the stored positions, then write: KVCache's
    # in-place update (keys[...] = new) must land in the copy's arrays only.
    cache, _ = store.fetch(ids)
    for c in cache:
        if hasattr(c, "trim"):
            c.trim(5)
    model(mx.array(ids[25:28])[None], cache=cache)  # fits the room: no reallocation
    mx.eval([a for c in cache for a in c.arrays])
    assert_same_state(store.fetch(ids)[0], original)
    cache, _ = store.fetch(ids)
    # Extend it, and rewind part of it and write again.
    model(mx.array(ids[30:50])[None], cache=cache)
    for c in cache:
        if hasattr(c, "trim"):
            c.trim(5)
    model(mx.array(ids[45:52])[None], cache=cache)
    mx.eval([a for c in cache for a in c.arrays])
    again, n = store.fetch(ids)
    assert n == 30
    assert_same_state(again, original)
    # The stored snapshot does not follow the live cache it was taken from either.
    model(mx.array(ids[30:40])[None], cache=original)
    assert_same_state(store.fetch(ids)[0], prefilled(model, ids[:30]))


def test_rewind_point_restores_in_place(tiny, ids):
    """The chat's regenerate: capture without detach, extend, restore: as before."""
    model, _ = tiny
    cache = prefilled(model, ids[:20])
    mark = capture(cache)
    model(mx.array(ids[20:40])[None], cache=cache)
    restore(cache, mark)
    assert all(c.offset == 20 for c in cache)
    assert_same_state(cache, prefilled(model, ids[:20]))
    with pytest.raises(ValueError, match="cannot rewind"):
        restore(prefilled(model, ids[:5]), mark)


def test_store_checks_the_cache_holds_the_tokens(tiny, ids):
    model, _ = tiny
    store = PromptCache(model, 1 << 30)
    with pytest.raises(ValueError, match="holds 20 positions"):
        store.store(ids[:21], prefilled(model, ids[:20]))
    assert len(store) == 0


def entry_bytes(model, tokens) -> int:
    return sum(s.nbytes for s in capture(prefilled(model, tokens), detach=True))


def test_ram_budget_spills_to_disk_and_restores_equal(tiny, ids, tmp_path):
    model, _ = tiny
    per = entry_bytes(model, ids[:30])
    store = PromptCache(model, int(per * 1.5), tmp_path)
    for n in (10, 20, 30):
        store.store(ids[:n], prefilled(model, ids[:n]))
    st = store.stats()
    assert st["spills"] == 2 and st["entries_ram"] == 1 and st["entries"] == 3
    assert st["ram_bytes"] == per
    files = list((tmp_path / store.fingerprint).glob("*.safetensors"))
    assert len(files) == 2 and st["disk_bytes"] == sum(f.stat().st_size for f in files)
    cache, n = store.fetch(ids[:15])  # only on disk
    assert n == 10 and store.stats()["restores"] == 1
    assert_same_state(cache, prefilled(model, ids[:10]))
    # Restored into RAM as the most recent; the budget spilled the coldest (20 tokens).
    st = store.stats()
    assert st["ram_bytes"] <= int(per * 1.5) and st["entries"] == 3


def test_a_store_makes_room_before_it_copies(tiny, ids, tmp_path):
    """The coldest entry is spilled before the new snapshot is copied, not after: the store's
    RAM peaks at the larger of its budget and one snapshot (what serve's planner counts), not
    at their sum."""
    model, _ = tiny
    a, b = prefilled(model, ids[:30]), prefilled(model, ids[1:31])
    per = entry_bytes(model, ids[:30])
    assert snapshot_bytes(a) == per
    kv = sum(s.nbytes for s in capture(b, detach=True) if s.kind == "kv")
    assert kv > 0
    store = PromptCache(model, int(per * 1.2), tmp_path)  # room for one
    store.store(ids[:30], a)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    store.store(ids[1:31], b)
    assert store.stats()["spills"] == 1 and store.stats()["ram_bytes"] == per
    # The new snapshot's KV copy (its linear states are the live cache's arrays) replaced the
    # spilled one's: the peak rose by well under one copy.
    assert mx.get_peak_memory() - base < kv / 2


def test_disk_budget_evicts_the_oldest(tiny, ids, tmp_path):
    model, _ = tiny
    store = PromptCache(model, 0, tmp_path, disk_bytes=1 << 30)
    store.store(ids[:10], prefilled(model, ids[:10]))
    one = store.stats()["disk_bytes"]
    store = PromptCache(model, 0, tmp_path / "b", disk_bytes=int(one * 2.5))
    for n in (10, 11, 12):
        store.store(ids[:n], prefilled(model, ids[:n]))
    st = store.stats()
    assert st["ram_bytes"] == 0 and st["spills"] == 3 and st["evictions"] == 1
    assert st["entries"] == 2 and st["disk_bytes"] <= int(one * 2.5)
    assert store.fetch(ids[:11])[1] == 0  # the oldest (10) is gone
    assert store.fetch(ids[:12])[1] == 11


def test_a_new_store_on_the_same_dir_hits(tiny, ids, tmp_path):
    model, tok = tiny
    first = PromptCache(model, 1 << 30, tmp_path)
    first.store(ids[:25], prefilled(model, ids[:25]))
    first.store(ids[:35], prefilled(model, ids[:35]))
    assert first.stats()["disk_bytes"] == 0  # nothing spilled yet
    assert first.flush() == 2
    again = PromptCache(model, 1 << 30, tmp_path)
    assert len(again) == 2 and again.stats()["disk_bytes"] == first.stats()["disk_bytes"]
    cache, n = again.fetch(ids)
    assert n == 35 and again.stats()["restores"] == 1
    assert_same_state(cache, prefilled(model, ids[:35]))


def test_write_through_survives_without_flush(tiny, ids, tmp_path):
    model, _ = tiny
    PromptCache(model, 1 << 30, tmp_path, write_through=True).store(
        ids[:25], prefilled(model, ids[:25]))
    assert PromptCache(model, 1 << 30, tmp_path).fetch(ids)[1] == 25


_CHILD = """
import json, sys
import mlx.core as mx
from pocket_mlx import kernels
from pocket_mlx.engine.generation import stream_generate
from pocket_mlx.engine.loader import load
from pocket_mlx.engine.prompt_cache import PromptCache
kernels.set_mode("exact")
mode, folder, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model, tok = load(None, device="cpu")
store = PromptCache(model, 1 << 30, folder)
if mode == "store":
    cache = model.make_cache()
    model(mx.array(ids[:-8])[None], cache=cache)
    store.store(ids[:-8], cache)
    store.flush()
    print(json.dumps(store.stats()))
else:
    cache, n = store.fetch(ids)
    out = [r.token for r in stream_generate(model, tok, ids[n:], max_tokens=8, cache=cache,
                                            temperature=0.0, device="cpu") if r.token is not None]
    print(json.dumps({"n": n, "tokens": out, **store.stats()}))
"""


def _child(mode: str, folder: Path, ids: list[int]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "POCKET_MLX_MODEL": str(ASSET)}
    run = subprocess.run([sys.executable, "-c", _CHILD, mode, str(folder), json.dumps(ids)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_new_process_restores_what_another_stored(tiny, ids, tmp_path, exact_kernels):
    model, tok = tiny
    stored = _child("store", tmp_path, list(ids))
    assert stored["stores"] == 1 and stored["disk_bytes"] > 0
    got = _child("fetch", tmp_path, list(ids))
    assert got["n"] == len(ids) - 8 and got["hits"] == 1 and got["restores"] == 1
    assert got["tokens"] == greedy(model, tok, list(ids), None)


def test_another_model_never_uses_the_cache(make_ckpt, tmp_path):
    a = load(make_ckpt("a", seed=0), device="cpu")[0]
    b = load(make_ckpt("b", seed=1), device="cpu")[0]  # same config, other weights
    assert model_fingerprint(a) != model_fingerprint(b)
    ids = list(range(3, 40))
    store = PromptCache(a, 1 << 30, tmp_path)
    store.store(ids[:20], prefilled(a, ids[:20]))
    store.flush()
    other = PromptCache(b, 1 << 30, tmp_path)
    assert len(other) == 0 and other.fetch(ids)[1] == 0
    assert PromptCache(a, 1 << 30, tmp_path).fetch(ids)[1] == 20
    # The same weights in another activation dtype: a separate key, never a float32 hit.
    half = load(make_ckpt("a", seed=0), device="cpu", dtype="bfloat16")[0]
    assert PromptCache(half, 1 << 30, tmp_path).fetch(ids)[1] == 0


def test_damaged_and_foreign_files_are_skipped(tiny, ids, tmp_path, caplog):
    model, _ = tiny
    store = PromptCache(model, 1 << 30, tmp_path)
    for n in (20, 30):
        store.store(ids[:n], prefilled(model, ids[:n]))
    store.flush()
    folder = tmp_path / store.fingerprint
    good, longer = sorted(folder.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    (folder / "garbage.safetensors").write_bytes(b"\x00" * 3 + b"not a safetensors file")
    (folder / "notes.txt").write_text("hello")
    cut = folder / "cut.safetensors"
    cut.write_bytes(longer.read_bytes()[:-100])
    foreign = folder / "foreign.safetensors"
    mx.save_safetensors(str(foreign), {"x": mx.zeros((2,))}, metadata={"format": "other"})
    with caplog.at_level(logging.WARNING, logger="pocket_mlx.engine.prompt_cache"):
        again = PromptCache(model, 1 << 30, tmp_path)
    assert len(again) == 2
    skipped = " ".join(r.getMessage() for r in caplog.records)
    for f in ("garbage", "notes.txt", "cut", "foreign"):
        assert f in skipped
    # Damaged after indexing: the longest entry's data now unreadable -> the next one serves.
    longer.write_bytes(longer.read_bytes()[:200])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pocket_mlx.engine.prompt_cache"):
        cache, n = again.fetch(ids)
    assert n == 20 and "skipping" in caplog.text
    assert_same_state(cache, prefilled(model, ids[:20]))
    assert len(again) == 1 and not longer.exists()


def test_concurrent_stores_and_fetches_keep_consistent_stats(tiny, ids, tmp_path):
    model, _ = tiny
    lengths = list(range(8, 40, 4))
    caches = {n: prefilled(model, ids[:n]) for n in lengths}
    per = entry_bytes(model, ids[:39])
    store = PromptCache(model, per * 3, tmp_path)  # spills and restores while threads run
    fetched: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(25):
                n = rng.choice(lengths)
                if rng.random() < 0.5:
                    store.store(ids[:n], caches[n])
                else:
                    cache, got = store.fetch(ids[:n + 3])
                    assert got == 0 or got in lengths and got <= n + 2
                    assert all(c.offset == got for c in cache)
                    with lock:
                        fetched.append(got)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    st = store.stats()
    assert st["hits"] + st["misses"] == len(fetched)
    assert st["hits"] == sum(1 for g in fetched if g) and st["tokens_served"] == sum(fetched)
    assert st["ram_bytes"] <= per * 3
    held = [e for e in store._entries.values() if e.states is not None]
    segments = {id(g): g for e in held for g in e.segments}.values()  # each counted once
    assert st["ram_bytes"] == sum(e.nbytes for e in held) + sum(g.nbytes for g in segments)
    files = list((tmp_path / store.fingerprint).glob("*.safetensors"))
    assert st["disk_bytes"] == sum(f.stat().st_size for f in files)
    assert st["entries"] == len(lengths) and st["stores"] == len(lengths) + st["evictions"]
    for n in lengths:  # every entry still serves its exact state
        cache, got = store.fetch(ids[:n + 1])
        assert got == n
        assert_same_state(cache, caches[n])


def test_chat_session_resumes_from_the_store(tiny, tmp_path, exact_kernels):
    """The chat's use: a session stores its cache after each reply; a new session (a resumed
    conversation, after a restart: a new store on the same folder) prefills only the new turn
    and replies as a session without the store does."""
    model, tok = tiny
    settings = Settings(max_tokens=6)

    def reply(session, messages):
        text, last = "", None
        for r, _ in session.generate(messages, settings, "cpu"):
            text, last = text + r.text, r
        return text, last.stats

    first = ChatSession(model, tok, PromptCache(model, 1 << 30, tmp_path))
    turn1 = [{"role": "user", "content": "Tell me a fortune"}]
    a, _ = reply(first, turn1)
    assert first.plan_kind == "fresh" and first.prompt_cache.stats()["stores"] == 1
    held = len(first.cache_tokens)
    first.prompt_cache.flush()

    turn2 = turn1 + [{"role": "assistant", "content": a}, {"role": "user", "content": "Another"}]
    resumed = ChatSession(model, tok, PromptCache(model, 1 << 30, tmp_path))
    b, s = reply(resumed, turn2)
    want, s_cold = reply(ChatSession(model, tok), turn2)
    base = resumed.prompt_cache.stats()["tokens_served"]
    assert resumed.plan_kind == "stored" and base == held  # the prompt and reply of turn 1
    assert s.prompt_tokens == s_cold.prompt_tokens - base
    assert b == want


def test_storing_again_brings_a_spilled_entry_back_to_ram(tiny, ids, tmp_path):
    model, _ = tiny
    per = entry_bytes(model, ids[:20])
    store = PromptCache(model, int(per * 1.5), tmp_path)
    store.store(ids[:20], prefilled(model, ids[:20]))
    store.store(ids[:21], prefilled(model, ids[:21]))  # spills the first
    assert store.stats()["entries_ram"] == 1 and store.stats()["spills"] == 1
    assert not store.store(ids[:20], prefilled(model, ids[:20]))  # known: no new entry
    st = store.stats()
    assert st["stores"] == 2 and st["entries"] == 2
    assert store.fetch(ids[:21])[1] == 20
    assert store.stats()["restores"] == 0  # served from RAM, not read back from disk


def test_the_disk_order_of_use_survives_a_restart(tiny, ids, tmp_path):
    model, _ = tiny
    store = PromptCache(model, 0, tmp_path)  # everything on disk
    for n in (20, 21):
        store.store(ids[:n], prefilled(model, ids[:n]))
    assert store.fetch(ids[:21])[1] == 20  # 20 is now the more recently used
    one = max(f.stat().st_size for f in (tmp_path / store.fingerprint).glob("*.safetensors"))
    again = PromptCache(model, 0, tmp_path, disk_bytes=int(one * 1.5))  # room for one
    assert len(again) == 1 and again.fetch(ids[:22])[1] == 20


def _kv_bytes(cache) -> int:
    return sum(s.nbytes for s in capture(cache, detach=True) if s.kind == "kv")


def test_snapshots_along_one_prefill_share_their_kv(tiny, ids, tmp_path):
    """Issue 30: snapshots taken as one prefill goes on hold the KV of the prefix once (the
    longer ones share the shorter ones' segments); each still restores its exact state, from
    RAM and after a spill to disk (files are whole)."""
    model, _ = tiny
    store = PromptCache(model, 1 << 30, tmp_path)
    cache, points = model.make_cache(), [16, 32, 48, len(ids) - 1]
    start = 0
    for p in points:
        model(mx.array(ids[start:p])[None], cache=cache)
        mx.eval([a for c in cache for a in c.arrays])
        assert store.store(ids[:p], cache, kind="interval")
        start = p
    linear = sum(s.nbytes for s in capture(cache, detach=True) if s.kind == "linear")
    # KV of the longest prefix once, plus one set of linear states per snapshot.
    assert store.ram_used == _kv_bytes(cache) + linear * len(points)
    longest = max(store._entries.values(), key=lambda e: len(e.tokens))
    assert len(longest.segments) == len(points)
    assert all(g.refs == len(points) - i for i, g in enumerate(longest.segments))
    for p in points:
        got, n = store.fetch(ids[:p + 1])
        assert n == p
        assert_same_state(got, prefilled(model, ids[:p]))
    assert store.flush() == len(points)
    again = PromptCache(model, 1 << 30, tmp_path)  # a new process's view: the files alone
    for p in points:
        got, n = again.fetch(ids[:p + 1])
        assert n == p
        assert_same_state(got, prefilled(model, ids[:p]))


def test_kv_that_differs_from_the_stored_prefix_is_not_shared(tiny, ids):
    """Sharing is decided by comparing the arrays, not assumed from the tokens: a cache whose
    prefix KV differs from the stored prefix's (another rounding) gets its own copy."""
    model, _ = tiny
    store = PromptCache(model, 1 << 30)
    short = prefilled(model, ids[:16])
    for c in short:
        if getattr(c, "keys", None) is not None:
            c.keys = c.keys + 1e-3  # the same tokens, other numbers
    store.store(ids[:16], short)
    long = prefilled(model, ids[:40])
    store.store(ids[:40], long)
    entry = next(e for e in store._entries.values() if len(e.tokens) == 40)
    assert [(g.start, g.end) for g in entry.segments] == [(0, 40)]
    got, _ = store.fetch(ids[:41])
    assert_same_state(got, long)
    # Evicting the short one frees its own bytes only; the long one is whole.
    store._forget(next(e for e in store._entries.values() if len(e.tokens) == 16))
    assert store.ram_used == sum(s.nbytes for s in capture(long, detach=True))


def test_chat_reuses_a_system_prompt_across_new_conversations(tiny, exact_kernels):
    """Issue 30 in `chat`: the prefill of a new conversation stores a snapshot at the end of the
    system message (as `serve` does); a second new conversation with the same system prompt
    starts there (a "boundary" snapshot) and replies, greedy, as a session without the store."""
    model, tok = tiny
    settings = Settings(system=" ".join(f"Rule {i}: be brief and kind." for i in range(40)),
                        max_tokens=6)

    def reply(session, text):
        out = ""
        for r, _ in session.generate([{"role": "user", "content": text}], settings, "cpu"):
            out += r.text
        return out

    store = PromptCache(model, 1 << 30)
    reply(ChatSession(model, tok, store), "Tell me a joke.")
    assert store.stats()["stores"] == 2  # the system message's boundary, the reply's end
    second = ChatSession(model, tok, store)
    warm = reply(second, "What is two and two?")
    system_only = len(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": settings.system}], add_generation_prompt=False),
        add_special_tokens=False))
    assert second.plan_kind == "stored" and store.last_kind == "boundary"
    assert store.stats()["tokens_by_kind"]["boundary"] == system_only > 300
    assert warm == reply(ChatSession(model, tok), "What is two and two?")
    # The TUI's way: one session, a new conversation after another (ctrl+n), not a new session.
    same = ChatSession(model, tok, PromptCache(model, 1 << 30))
    reply(same, "Tell me a joke.")
    assert reply(same, "What is two and two?") == warm
    assert same.plan_kind == "stored" and same.prompt_cache.last_kind == "boundary"


class _KVOnly:
    """Eight attention layers' caches and nothing else: what the store needs of a model, with
    several KV layers (the tiny model has one), so that "one layer at a time" can be told apart
    from "all at once"."""

    config = {"model_type": "kv-only", "layers": 8}

    def make_cache(self) -> list:
        return [KVCache() for _ in range(8)]


def test_a_spill_writes_one_layer_at_a_time(tmp_path):
    """Issue 28: a snapshot whose KV is shared segments is joined layer by layer as its file is
    written, each layer freed once written: `mx.save_safetensors` of the joined layers held a
    second copy of the whole snapshot (0.5 GiB at 12k tokens of the 35B shape) beside the
    first, over the serve memory planner's figure. The file still restores exactly."""
    model = _KVOnly()
    store = PromptCache(model, 1 << 30, tmp_path, fingerprint="kv-only")
    cache, tokens, step = model.make_cache(), list(range(4096)), 1024
    for end in range(step, len(tokens) + 1, step):
        for c in cache:
            c.update_and_fetch(*(mx.random.normal((1, 2, step, 64)) for _ in range(2)))
        mx.eval([a for c in cache for a in c.arrays])
        store.store(tokens[:end], cache, kind="interval")
    layer = 2 * 2 * len(tokens) * 64 * 4  # one layer's keys and values, float32
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    assert store.flush() == 4
    assert mx.get_peak_memory() - before < 2 * layer  # all eight layers at once: 8 x layer
    got, n = PromptCache(model, 1 << 30, tmp_path, fingerprint="kv-only").fetch(tokens + [0])
    assert n == len(tokens)
    for c, g in zip(cache, got):
        assert mx.array_equal(c.keys[..., :n, :], g.keys[..., :n, :]).item()
        assert mx.array_equal(c.values[..., :n, :], g.values[..., :n, :]).item()
