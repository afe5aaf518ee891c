"""Snapshots inside a prompt (issue 30): a system prompt shared by two conversations, and a
history resent with a new last message, are reused from the prompt cache; greedy replies are
the same as a cold server's, after a restart (disk tier) too. Real `serve` subprocesses on the
bundled model, real snapshots, real HTTP."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from conftest import ASSET
from test_server import Server

from pocket_mlx.engine.loader import load
from pocket_mlx.engine.prompt_cache import PromptCache
from pocket_mlx.server.prompts import message_boundaries
from pocket_mlx.server.requests import GenRequest

# A long system prompt (~1,300 tokens on the bundled tokenizer), as agents and UIs send.
SYSTEM = " ".join(f"Rule {i}: answer the user about topic {i * 7 % 53} politely, briefly and "
                  f"without guessing." for i in range(45))


@pytest.fixture(scope="module")
def tok():
    return load(ASSET, device="cpu")[1]


def chat(server: Server, messages: list[dict]) -> tuple[str, int, int]:
    """(reply text, prompt tokens, cached tokens) of a greedy chat request."""
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": messages, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    use = body["usage"]
    return (body["choices"][0]["message"]["content"], use["prompt_tokens"],
            use["prompt_tokens_details"]["cached_tokens"])


def prefix_tokens(tok, messages: list[dict]) -> int:
    """Tokens of `messages` as the template renders them, without a generation prompt."""
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False),
                          add_special_tokens=False))


def test_message_boundaries_are_true_token_prefixes(tok):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}]
    req = GenRequest(kind="chat", model=None, messages=msgs)
    ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    got = message_boundaries(tok, req, ids)
    # Not the end of "Why?": too close to the boundary before it (kept instead).
    assert got == [prefix_tokens(tok, msgs[:k]) for k in (1, 2, 3)]
    # The end of a longer last message too: the next turn shares the prompt up to there.
    longer = msgs[:3] + [{"role": "user", "content": "Why is that so? " * 8}]
    req = GenRequest(kind="chat", model=None, messages=longer)
    ids_longer = tok.encode(tok.apply_chat_template(longer), add_special_tokens=False)
    assert message_boundaries(tok, req, ids_longer) == [prefix_tokens(tok, longer[:k])
                                                        for k in (1, 2, 3, 4)]
    assert prefix_tokens(tok, msgs[:1]) > 1000
    # A prompt that does not start with the rendered messages has no boundary in it.
    assert message_boundaries(tok, req, ids[1:]) == []


def test_shared_prefix_reused_and_greedy_replies_unchanged(tmp_path, tok):
    cold = Server(tmp_path / "cold.log", "--prompt-cache-mb", "0")
    try:
        def cold_reply(messages):
            text, _, cached = chat(cold, messages)
            assert cached == 0
            return text
        a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a joke."}]
        b = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2?"}]
        c = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}]
        # A history the client kept (replies this server never wrote), then resent with only its
        # last user message changed.
        h = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": "Tell me about ships."},
             {"role": "assistant", "content": "Ships carry goods across the sea."}]
        h1 = h + [{"role": "user", "content": "And trains?"}]
        h2 = h + [{"role": "user", "content": "And planes, then?"}]
        want = {k: cold_reply(m) for k, m in {"a": a, "b": b, "c": c, "h2": h2}.items()}
    finally:
        cold.stop()

    cache_dir = tmp_path / "cache"
    warm = Server(tmp_path / "warm.log", "--prompt-cache-dir", str(cache_dir))
    n_sys = prefix_tokens(tok, a[:1])
    try:
        text, n_a, cached = chat(warm, a)
        assert (text, cached) == (want["a"], 0)
        text, n_b, cached = chat(warm, b)
        assert text == want["b"]
        assert n_sys <= cached < n_b, (n_sys, cached, n_b)
        chat(warm, h1)
        text, _, cached = chat(warm, h2)
        assert text == want["h2"]
        assert cached >= prefix_tokens(tok, h), cached
        # The Anthropic endpoint shares the store: the system prompt is found again.
        status, _, body = warm.request("POST", "/v1/messages", {
            "model": "pocket-tiny", "system": SYSTEM, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "One more?"}]})
        assert status == 200, body
        assert body["usage"]["cache_read_input_tokens"] >= n_sys
        status, _, metrics = warm.request("GET", "/metrics")
        m = re.search(r'pocket_mlx_prompt_cache_reused_tokens_total\{kind="boundary"\} (\d+)',
                      metrics["text"])
        assert m and int(m.group(1)) >= 2 * n_sys + prefix_tokens(tok, h), metrics["text"]
    finally:
        warm.stop()
    log = (tmp_path / "warm.log").read_text()
    assert re.search(rf"prompt cache: reused {n_sys} of {n_b} prompt tokens \(boundary "
                     r"snapshot\)", log), log
    assert "Traceback" not in log

    # After a restart the disk tier still holds the system prompt's snapshot.
    again = Server(tmp_path / "again.log", "--prompt-cache-dir", str(cache_dir))
    try:
        text, n_c, cached = chat(again, c)
        assert text == want["c"]
        assert n_sys <= cached < n_c
    finally:
        again.stop()


def test_eviction_keeps_a_often_hit_prefix_over_one_off_tails(tok):
    model = load(ASSET, device="cpu")[0]
    ids = tok.encode(SYSTEM)[:200]

    def filled(n):
        cache = model.make_cache()
        model(mx.array(ids[:n])[None], cache=cache)
        return cache

    def size(n):
        probe = PromptCache(model, 1 << 40)
        probe.store(ids[:n], filled(n))
        return probe.ram_used

    # Room for the prefix and two of the four tails below: plain LRU would drop the prefix.
    store = PromptCache(model, size(100) + size(50) + size(40) + size(30) // 2)
    store.store(ids[:100], filled(100), kind="boundary")
    for _ in range(3):
        assert store.fetch(ids[:150])[1] == 100
    assert store.last_kind == "boundary"
    # Newer one-off tails (never hit) push the budget: they go, the shared prefix stays.
    for n in (20, 30, 40, 50):
        store.store(ids[:n], filled(n), kind="end")
    assert store.fetch(ids[:150])[1] == 100
    assert store.evictions == 2
    assert store.stats()["tokens_by_kind"]["boundary"] == 400


def test_store_refuses_an_unknown_kind(tok):
    model = load(ASSET, device="cpu")[0]
    store = PromptCache(model, 1 << 30)
    with pytest.raises(ValueError, match="snapshot kind"):
        store.store([1, 2], model.make_cache(), kind="middle")


def test_chunk_points_leave_no_short_piece_and_keep_the_later_of_two_close_points():
    from pocket_mlx.engine.snapshot_points import chunk_points as _chunk_points

    pts = [(10, "boundary"), (100, "boundary"), (110, "boundary"), (1024, "interval"),
           (1030, "boundary"), (2000, "boundary")]
    # 10: too close to the start; 100 and 110: the later wins; 1024 vs 1030: 1030 wins;
    # 2000 is the last prompt token (fed alone, never a point).
    assert _chunk_points(pts, 0, 2000) == [(110, "boundary"), (1030, "boundary")]
    # Past a cached prefix only, 16+ tokens past it.
    assert _chunk_points([(100, "boundary"), (120, "interval"), (700, "boundary")], 110,
                         900) == [(700, "boundary")]


def test_chunk_size_never_leaves_a_short_piece_before_a_point():
    from pocket_mlx.engine.snapshot_points import chunk_size

    assert chunk_size(0, 600, 512, 515) == 499  # then 16, not 512 then 3
    assert chunk_size(499, 101, 512, 515) == 16
    assert chunk_size(0, 600, 512, 528) == 512  # 16 left: fine
    assert chunk_size(0, 600, 512, 300) == 300
    assert chunk_size(0, 600, 512, None) == 512 and chunk_size(0, 40, 512, None) == 40
    # From a snapshot at 1024 the rest splits as a cold prefill splits it past 1024.
    cold, pos = [], 0
    for point in (1024, 2056):
        while pos < point:
            cold.append(n := chunk_size(pos, 2500 - pos, 512, point))
            pos += n
    assert cold == [512, 512, 512, 504, 16]


def test_prefill_split_into_pieces_of_16_or_more_gives_the_same_logits(tok):
    """The ground the chunk points stand on: where a prompt is split does not change the
    result while every piece takes the chunked Gated DeltaNet path (16+ tokens)."""
    model = load(ASSET, device="cpu")[0]
    ids = tok.encode(SYSTEM)[:300]

    def last_logits(splits):
        cache, pos, out = model.make_cache(), 0, None
        for end in [*splits, len(ids)]:
            out = model(mx.array(ids[pos:end])[None], cache=cache)
            pos = end
        return np.array(out[0, -1])

    whole = last_logits([])
    for splits in ([100], [64, 128], [200, 250]):
        assert np.array_equal(last_logits(splits), whole), splits
