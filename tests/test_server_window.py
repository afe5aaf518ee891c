"""`pocket-mlx serve` on `synthetic:tiny` (window 4096): replies without max_tokens run past the
old 512-token default to the end of text or the window; `--max-tokens` caps them; `--alias`
names; the window and the prompts beyond it."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import test_server
from conftest import ROOT
from test_server import ENV, Server

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
    # Up to ~4000 tokens on a shared CPU: a longer wait than the helper's default.
    status, _, r = server.request("POST", path, {**body, "temperature": 0}, timeout=240)
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


# ---- the window: the model's, --ctx-size, the memory planner's cap ---------------------------

def ids(n: int) -> list[int]:
    """A raw prompt of exactly `n` tokens (completions take token ids as they are)."""
    return [100 + i % 50 for i in range(n)]


def test_prompts_up_to_the_window_are_served_and_longer_ones_get_400(server):
    status, _, r = server.request("POST", "/v1/completions", {"prompt": ids(3000),
                                                              "max_tokens": 2})
    assert status == 200 and r["usage"]["prompt_tokens"] == 3000, r
    status, _, err = server.request("POST", "/v1/completions", {"prompt": ids(6000)})
    assert status == 400, err
    assert "6000" in err["error"]["message"] and "4096" in err["error"]["message"], err
    assert err["error"]["code"] == "context_length_exceeded"
    assert server.health()["status"] == "ok"  # still up, and serving
    status, _, r = server.request("POST", CHAT, {"messages": MSGS, "max_tokens": 2})
    assert status == 200, r
    assert "context 4096 tokens (the model's window)" in server.log.read_text()


def test_ctx_size_serves_a_smaller_window(tmp_path):
    s = Server(tmp_path / "serve.log", "--model", SYNTH, "-c", "1024")
    try:
        status, _, r = s.request("GET", "/v1/models")
        assert r["data"][0]["context_length"] == 1024
        status, _, err = s.request("POST", "/v1/completions", {"prompt": ids(1500)})
        assert status == 400 and "1024" in err["error"]["message"], err
        # no max_tokens: the reply may fill what the smaller window leaves, no more
        status, _, r = s.request("POST", "/v1/completions", {"prompt": ids(1000),
                                                             "temperature": 0})
        assert status == 200, r
        u = r["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] <= 1024, u
        if r["choices"][0]["finish_reason"] == "length":
            assert u["prompt_tokens"] + u["completion_tokens"] == 1024, u
        assert "context 1024 tokens (--ctx-size)" in s.log.read_text()
    finally:
        s.stop()


def test_ctx_size_beyond_the_models_window_exits_2_on_one_line():
    out = test_server.run_serve("--model", SYNTH, "--ctx-size", "8192")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ctx-size 8192" in lines[0] and "4096" in lines[0], lines
    out = test_server.run_serve("--model", SYNTH, "-c", "0")
    assert out.returncode == 2 and "1 or more" in out.stderr


def info_json(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "pocket_mlx", "info", "--model", SYNTH, "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_default_window_is_capped_by_what_fits_beside_the_weights(tmp_path, monkeypatch):
    """On a host whose usable RAM (total less the 4 GiB reserve) holds the weights, the linear
    state, 3000 tokens of KV cache (1 KiB a token in float32 for synthetic:tiny) and the
    prompt cache's 512 MiB (larger than a snapshot of that cache), serve offers 3000 tokens,
    and `info` says the same."""
    d = info_json(ENV)
    assert d["serve_prompt_cache_bytes"] == 512 * 2**20
    spare = d["weights_bytes"] + d["linear_state_bytes"] + 3000 * 1024 + 512 * 2**20
    assert d["kv_cache_bytes"] == 4096 * 1024  # the figure the arithmetic above relies on
    fixture = ROOT / "tests" / "fixtures" / "macos" / "linux-64gb.txt"
    lines = [f"MemTotal: {(4 * 2**30 + spare) // 1024 + 1} kB" if ln.startswith("MemTotal:")
             else ln for ln in fixture.read_text().splitlines()]
    fake = tmp_path / "host.txt"
    fake.write_text("\n".join(lines) + "\n")
    monkeypatch.setitem(ENV, "POCKET_MLX_FAKE_PLATFORM", str(fake))
    e = info_json(ENV)
    assert e["serve_context"] == 3000, (d, e)
    s = Server(tmp_path / "serve.log", "--model", SYNTH)
    try:
        _, _, r = s.request("GET", "/v1/models")
        # The server sizes the weights as loaded (fused projections, the CPU's dtypes): on
        # synthetic:tiny ~73 KiB more than `info`'s stored figure, so a few tokens fewer.
        n = r["data"][0]["context_length"]
        assert 2900 <= n <= 3000, n
        status, _, err = s.request("POST", "/v1/completions", {"prompt": ids(3500)})
        assert status == 400 and str(n) in err["error"]["message"], err
        assert (f"context {n} tokens (what fits in RAM beside the weights; the model's own is "
                "4096)") in s.log.read_text()
    finally:
        s.stop()
    # --ctx-size overrides the planner (the user trades memory knowingly)
    s = Server(tmp_path / "serve2.log", "--model", SYNTH, "--ctx-size", "4096")
    try:
        assert s.request("GET", "/v1/models")[2]["data"][0]["context_length"] == 4096
    finally:
        s.stop()
