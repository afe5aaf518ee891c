"""Ollama's API on `pocket-mlx serve`, as the apps that speak only Ollama call it: the official
`ollama` Python client (0.6.3) against a real server process on the bundled model (list, show,
ps, chat and generate whole and streamed, options, names, embeddings, the liveness probe, bad
input) and on the tool-trained fixture (a tool call in Ollama's shape, and its round trip).
Raw HTTP (test_server.py's `Server.request`) for what the client would not send. The parser's
field mapping is checked on its own first (no server).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys

import ollama
import openai
import pytest
from conftest import ASSET, ROOT
from test_server import Server

from pocket_mlx.server import ollama as wire
from pocket_mlx.server.jobs import Call, Done, Reasoning
from pocket_mlx.server.requests import ApiError, Sampling
from pocket_mlx.server.routes_ollama import capabilities
from pocket_mlx.server.tools import ToolCall

sys.path.insert(0, str(ROOT / "scripts"))
import make_tool_model as tm  # noqa: E402

MODEL = "pocket-tiny"
GREEDY = {"temperature": 0, "num_predict": 12}
HI = [{"role": "user", "content": "Hello"}]


# ---- the parser, no server -------------------------------------------------------------------

def test_options_map_to_the_request():
    req = wire.parse_chat({"model": "m", "messages": HI, "options": {
        "num_predict": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "seed": 3, "stop": ["\n"], "repeat_penalty": 1.1, "num_ctx": 1024, "num_thread": 2,
        "mirostat": 1}}, window=2048)
    assert req.stream is True  # Ollama streams unless told not to
    assert req.max_tokens == 7 and req.stop == ["\n"]
    assert req.sampling == Sampling(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
                                    repetition_penalty=1.1, seed=3)
    # num_ctx within the window is honoured (the window is larger); runner settings say nothing
    assert req.ignored == ["options.mirostat"]
    big = wire.parse_chat({"model": "m", "messages": HI, "stream": False, "format": "json",
                           "options": {"num_ctx": 8192, "num_predict": -1, "seed": -1}},
                          window=2048)
    assert big.ignored == ["format", "options.num_ctx"]
    assert big.max_tokens is None and big.sampling.seed is None and big.stream is False


def test_think_and_messages_in_ollamas_shape():
    assert wire.parse_chat({"model": "m", "messages": HI, "think": False}).thinking is False
    high = wire.parse_chat({"model": "m", "messages": HI, "think": "low"})
    assert high.thinking is True and high.reasoning_budget is not None
    req = wire.parse_chat({"model": "m", "tools": tm.TOOLS, "messages": [
        *tm.QUESTION, {"role": "assistant", "content": "", "thinking": "hmm", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": tm.RESULT, "tool_name": "get_weather"}]})
    assert req.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                            "arguments": {"city": "Paris"}}
    assert req.messages[1]["reasoning_content"] == "hmm"
    assert req.messages[2]["role"] == "tool" and req.messages[2]["name"] == "get_weather"
    assert req.tool_choice == "auto" and len(req.tools) == 2
    gen = wire.parse_generate({"model": "m", "prompt": "hi", "system": "be brief"})
    assert gen.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hi"}]
    raw = wire.parse_generate({"model": "m", "prompt": "1 2 3", "raw": True})
    assert raw.kind == "completion" and raw.prompt == "1 2 3" and raw.messages is None


def test_capabilities_and_reply_shapes():
    qwen = (ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja").read_text()
    assert capabilities(qwen) == ["completion", "tools", "thinking"]
    assert capabilities((ASSET / "chat_template.jinja").read_text()) == ["completion"]
    chat, gen = wire.Reply(True, "m:latest"), wire.Reply(False, "m")
    assert chat.chunk(Reasoning("hmm"))["message"] == {"role": "assistant", "content": "",
                                                       "thinking": "hmm"}
    assert gen.chunk(Reasoning("hmm"))["thinking"] == "hmm"
    call = chat.chunk(Call(ToolCall("f", {"x": 1}, "call_1"), 0))["message"]["tool_calls"]
    assert call == [{"id": "call_1", "function": {"index": 0, "name": "f",
                                                  "arguments": {"x": 1}}}]
    done = Done("eos", 5, 3, 0, first_s=0.5, seconds=2.0)
    last = chat.final(done, wire.Timings(total=3.0, start=1.0, prompt=0.5, decode=1.5))
    assert last["done"] and last["done_reason"] == "stop" and last["eval_count"] == 3
    assert (last["total_duration"], last["load_duration"], last["prompt_eval_duration"],
            last["eval_duration"]) == (3_000_000_000, 1_000_000_000, 500_000_000, 1_500_000_000)
    assert wire.error_body(ApiError(404, "no")) == {"error": "no"}


@pytest.mark.parametrize("body, message", [
    ({"messages": HI}, "model is required"),
    ({"model": "m", "messages": "x"}, "messages must be a list"),
    ({"model": "m", "messages": HI, "stream": "yes"}, "stream must be true or false"),
    ({"model": "m", "messages": HI, "think": "max"}, "think must be true, false"),
    ({"model": "m", "messages": HI, "options": {"temperature": "hot"}},
     "options.temperature: temperature must be"),
    ({"model": "m", "messages": HI, "options": {"num_predict": 0}}, "options.num_predict"),
    ({"model": "m", "messages": HI, "options": []}, "options must be an object"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "images"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
])
def test_bad_chat_bodies_are_400s(body, message):
    with pytest.raises(ApiError) as e:
        wire.parse_chat(body)
    assert e.value.status == 400 and message in e.value.message
    assert "\n" not in e.value.message


# ---- the bundled model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--max-queue", "4",
               "--alias", "helper")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)


def test_list_show_ps_version(client, server):
    names = [m.model for m in client.list().models]
    assert names == [f"{MODEL}:latest", "helper:latest"]
    listed = client.list().models[0]
    assert listed.size > 0 and listed.details.family == "qwen3_5_moe"
    assert listed.details.quantization_level.startswith("pocket-3bit")
    shown = client.show(MODEL)
    # The bundled template renders no tools and knows no reasoning blocks.
    assert shown.capabilities == ["completion"]
    arch = shown.modelinfo["general.architecture"]
    _, _, models = server.request("GET", "/v1/models")
    assert shown.modelinfo[f"{arch}.context_length"] == models["data"][0]["context_length"]
    assert shown.modelinfo["general.parameter_count"] > 1_000_000
    assert re.fullmatch(r"\d+(\.\d+)?[KMB]", shown.details.parameter_size)
    [running] = client.ps().models[:1]
    assert running.model == f"{MODEL}:latest" and running.context_length == 2048
    status, _, body = server.request("GET", "/api/version")
    assert status == 200 and re.fullmatch(r"\d+\.\d+\.\d+", body["version"])


def test_chat_whole_and_streamed(client, server):
    whole = client.chat(model=MODEL, messages=HI, stream=False, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    chunks = list(client.chat(model=MODEL, messages=HI, options=GREEDY, stream=True))
    *parts, last = chunks
    assert "".join(c.message.content for c in parts) == whole.message.content
    assert not any(c.done for c in parts) and last.done and last.message.content == ""
    # The counts are the server's own: the tokens streamed, the prompt's as OpenAI's usage says.
    assert last.eval_count == len(parts) == 12
    _, _, usage = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": HI, "max_tokens": 1})
    assert last.prompt_eval_count == usage["usage"]["prompt_tokens"]
    # Durations are measured, in nanoseconds, and add up.
    assert 0 < last.prompt_eval_duration and 0 < last.eval_duration
    assert last.total_duration >= (last.load_duration + last.prompt_eval_duration
                                   + last.eval_duration) * 0.99
    assert last.total_duration < 60e9


def test_generate_and_raw(client, server):
    whole = client.generate(model=MODEL, prompt="Hello", options=GREEDY)
    # Rendered by the chat template as one user turn: the same reply as the chat above.
    chat = client.chat(model=MODEL, messages=HI, stream=False, options=GREEDY)
    assert whole.response == chat.message.content and whole.eval_count == 12
    streamed = list(client.generate(model=MODEL, prompt="Hello", options=GREEDY, stream=True))
    assert "".join(c.response for c in streamed) == whole.response and streamed[-1].done
    raw = client.generate(model=MODEL, prompt="1 2 3", raw=True, options=GREEDY)
    _, _, ref = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "1 2 3", "max_tokens": 12, "temperature": 0})
    assert raw.response == ref["choices"][0]["text"]
    system = client.generate(model=MODEL, prompt="Hello", system="You are terse.",
                             options=GREEDY)
    assert system.prompt_eval_count > whole.prompt_eval_count
    # No prompt: Ollama's "load the model" request, answered at once.
    loaded = client.generate(model=MODEL)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_names_and_unknown_models(client):
    for name in (f"{MODEL}:latest", "helper", "helper:latest", "Pocket-Tiny"):
        r = client.chat(model=name, messages=HI, options={"num_predict": 2})
        assert r.model == name and r.eval_count == 2
    for name in ("nope", f"{MODEL}:7b"):
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=name, messages=HI)
        assert e.value.status_code == 404 and "not found" in e.value.error
        with pytest.raises(ollama.ResponseError) as e:
            client.show(name)
        assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 501 and f"'{MODEL}'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(MODEL)
    assert e.value.status_code == 501


def test_options_are_honoured(client):
    capped = client.chat(model=MODEL, messages=HI, stream=False,
                         options={"num_predict": 5, "temperature": 0})
    assert capped.eval_count == 5 and capped.done_reason == "length"
    warm = {"temperature": 1.0, "num_predict": 16}
    a, b, c = (client.generate(model=MODEL, prompt="Once", options={**warm, "seed": s})
               for s in (7, 7, 8))
    assert a.response == b.response and a.response != c.response
    full = client.generate(model=MODEL, prompt="Hello", options={**GREEDY, "num_predict": 30})
    stop = full.response[len(full.response) // 2:][:3]
    cut = client.generate(model=MODEL, prompt="Hello",
                          options={**GREEDY, "num_predict": 30, "stop": [stop]})
    assert cut.done_reason == "stop" and stop not in cut.response
    assert full.response.startswith(cut.response) and len(cut.response) < len(full.response)
    # think false on a model without a thinking switch: answered as usual.
    plain = client.chat(model=MODEL, messages=HI, think=False, options=GREEDY)
    assert plain.message.content and not plain.message.thinking


def test_ignored_fields_are_named(server):
    status, headers, body = server.request("POST", "/api/chat", {
        "model": MODEL, "messages": HI, "stream": False, "format": "json", "keep_alive": "5m",
        "options": {"num_predict": 2, "mirostat": 2, "num_gpu": 99}})
    assert status == 200 and body["done"]
    assert headers["x-pocket-fields-ignored"] == "format,options.mirostat"


def test_embeddings(client, server):
    got = client.embed(model=MODEL, input=["the cat sat", "the cat sat", "stock prices fell"])
    a, b, c = got.embeddings
    assert len(a) == client.show(MODEL).modelinfo["qwen3_5_moe.embedding_length"]
    assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-4 for v in (a, b, c))
    assert a == b and a != c
    assert got.prompt_eval_count > 6 and got.total_duration > 0
    one = client.embed(model=MODEL, input="the cat sat", dimensions=32).embeddings[0]
    assert len(one) == 32 and abs(math.fsum(x * x for x in one) - 1) < 1e-4
    legacy = client.embeddings(model=MODEL, prompt="the cat sat").embedding
    assert max(abs(x - y) for x, y in zip(legacy, a)) < 1e-6
    # OpenAI's endpoint, with the SDK's default base64 encoding.
    oai = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    r = oai.embeddings.create(model=MODEL, input=["the cat sat", "stock prices fell"])
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 6
    assert max(abs(x - y) for x, y in zip(r.data[0].embedding, a)) < 1e-6
    status, _, body = server.request("POST", "/api/embed", {"model": MODEL, "input": ""})
    assert status == 400 and "empty" in body["error"]


@pytest.mark.parametrize("path, body, status, message", [
    ("/api/chat", b'{"model": ', 400, "not valid JSON"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content must be a string"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"top_k": 1.5}}, 400,
     "options.top_k"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "images": ["aGk="]}, 400, "images"),
    ("/api/generate", {"model": MODEL, "prompt": ["hi"]}, 400, "prompt must be a string"),
    ("/api/generate", {"model": 7, "prompt": "hi"}, 400, "model is required"),
    ("/api/show", {"model": "nope"}, 404, "not found"),
    ("/api/embed", {"model": MODEL, "input": [1, 2]}, 400, "input must be"),
])
def test_bad_input_gets_ollamas_error_shape(server, path, body, status, message):
    got, headers, reply = server.request("POST", path, body)
    assert got == status and set(reply) == {"error"}
    assert message in reply["error"] and "\n" not in reply["error"]
    assert server.health()["status"] == "ok"


def test_liveness_probe_and_the_chat_page(server):
    status, headers, body = server.request("HEAD", "/")
    assert status == 200
    status, headers, body = server.request("GET", "/", headers={"Accept": "*/*"})
    assert status == 200 and body["text"] == "Ollama is running"
    status, headers, body = server.request("GET", "/", headers={
        "Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "<html" in body["text"].lower()


def test_stream_is_ndjson(server):
    status, headers, body = server.request("POST", "/api/generate", {
        "model": MODEL, "prompt": "Hello", "options": GREEDY})
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in body["text"].splitlines()]
    assert [x["done"] for x in lines] == [False] * 12 + [True]
    assert lines[-1]["eval_count"] == 12


# ---- the tool-trained model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tool-model"
    shutil.copytree(ROOT / "tests" / "fixtures" / "tool-model", folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSET / f, folder / f)
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu", "--prompt-cache-mb", "0")
    yield ollama.Client(host=f"http://127.0.0.1:{s.port}", timeout=60)
    s.stop()
    assert "Traceback" not in s.log.read_text()


def test_tool_call_round_trip(tool_client):
    assert "tools" in tool_client.show("tool-model").capabilities
    opts = {"temperature": 0, "num_predict": 60}
    r = tool_client.chat(model="tool-model", messages=tm.QUESTION, tools=tm.TOOLS,
                         options=opts)
    [call] = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert r.message.content == "" and r.done_reason == "stop"
    streamed = list(tool_client.chat(model="tool-model", messages=tm.QUESTION, tools=tm.TOOLS,
                                     options=opts, stream=True))
    calls = [c for ch in streamed for c in ch.message.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert "".join(ch.message.content for ch in streamed) == ""
    # The call as the client holds it, then the tool's result: the model answers.
    answer = tool_client.chat(model="tool-model", tools=tm.TOOLS, options=opts, messages=[
        *tm.QUESTION, r.message, {"role": "tool", "content": tm.RESULT,
                                  "tool_name": "get_weather"}])
    assert answer.message.content == tm.ANSWER and not answer.message.tool_calls


# ---- a thinking template ---------------------------------------------------------------------

QWEN = "qwen-tiny"
LONG = "Tell me about the sea and the ships that sail on it, and the sailors who " * 8


@pytest.fixture(scope="module")
def qwen_client(tmp_path_factory):
    """The bundled model under Qwen3.5's real template (its reply starts inside `<think>` and
    never closes the block itself: serve's --reasoning-budget closes it), as
    test_server_reasoning.py serves it."""
    folder = tmp_path_factory.mktemp("models") / QWEN
    shutil.copytree(ASSET, folder)
    shutil.copyfile(ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja",
                    folder / "chat_template.jinja")
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu", "--reasoning-budget", "16")
    yield ollama.Client(host=f"http://127.0.0.1:{s.port}", timeout=60)
    s.stop()
    assert "Traceback" not in s.log.read_text()


def test_thinking_apart_from_the_answer(qwen_client):
    c = qwen_client
    assert c.show(QWEN).capabilities == ["completion", "tools", "thinking"]
    ask = {"model": QWEN, "messages": [{"role": "user", "content": LONG}],
           "options": {"temperature": 0, "num_predict": 40}}
    r = c.chat(**ask)
    assert r.message.thinking and r.message.content
    assert not any(t in r.message.thinking + r.message.content for t in ("<think>", "</think>"))
    assert c.chat(**ask, think=True).message == r.message  # the template's default: on
    chunks = list(c.chat(**ask, stream=True))
    kinds = ["thinking" if ch.message.thinking else "content" for ch in chunks
             if ch.message.thinking or ch.message.content]
    assert kinds == sorted(kinds, key=lambda k: k != "thinking")  # all reasoning first
    assert "".join(ch.message.thinking or "" for ch in chunks) == r.message.thinking
    assert "".join(ch.message.content for ch in chunks) == r.message.content
    assert chunks[-1].eval_count == r.eval_count == 40
    off = c.chat(**ask, think=False)
    assert not off.message.thinking and off.message.content
    assert c.chat(**ask, think="low").message.thinking
    gen = c.generate(model=QWEN, prompt=LONG, options=ask["options"])
    assert gen.thinking == r.message.thinking and gen.response == r.message.content
