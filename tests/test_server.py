"""`pocket-mlx serve` as a real server process on the bundled model, driven by the official
`openai` and `anthropic` clients and by raw HTTP (http.client, sockets) for what a client library would refuse to
send. One server serves the whole module (--max-concurrency 1 --max-queue 0, so a second request
while one is generating is a 429); a second one checks the API key and CORS."""

from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import plistlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anthropic
import openai
import pytest
from conftest import ROOT

MODEL = "pocket-tiny"
# A raw prompt whose greedy continuation never ends ("2 2 2 ..." until max_tokens): a long
# generation for the disconnect and 429 tests (~2.3 ms a token on a CPU).
LONG_PROMPT = "1 2 3 4 5 6"
# Each server's data folder (its prompt cache's default place) is a fresh temporary one.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
       "POCKET_MLX_HOME": tempfile.mkdtemp(prefix="pocket-mlx-serve-test-")}
atexit.register(shutil.rmtree, ENV["POCKET_MLX_HOME"], ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m pocket_mlx serve` subprocess, its stderr in a file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pocket_mlx", "serve", "--port", str(self.port), *args],
            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {log.read_text()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError(f"serve did not answer /health in 60 s: {log.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict | None = None, timeout: float = 30) -> tuple[int, dict, dict]:
        """(status, headers, JSON body) of one raw HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            raw = r.read()
            headers = {k.lower(): v for k, v in r.getheaders()}
            is_json = headers.get("content-type", "").startswith("application/json")
            return r.status, headers, json.loads(raw) if is_json else {"text": raw.decode()}
        finally:
            conn.close()

    def health(self) -> dict:
        status, _, body = self.request("GET", "/health")
        assert status == 200
        return body

    def wait_idle(self, within_s: float) -> float:
        """Seconds until no request is active or queued; fails after `within_s`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within_s:
            h = self.health()
            if h["active"] == 0 and h["queued"] == 0:
                return time.monotonic() - t0
            time.sleep(0.02)
        raise AssertionError(f"still busy after {within_s} s: {self.health()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--max-concurrency", "1",
               "--max-queue", "0")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    # max_retries=0: a 429 must show, not be retried away.
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def cli_generate(*args: str) -> dict:
    """`python -m pocket_mlx generate ... --json`: what the server must match."""
    out = subprocess.run([sys.executable, "-m", "pocket_mlx", "generate", *args, "--json"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def open_stream(server: Server, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket and read until the first SSE event (or body) arrives."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    if body.get("stream"):
        got = b""
        while b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    return s


# ---- the OpenAI API, through the official client ---------------------------------------------

def test_health_and_models(server, client):
    h = server.health()
    assert h["status"] == "ok" and h["model"] == MODEL and h["active"] == 0
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_greedy_equals_generate(client):
    ref = cli_generate("--prompt", "Hello", "--max-tokens", "20", "--temp", "0")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == ("stop" if ref["finish_reason"] == "eos" else "length")
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (ref["prompt_tokens"],
                                                      ref["generation_tokens"])
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0

    # The same reply streamed, with the usage chunk at the end.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=20,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    assert len(chunks) > 3  # streamed in pieces, not one blob
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == r.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_equals_generate_raw(client):
    ref = cli_generate("--raw", "--prompt", "Once upon a time", "--max-tokens", "12",
                       "--temp", "0")
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                  temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref["text"]
    assert r.usage.prompt_tokens == ref["prompt_tokens"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                            max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_seed_reproducible_and_equal_to_generate(client):
    ref = cli_generate("--raw", "--prompt", "Once upon a time", "--max-tokens", "30",
                       "--temp", "1", "--seed", "42")

    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30,
                                         temperature=1, seed=seed).choices[0].text

    assert sample(42) == sample(42) == ref["text"]
    assert sample(43) != ref["text"]


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30,
                                     temperature=0).choices[0].text
    stop = full[10:14]
    assert stop.strip() and full.index(stop) >= 5
    for stops in (stop, ["never-there", stop]):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30,
                                      temperature=0, stop=stops)
        assert r.choices[0].text == full[:full.index(stop)]
        assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=20,
        temperature=0, stop=[" and"], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "Go down," and chunks[-1].choices[0].finish_reason == "stop"


def test_finish_reason_length_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_extensions_top_k_min_p_repetition_penalty(client):
    r = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"repetition_penalty": 1.5, "top_k": 5,
                                              "min_p": 0.05})
    plain = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=20,
                                      temperature=0)
    words = plain.choices[0].text.split()
    assert words.count("2") >= 0.8 * len(words)  # greedy falls into a "2 2 2" loop
    assert r.choices[0].text != plain.choices[0].text  # the penalty breaks it


def test_top_p_keeps_only_the_likeliest_tokens(client):
    """top_p so small that one token is left: temperature 1 samples the greedy reply."""
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20,
                                       temperature=0).choices[0].text
    for seed in (1, 2):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20,
                                      temperature=1, top_p=1e-6, seed=seed)
        assert r.choices[0].text == greedy
    loose = {client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20,
                                       temperature=1, top_p=1, seed=seed).choices[0].text
             for seed in (1, 2)}
    assert loose != {greedy}


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def sse_events(server: Server, path: str, body: dict) -> tuple[dict, list[str]]:
    """(headers, the data of each event) of a raw streamed request, the framing checked."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read().decode()
        headers = {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()
    assert r.status == 200 and raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw[:300]
    return headers, [e[len("data: "):] for e in events]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ("/v1/completions", {"prompt": "Once upon a time"})])
def test_sse_framing_and_include_usage(server, path, body):
    headers, events = sse_events(server, path, {**body, "max_tokens": 6, "temperature": 0,
                                                "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    use = chunks[-1]
    assert use["choices"] == [] and use["usage"]["completion_tokens"] == 6
    assert use["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    _, plain = sse_events(server, path, {**body, "max_tokens": 6, "temperature": 0,
                                         "stream": True})
    assert plain[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in plain[:-1])


def test_openai_client_sees_unknown_model_as_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"


# ---- bad input, raw HTTP ---------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
BAD = [
    # (path, body, status, param, code)
    (CHAT, b"{not json", 400, None, "invalid_json"),
    (CHAT, b"\xff\xfe{}", 400, None, "invalid_json"),
    (CHAT, b"[1, 2]", 400, None, "invalid_json"),
    (CHAT, {}, 400, "messages", "missing_required"),
    (CHAT, {"messages": "hi"}, 400, "messages", "invalid_type"),
    (CHAT, {"messages": []}, 400, "messages", "invalid_type"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", "missing_required"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]", "unsupported_parameter"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages",
     "invalid_value"),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    (CHAT, {"messages": MSGS, "temperature": -1}, 400, "temperature", "invalid_value"),
    (CHAT, {"messages": MSGS, "top_p": 2}, 400, "top_p", "invalid_value"),
    (CHAT, {"messages": MSGS, "top_k": 1.5}, 400, "top_k", "invalid_value"),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"messages": MSGS, "max_tokens": 5, "max_completion_tokens": 6}, 400,
     "max_completion_tokens", "invalid_value"),
    (CHAT, {"messages": MSGS, "seed": -1}, 400, "seed", "invalid_value"),
    (CHAT, {"messages": MSGS, "stop": [""]}, 400, "stop", "invalid_value"),
    (CHAT, {"messages": MSGS, "stop": 5}, 400, "stop", "invalid_type"),
    (CHAT, {"messages": MSGS, "stream": "yes"}, 400, "stream", "invalid_type"),
    (CHAT, {"messages": MSGS, "n": 2}, 400, "n", "unsupported_parameter"),
    (CHAT, {"messages": MSGS, "logprobs": "yes"}, 400, "logprobs", "invalid_type"),
    (CHAT, {"messages": MSGS, "logit_bias": [1]}, 400, "logit_bias", "invalid_type"),
    (CHAT, {"messages": MSGS, "frequency_penalty": "high"}, 400, "frequency_penalty",
     "invalid_type"),
    (CHAT, {"messages": MSGS, "response_format": "json"}, 400, "response_format",
     "invalid_type"),
    (CHAT, {"messages": MSGS, "stream": True, "stream_options": True}, 400, "stream_options",
     "invalid_type"),
    (CHAT, {"messages": MSGS, "repeat_penalty": 0}, 400, "repeat_penalty", "invalid_value"),
    # (tool_choice auto or absent: the tools are left out instead, see test_server_tools.py)
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required"}, 400, "tools", "unsupported_parameter"),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice",
     "invalid_value"),
    (CHAT, {"messages": MSGS, "audio": {"voice": "x"}}, 400, "audio", "unsupported_parameter"),
    (CHAT, {"messages": MSGS, "model": "other"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 3000}]}, 400, None,
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/v1/completions", {}, 400, "prompt", "missing_required"),
    ("/v1/nope", {}, 404, None, "not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD,
                         ids=[f"{i}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_error_object(server, path, body, status, param, code):
    got, _, err = server.request("POST", path, body)
    assert got == status, err
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert e["type"] == "invalid_request_error" and e["param"] == param and e["code"] == code
    assert e["message"] and "\n" not in e["message"] and "Traceback" not in e["message"]
    assert server.health()["status"] == "ok"  # still serving
    # One line in the server's log names it.
    message = " ".join(e["message"].split()).encode("utf-8", "backslashreplace").decode()
    line = f"{status} POST {path}: {message}"  # stderr writes a lone surrogate as \\udcff
    assert server.log.read_text().count(line) >= 1


def test_oversized_body_is_413(server):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (9 * 2**20)}]}).encode()
    status, _, err = server.request("POST", CHAT, body)
    assert status == 413 and err["error"]["code"] == "body_too_large"
    assert server.health()["status"] == "ok"


def test_oversized_chunked_body_is_413(server):
    """No Content-Length (chunked upload): the limit still holds, the server still serves."""
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(9):
            yield b"x" * 2**20
        yield b'"}]}'

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", CHAT, body=chunks(), encode_chunked=True,
                     headers={"Content-Type": "application/json",
                              "Transfer-Encoding": "chunked"})
        r = conn.getresponse()
        err = json.loads(r.read())
    finally:
        conn.close()
    assert r.status == 413 and err["error"]["code"] == "body_too_large"
    assert server.health()["status"] == "ok"


def test_wrong_method_is_405(server):
    status, _, err = server.request("GET", CHAT)
    assert status == 405 and err["error"]["code"] == "method_not_allowed"


# ---- slots: 429, and a client that goes away frees its slot ---------------------------------

LONG = {"prompt": LONG_PROMPT, "max_tokens": 2000, "temperature": 0}  # ~4.6 s to finish


def test_busy_server_answers_429_with_retry_after(server):
    first = open_stream(server, "/v1/completions", {**LONG, "stream": True})
    try:
        assert server.health()["active"] == 1
        status, headers, err = server.request("POST", "/v1/completions",
                                              {"prompt": "x", "max_tokens": 1})
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert err["error"]["code"] == "rate_limit_exceeded"
    finally:
        first.close()
    server.wait_idle(within_s=2)


# A chat prompt whose greedy reply runs to max_tokens too (a story that does not end).
LONG_CHAT = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 2000,
             "temperature": 0}


@pytest.mark.parametrize("path,body,stream", [
    ("/v1/completions", LONG, True), ("/v1/completions", LONG, False),
    (CHAT, LONG_CHAT, True), ("/v1/messages", LONG_CHAT, True),
    ("/v1/messages", LONG_CHAT, False)])
def test_disconnect_stops_generation_and_frees_slot(server, path, body, stream):
    log_before = server.log.read_text().count("the client went away; stopped")
    s = open_stream(server, path, {**body, "stream": stream})
    time.sleep(0.3)  # generating: the whole reply would take ~4.6 s
    assert server.health()["active"] == 1
    t0 = time.monotonic()
    s.close()
    server.wait_idle(within_s=2.5)  # sooner than the ~4 s the reply still had to run
    r = server.request("POST", "/v1/completions", {"prompt": "Once upon a time",
                                                   "max_tokens": 5, "temperature": 0})
    assert r[0] == 200 and r[2]["usage"]["completion_tokens"] == 5
    assert time.monotonic() - t0 < 3.5
    assert server.log.read_text().count("the client went away; stopped") == log_before + 1


# ---- the command line: refusals, API key, CORS, launchd --------------------------------------

def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "serve", *args], cwd=ROOT,
                          env={k: v for k, v in ENV.items() if k != "POCKET_MLX_API_KEY"},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args,words", [
    (["--host", "0.0.0.0"], "--api-key"),
    (["--host", "192.168.1.20", "--port", "9"], "--api-key"),
    (["--max-concurrency", "0"], "1 or more"),
    (["--port", "70000"], "TCP port"),
    (["--model", "/no/such/model"], "no such model folder"),
    (["--alias", " padded"], "argument --alias"),
    (["--alias", ""], "argument --alias"),
])
def test_refusals_exit_2_on_one_line(args, words):
    out = run_serve(*args)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and words in out.stderr
    assert "Traceback" not in out.stderr


def test_taken_port_exits_2_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = run_serve("--port", str(s.getsockname()[1]))
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_api_key_and_cors(tmp_path):
    key = "s3cret-key"
    s = Server(tmp_path / "serve.log", "--api-key", key, "--cors", "http://localhost:3000")
    try:
        assert s.request("GET", "/health")[0] == 200  # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            status, h, err = s.request("GET", "/v1/models", headers=headers)
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
            assert h["www-authenticate"] == "Bearer"
        assert s.request("GET", "/metrics")[0] == 401
        good = openai.OpenAI(base_url=s.url, api_key=key, max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        bad = openai.OpenAI(base_url=s.url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        # Anthropic's clients send x-api-key; the error is in Anthropic's shape.
        msg = {"max_tokens": 2, "messages": MSGS}
        status, _, err = s.request("POST", "/v1/messages", msg, headers={"x-api-key": "nope"})
        assert status == 401 and err["error"]["type"] == "authentication_error"
        assert s.request("POST", "/v1/messages", msg, headers={"x-api-key": key})[0] == 200
        # The key is checked per route: an unknown path or a wrong method answers as it would
        # without a key, and each 401 counts under its own route in /metrics.
        assert s.request("GET", "/no-such-path")[0] == 404
        assert s.request("GET", CHAT)[0] == 405
        _, _, m = s.request("GET", "/metrics", headers={"x-api-key": key})
        for route, n in (("/v1/models", 3), ("/metrics", 1), (CHAT, 1), ("/v1/messages", 1)):
            assert f'requests_total{{endpoint="{route}",status="401"}} {n}\n' in m["text"]
        status, h, _ = s.request("GET", "/v1/models", headers={
            "Authorization": f"Bearer {key}", "Origin": "http://localhost:3000"})
        assert status == 200 and h["access-control-allow-origin"] == "http://localhost:3000"
        status, h, _ = s.request("OPTIONS", CHAT, headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert status == 200 and "POST" in h["access-control-allow-methods"]
    finally:
        s.stop()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_no_cors_headers_without_cors(server):
    _, h, _ = server.request("GET", "/v1/models", headers={"Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in h


def test_print_launchd():
    out = run_serve("--print-launchd", "--port", "8123", "--api-key", "k&y<1>")
    assert out.returncode == 0, out.stderr
    plist = plistlib.loads(out.stdout.encode())
    assert plist["Label"] == "com.pocket-mlx.serve"
    argv = plist["ProgramArguments"]
    assert argv[:4] == [sys.executable, "-m", "pocket_mlx", "serve"]
    assert argv[argv.index("--port") + 1] == "8123"
    assert "--print-launchd" not in argv and "k&y<1>" not in argv  # the key is not in argv
    assert plist["EnvironmentVariables"] == {"POCKET_MLX_API_KEY": "k&y<1>"}
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    assert "launchctl bootstrap gui/" in out.stderr


# ---- the prompt-cache plug point, in process ---------------------------------------------------

class OnePrefixCache:
    """The smallest real PrefixStore: keeps the last stored cache and hands it out (once) to a
    prompt that extends its tokens."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.cache: list | None = None
        self.stored: list[list[int]] = []

    def fetch(self, tokens):
        n = len(self.tokens)
        if self.cache is not None and n < len(tokens) and list(tokens[:n]) == self.tokens:
            cache, self.cache = self.cache, None
            return cache, n
        return None, 0

    def store(self, tokens, cache, kind="end"):
        self.tokens, self.cache = list(tokens), cache
        self.stored.append(list(tokens))


def test_engine_uses_a_plugged_prompt_cache():
    import asyncio

    from pocket_mlx.server.jobs import Done, Piece, Started
    from pocket_mlx.server.requests import GenRequest, Sampling
    from pocket_mlx.server.worker import ServeWorker

    store = OnePrefixCache()
    engine = ServeWorker(None, "cpu", max_queue=0, prompt_cache=store)

    def store_hit(ids: list[int]) -> int:
        n = len(store.tokens)
        return n if store.cache is not None and n < len(ids) and ids[:n] == store.tokens else 0

    engine.start()

    def run(ids: list[int], max_tokens: int) -> tuple[str, Done]:
        async def go():
            req = GenRequest(kind="completion", model=None, prompt=ids, max_tokens=max_tokens,
                             sampling=Sampling.checked({"temperature": 0.0}))
            hit = store_hit(ids)  # before the engine takes the cache
            job = engine.submit(engine.encode(req), req, asyncio.get_running_loop())
            text = []
            assert await job.events.get() == Started(len(ids), hit)
            while not isinstance(ev := await job.events.get(), Done):
                assert isinstance(ev, Piece), ev
                text.append(ev.text)
            return "".join(text), ev

        return asyncio.run(go())

    try:
        first = engine.tokenizer.encode("Once upon a time")
        rest = engine.tokenizer.encode(" there was a king")
        cold_text, cold = run(first + rest, 8)
        assert cold.cached_tokens == 0
        # One reply token: the cache then holds exactly the prompt (the token with no successor
        # was never fed), stored under those tokens.
        run(first, 1)
        assert store.stored[-1] == first
        warm_text, warm = run(first + rest, 8)
        assert warm.cached_tokens == len(first) and warm.prompt_tokens == len(first + rest)
        # Only `rest` was prefilled, on top of the stored cache: the reply is that of the same
        # cache continued in process. (Not always the cold reply: a cold prefill chunks the
        # prompt otherwise, which can move the last bits of a logit, and a greedy token.)
        from pocket_mlx.engine.generation import generate

        ref = engine.model.make_cache()
        generate(engine.model, engine.tokenizer, first, max_tokens=1, cache=ref, temperature=0.0,
                 device="cpu")
        assert warm_text == generate(engine.model, engine.tokenizer, rest, max_tokens=8,
                                     cache=ref, temperature=0.0, device="cpu")
        assert cold_text
        assert store.cache is not None and store.tokens[:len(first + rest)] == first + rest
        m = engine.metrics
        assert (m.cache_lookups, m.cache_hits, m.cached_tokens) == (3, 1, len(first))
    finally:
        engine.stop()


# ---- /metrics --------------------------------------------------------------------------------

def scrape(server: Server) -> dict[str, float]:
    """GET /metrics, checked line by line against the text format, as {series: value}."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    assert r.status == 200 and r.getheader("content-type").startswith("text/plain; version=0.0.4")
    out: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("# HELP "):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{")[0]
        assert name.startswith("pocket_mlx_") and any(name.startswith(t) for t in typed), line
        out[series] = float(value)
    return out


def test_metrics_count_what_happened(server, client):
    before = scrape(server)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7,
                                  temperature=0)
    server.request("POST", "/v1/completions", {"prompt": "x", "n": 3})
    after = scrape(server)

    def delta(series: str) -> float:
        return after.get(series, 0) - before.get(series, 0)

    assert delta('pocket_mlx_requests_total{endpoint="/v1/completions",status="200"}') == 1
    assert delta('pocket_mlx_requests_total{endpoint="/v1/completions",status="400"}') == 1
    assert delta("pocket_mlx_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("pocket_mlx_completion_tokens_total") == 7
    assert delta("pocket_mlx_prompt_cache_lookups_total") == 1
    assert delta("pocket_mlx_prompt_cache_hits_total") == 0
    assert delta("pocket_mlx_ttft_seconds_count") == 1
    assert delta('pocket_mlx_ttft_seconds_bucket{le="+Inf"}') == 1
    assert delta("pocket_mlx_token_latency_seconds_count") == 6  # 7 tokens, 6 gaps
    assert after["pocket_mlx_weight_bytes_per_token"] > 0
    assert after["pocket_mlx_decode_tokens_per_second"] > 0
    assert after["pocket_mlx_decode_gigabytes_per_second"] == pytest.approx(
        after["pocket_mlx_weight_bytes_per_token"] * after["pocket_mlx_decode_tokens_per_second"]
        / 1e9, rel=1e-2, abs=1e-3)
    assert after["pocket_mlx_active_requests"] == 0 and after["pocket_mlx_queued_requests"] == 0
    # Buckets are cumulative.
    buckets = [v for k, v in after.items() if k.startswith("pocket_mlx_token_latency_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after["pocket_mlx_token_latency_seconds_count"]


# ---- Anthropic's Messages API, through the official client ------------------------------------

@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused",
                               max_retries=0, timeout=60)


def test_messages_greedy_equals_generate(claude):
    ref = cli_generate("--prompt", "Hello", "--system", "Be brief.", "--max-tokens", "20",
                       "--temp", "0")
    # temperature goes in extra_body: newer anthropic clients dropped the keyword.
    r = claude.messages.create(model=MODEL, max_tokens=20, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello"}],
                               extra_body={"temperature": 0})
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ref["text"]
    assert r.stop_reason == ("end_turn" if ref["finish_reason"] == "eos" else "max_tokens")
    assert r.usage.input_tokens == ref["prompt_tokens"]
    assert r.usage.output_tokens == ref["generation_tokens"]
    assert r.usage.cache_read_input_tokens == 0
    # System as blocks, content as blocks: the same prompt.
    r2 = claude.messages.create(model=MODEL, max_tokens=20,
                                system=[{"type": "text", "text": "Be brief."}],
                                messages=[{"role": "user", "content": [
                                    {"type": "text", "text": "Hel"},
                                    {"type": "text", "text": "lo"}]}],
                                extra_body={"temperature": 0})
    assert r2.content[0].text == ref["text"]


def test_messages_count_tokens(claude):
    body = {"system": "Be brief.", "messages": [{"role": "user", "content": "Hello"}]}
    n = claude.messages.count_tokens(model=MODEL, **body).input_tokens
    r = claude.messages.create(model=MODEL, max_tokens=2, extra_body={"temperature": 0}, **body)
    assert n == r.usage.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="claude-x", **body)


def test_messages_stream_and_stop_sequence(claude):
    with claude.messages.stream(model=MODEL, max_tokens=20,
                                messages=[{"role": "user", "content": "Hello"}],
                                stop_sequences=["never-there", " and"],
                                extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 2 and "".join(pieces) == "Go down,"
    assert final.content[0].text == "Go down,"
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == " and"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=3, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3


MSG = "/v1/messages"
BAD_MESSAGES = [
    # (body, status, Anthropic error type)
    ({"messages": MSGS}, 400, "invalid_request_error"),  # no max_tokens
    ({"max_tokens": 5}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": "x"}]}, 400,
     "invalid_request_error"),  # prefill
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "temperature": "hot"}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "thinking": "on"}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "mcp_servers": [{"url": "x"}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "stop_sequences": "x"}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "model": "claude-x"}, 404, "not_found_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 3000}]}, 400,
     "invalid_request_error"),
]


@pytest.mark.parametrize("body,status,kind", BAD_MESSAGES,
                         ids=[str(i) for i in range(len(BAD_MESSAGES))])
def test_messages_bad_input_gets_anthropic_error(server, body, status, kind):
    got, _, err = server.request("POST", MSG, body)
    assert got == status, err
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == kind and err["error"]["message"]
    assert server.health()["status"] == "ok"


def test_messages_harmless_fields_are_accepted(server):
    status, _, r = server.request("POST", MSG, {
        "max_tokens": 3, "messages": MSGS, "temperature": 0, "metadata": {"user_id": "u"},
        "cache_control": {"type": "ephemeral"}, "service_tier": "auto", "speed": "standard"})
    assert status == 200 and r["usage"]["output_tokens"] <= 3


# ---- many clients at once, and many requests in a row ------------------------------------------

def rss_bytes(pid: int) -> int:
    """Resident memory of a process (`ps` reports KiB on Linux and macOS alike)."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[0]) * 1024


def test_concurrent_streams_match_sequential_and_memory_stays_flat(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    # A 4 MiB prompt cache: its entries may take that much RAM (the rest spills to disk),
    # nothing else may grow.
    s = Server(tmp_path / "serve.log", "--max-queue", "8", "--prompt-cache-mb", "4")
    try:
        c = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
        prompts = [f"Tell me about {w}" for w in ("cats", "ships", "kings", "bread", "rain",
                                                   "gold", "fire", "wine")]

        def stream(prompt: str) -> str:
            chunks = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=40,
                temperature=0, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

        with ThreadPoolExecutor(8) as pool:  # 1 generating + 7 queued: none refused
            together = list(pool.map(stream, prompts))
        alone = [stream(p) for p in prompts]
        assert together == alone and len(set(alone)) > 1

        def burst(n: int) -> None:
            for i in range(n):
                r = c.completions.create(model=MODEL, prompt=f"Once upon a time {i}",
                                         max_tokens=6, temperature=0)
                assert r.usage.completion_tokens >= 1

        burst(20)  # warm: MLX's buffer cache and Python's allocator settle
        before = rss_bytes(s.proc.pid)
        burst(200)
        grown = rss_bytes(s.proc.pid) - before
        assert grown < 24 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 200 requests"
        assert s.health()["active"] == 0
    finally:
        s.stop()


# ---- an unexpected failure: 500 with a generic message, one log line, still serving ------------

class BrokenOnceCache:
    """A prompt-cache store with a bug that shows on its first lookup only."""

    def __init__(self) -> None:
        self.calls = 0

    def fetch(self, tokens):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("store index corrupt\nsecond line")
        return None, 0

    def store(self, tokens, cache, kind="end"):
        return None


def test_unexpected_failure_is_a_generic_500_and_the_server_goes_on(caplog):
    import threading

    import uvicorn

    from pocket_mlx.server.app import create_app
    from pocket_mlx.server.worker import ServeWorker

    caplog.set_level(logging.INFO, logger="pocket_mlx")
    engine = ServeWorker(None, "cpu", max_queue=0, prompt_cache=BrokenOnceCache())
    engine.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0)
        err = e.value.body
        assert e.value.status_code == 500 and err["type"] == "server_error"
        assert "corrupt" not in err["message"] and "Traceback" not in err["message"]
        failed = [r.getMessage() for r in caplog.records if "RuntimeError" in r.getMessage()]
        assert len(failed) == 1 and "store index corrupt; second line" in failed[0]
        # The next request is served.
        r = c.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()


def test_prompt_cache_second_turn_and_after_a_restart(tmp_path):
    """The second turn of a conversation prefills only what follows the first turn's prompt and
    reply; after a restart with the same --prompt-cache-dir, the second turn alone (nothing
    else was asked of the new server) still hits, from the disk tier."""
    folder = tmp_path / "prompt-cache"
    m1 = [{"role": "user", "content": "Tell me a fortune."}]

    def chat(server: Server, messages: list[dict], n: int):
        c = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        return c.chat.completions.create(model="pocket-tiny", messages=messages, max_tokens=n,
                                         temperature=0)

    first = Server(tmp_path / "a.log", "--prompt-cache-dir", str(folder))
    try:
        r1 = chat(first, m1, 12)
        m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                   {"role": "user", "content": "And another one."}]
        r2 = chat(first, m2, 4)
        held = scrape(first)
    finally:
        first.stop()  # SIGTERM, as launchd stops it: RAM entries are written to disk
    # A clean stop on SIGTERM (not SIGABRT from MLX's teardown after thread use).
    assert first.proc.returncode == 0
    assert held['pocket_mlx_prompt_cache_entries{tier="ram"}'] == 2  # one per reply
    assert held['pocket_mlx_prompt_cache_bytes{tier="ram"}'] > 0
    u1, u2 = r1.usage, r2.usage
    assert u1.prompt_tokens_details.cached_tokens == 0
    # Everything the model was fed in turn 1: its prompt and its reply but the last token
    # (generated, never fed back).
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1
    assert list(folder.rglob("*.safetensors"))

    second = Server(tmp_path / "b.log", "--prompt-cache-dir", str(folder))
    try:
        again = chat(second, m2, 4)
    finally:
        second.stop()
    assert again.usage.prompt_tokens_details.cached_tokens == \
        u2.prompt_tokens_details.cached_tokens
    assert again.choices[0].message.content == r2.choices[0].message.content
