"""`pocket-mlx serve` on `synthetic:tiny` (window 4096): replies without max_tokens run past the
old 512-token default to the end of text or the window; `--max-tokens` caps them."""

from __future__ import annotations

import pytest
from test_server import Server

SYNTH = "synthetic:tiny"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Tell me a long story"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", SYNTH)
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": MSGS}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
])
def test_no_max_tokens_runs_past_512_to_eos_or_window(server, path, body):
    status, _, r = server.request("POST", path, {**body, "temperature": 0})
    assert status == 200, r
    usage, finish = r["usage"], r["choices"][0]["finish_reason"]
    assert usage["completion_tokens"] > 512, usage
    assert finish in ("stop", "length")
    if finish == "length":  # only a full window ends a reply that has no cap
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 4096, usage


def test_max_tokens_flag_caps_requests_without_one(tmp_path):
    s = Server(tmp_path / "serve.log", "--model", SYNTH, "--max-tokens", "40")
    try:
        status, _, r = s.request("POST", CHAT, {"messages": MSGS, "temperature": 0})
        assert status == 200, r
        assert r["usage"]["completion_tokens"] <= 40
        assert r["choices"][0]["finish_reason"] in ("stop", "length")
        status, _, r = s.request("POST", CHAT, {"messages": MSGS, "temperature": 0,
                                                "max_tokens": 60})
        assert status == 200 and r["usage"]["completion_tokens"] > 40, r  # the request's own wins
    finally:
        s.stop()
