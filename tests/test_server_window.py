"""`pocket-mlx serve` on `synthetic:tiny` (window 4096): replies without max_tokens run past the
old 512-token default to the end of text or the window; `--max-tokens` caps them; `--alias`
names; the window and the prompts beyond it."""

from __future__ import annotations

import openai
import pytest
from test_server import Server

SYNTH = "synthetic:tiny"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Tell me a long story"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", SYNTH,
               "--alias", "my-model", "--alias", "other name")
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


def test_aliases_are_served_and_unknown_names_get_404_listing_them(server):
    own = server.health()["model"]
    status, _, r = server.request("GET", "/v1/models")
    assert status == 200
    assert [m["id"] for m in r["data"]] == [own, "my-model", "other name"]
    assert {m["context_length"] for m in r["data"]} == {4096}
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    for name in (own, "my-model", "other name"):
        r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=2)
        assert r.usage.completion_tokens == 2
    assert client.models.retrieve("my-model").id == "my-model"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=2)
    message = e.value.body["message"]
    assert "'gpt-4o-mini'" in message and "'my-model'" in message and repr(own) in message
    status, _, r = server.request("POST", "/v1/messages",
                                  {"model": "my-model", "max_tokens": 2, "messages": MSGS})
    assert status == 200, r
    assert "(also answers to my-model, other name)" in server.log.read_text()
