"""Continuous batching in `pocket-mlx serve` (server/engine.py, models/batched.py), through a real
server process on the bundled model: clients decoded together get exactly the replies they get
alone, a client that goes away frees its slot for the next queued request within a step, and
memory stays flat over many overlapping requests."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_server import LONG_PROMPT, MODEL, Server, open_stream, rss_bytes, scrape


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("batch") / "serve.log", "--max-concurrency", "4",
               "--max-queue", "8", "--prompt-cache-mb", "0")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


# Requests that end at different steps (length, stop string, EOS), greedy and seeded sampling, a
# repetition penalty: sequences join and leave the batch at different times.
REQUESTS = [
    {"messages": [{"role": "user", "content": "Tell me about cats"}], "max_tokens": 40},
    {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20, "stop": [" and"]},
    {"messages": [{"role": "user", "content": "Tell me about ships"}], "max_tokens": 7},
    {"messages": [{"role": "user", "content": "Tell me about kings"}], "max_tokens": 33,
     "temperature": 1.0, "seed": 7},
    {"messages": [{"role": "user", "content": "Tell me about bread"}], "max_tokens": 25,
     "extra_body": {"repetition_penalty": 1.3}},
    {"messages": [{"role": "user", "content": "A long question about the rain, the sea, the "
                   "wind and the old gold of the fields"}], "max_tokens": 40},
    {"messages": [{"role": "user", "content": "Tell me about fire"}], "max_tokens": 12,
     "temperature": 0.8, "top_p": 0.9, "seed": 123},
    {"messages": [{"role": "user", "content": "Tell me about wine"}], "max_tokens": 40},
]


def stream(client, req: dict) -> tuple[str, str]:
    req = {"temperature": 0, **req}
    chunks = client.chat.completions.create(model=MODEL, stream=True, **req)
    text, reason = [], None
    for ch in chunks:
        if ch.choices:
            text.append(ch.choices[0].delta.content or "")
            reason = ch.choices[0].finish_reason or reason
    return "".join(text), reason


def test_eight_concurrent_streams_equal_sequential_runs(server, client):
    alone = [stream(client, r) for r in REQUESTS]
    before = scrape(server)
    with ThreadPoolExecutor(len(REQUESTS)) as pool:  # 4 decoding together, 4 queued
        together = list(pool.map(lambda r: stream(client, r), REQUESTS))
    after = scrape(server)
    assert together == alone
    assert len({t for t, _ in alone}) == len(alone)
    assert {reason for _, reason in alone} >= {"length", "stop"}
    # They were decoded together: steps advanced more than one sequence on average.
    steps = after["pocket_mlx_decode_steps_total"] - before["pocket_mlx_decode_steps_total"]
    rows = after["pocket_mlx_decode_batch_rows_total"] - before["pocket_mlx_decode_batch_rows_total"]
    assert steps > 0 and rows / steps > 1.5, (rows, steps)


def test_killed_client_frees_its_slot_for_the_next_queued_request(server, client):
    long = {"prompt": LONG_PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
    before = scrape(server)
    held = [open_stream(server, "/v1/completions", long) for _ in range(4)]  # every slot
    try:
        # A fifth request waits in the queue...
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(r=client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)))
        waiter.start()
        deadline = time.monotonic() + 5
        while server.health()["queued"] != 1:
            assert time.monotonic() < deadline, server.health()
            time.sleep(0.01)
        assert server.health()["active"] == 4
        # ...until one generating client goes away: it starts, and the other three go on.
        held.pop().close()
        waiter.join(timeout=5)
        assert not waiter.is_alive() and result["r"].usage.completion_tokens == 5
        h = server.health()
        assert h["active"] == 3 and h["queued"] == 0
        mid = scrape(server)
        assert mid["pocket_mlx_cancelled_total"] == before["pocket_mlx_cancelled_total"] + 1
        assert mid["pocket_mlx_active_requests"] == 3
    finally:
        for s in held:
            s.close()
    server.wait_idle(within_s=3)
    assert scrape(server)["pocket_mlx_cancelled_total"] == before["pocket_mlx_cancelled_total"] + 4


def test_memory_stays_flat_over_200_overlapping_requests(server, client):
    def one(i: int) -> int:
        r = client.completions.create(model=MODEL, prompt=f"Once upon a time {i}",
                                      max_tokens=4 + i % 5, temperature=0)
        return r.usage.completion_tokens

    with ThreadPoolExecutor(6) as pool:  # 4 decoding, 2 queued: joins and leaves every step
        assert all(n >= 1 for n in pool.map(one, range(40)))  # warm up the allocators
        before = rss_bytes(server.proc.pid)
        assert all(n >= 1 for n in pool.map(one, range(200)))
    grown = rss_bytes(server.proc.pid) - before
    assert grown < 24 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 200 requests"
    assert server.health()["active"] == 0
