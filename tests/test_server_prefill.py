"""A long prompt's prefill shows its progress (issue 28): `serve --prefill-step 32` on
`synthetic:tiny`, so a ~600-token prompt runs in many chunks; each one is a log line (done /
total, chunk time, rate, ETA) and counts in /metrics, and a stream already decoding keeps
receiving tokens between the chunks."""

from __future__ import annotations

import re
import threading
import time

import pytest
from test_server import Server, scrape, sse_events

SYNTH = "synthetic:tiny"
CHAT = "/v1/chat/completions"
STEP = 32
LINE = re.compile(r"prefill req (\d+): (\d+)/(\d+) tokens, chunk (\d+) in [0-9.]+ s, "
                  r"[0-9.]+ tok/s, (ETA \d+ s|done)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", SYNTH,
               "--prefill-step", str(STEP), "--prompt-cache-mb", "0")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


def long_text(words: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(words))


def test_long_prefill_logs_progress_and_counts_in_metrics(server):
    before = scrape(server)
    status, _, r = server.request("POST", CHAT, {
        "messages": [{"role": "user", "content": long_text(300)}], "max_tokens": 1})
    assert status == 200, r
    n = r["usage"]["prompt_tokens"]
    assert n > 8 * STEP
    after = scrape(server)
    lines = [m.groups() for m in LINE.finditer(server.log.read_text())]
    assert lines, server.log.read_text()
    req = lines[-1][0]
    mine = [(int(done), int(total), int(chunk), end) for r_, done, total, chunk, end in lines
            if r_ == req]
    done = [d for d, _, _, _ in mine]
    assert all(t == n for _, t, _, _ in mine)
    assert done == sorted(done) and done[-1] == n and mine[-1][3] == "done"
    assert all(c <= STEP for _, _, c, _ in mine) and sum(c for _, _, c, _ in mine) == n
    assert all(e.startswith("ETA") for *_, e in mine[:-1])
    assert f"prefill req {req}: {n} of {n} prompt tokens to prefill (0 cached)" in \
        server.log.read_text()

    def delta(series: str) -> float:
        return after[series] - before.get(series, 0)

    assert delta("pocket_mlx_prompt_tokens_prefilled_total") == n
    assert delta("pocket_mlx_prefill_chunk_seconds_count") == len(mine)
    assert after["pocket_mlx_prefill_tokens_pending"] == 0
    assert after["pocket_mlx_prefill_requests"] == 0


def test_pending_tokens_show_while_a_prompt_prefills(server):
    """/metrics during a prefill of many chunks: tokens pending, fewer as chunks run."""
    seen: list[tuple[float, float]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            m = scrape(server)
            if m["pocket_mlx_prefill_requests"]:
                seen.append((m["pocket_mlx_prefill_tokens_pending"],
                             m["pocket_mlx_prompt_tokens_prefilled_total"]))
            time.sleep(0.005)

    t = threading.Thread(target=watch)
    t.start()
    try:
        status, _, r = server.request("POST", CHAT, {
            "messages": [{"role": "user", "content": long_text(600)}], "max_tokens": 1},
            timeout=120)
    finally:
        stop.set()
        t.join()
    assert status == 200, r
    assert seen, "no scrape fell inside the prefill"
    n = r["usage"]["prompt_tokens"]
    assert all(0 < pending <= n for pending, _ in seen), seen
    pending = [p for p, _ in seen]
    assert pending == sorted(pending, reverse=True) and len(set(pending)) > 1, seen
    assert [p for _, p in seen] == sorted(p for _, p in seen)


def test_a_decoding_stream_gets_tokens_between_the_chunks(server):
    """A stream decoding when a long prompt arrives receives pieces before that prompt's first
    token: the prefill runs a chunk at a time, with decode steps between."""
    out: dict = {}

    def decode() -> None:
        out["a"] = sse_events(server, CHAT, {
            "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 400,
            "temperature": 0, "stream": True})

    ta = threading.Thread(target=decode)
    ta.start()
    deadline = time.monotonic() + 30
    while scrape(server)["pocket_mlx_decode_steps_total"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    before = scrape(server)["pocket_mlx_decode_steps_total"]
    status, _, r = server.request("POST", CHAT, {
        "messages": [{"role": "user", "content": long_text(700)}], "max_tokens": 1})
    ta.join()
    assert status == 200, r
    chunks = r["usage"]["prompt_tokens"] // STEP
    log = server.log.read_text()
    req = [m.group(1) for m in LINE.finditer(log)][-1]
    mine = [m for m in LINE.finditer(log) if m.group(1) == req]
    assert len(mine) >= chunks
    # One decode step of the other stream between any two chunks of the long prompt.
    assert scrape(server)["pocket_mlx_decode_steps_total"] - before >= chunks
