"""Fields that clients send by default (Open WebUI, agents, Ollama-style clients) against
`pocket-mlx serve` on `synthetic:tiny`: an optional feature the server or model lacks is left
out and said (the X-Pocket-Fields-Ignored header and a log line), never refused; malformed
values stay 400s (tests/test_server.py's BAD lists)."""

from __future__ import annotations

import json

import openai
import pytest
from test_server import Server, sse_events

SYNTH = "synthetic:tiny"
CHAT = "/v1/chat/completions"
HEADER = "x-pocket-fields-ignored"
MSGS = [{"role": "user", "content": "Hello"}]
# The shape of Open WebUI's default chat request: system prompt, its built-in tools, stream
# with usage, the sampling settings its UI exposes, no tool_choice. (max_tokens added: without
# it a reply runs to the end of text or the 4096-token window, too slow for a unit test.)
TOOL = {"type": "function", "function": {
    "name": "get_current_timestamp", "description": "Get the current Unix timestamp.",
    "parameters": {"type": "object", "properties": {}}}}
OPEN_WEBUI = {
    "messages": [{"role": "system", "content": "You are a helpful assistant."}, *MSGS],
    "stream": True, "stream_options": {"include_usage": True}, "tools": [TOOL],
    "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1, "frequency_penalty": 0.1,
    "presence_penalty": 0.2, "logit_bias": {"42": -100}, "reasoning_effort": "medium",
    "user": "u-1", "metadata": {"chat_id": "c"}, "keep_alive": "5m",
    "options": {"num_ctx": 8192}, "max_tokens": 6}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", SYNTH)
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


def test_open_webui_default_request_gets_a_reply_and_the_header(server):
    headers, events = sse_events(server, CHAT, OPEN_WEBUI)
    # reasoning_effort is honoured (the reasoning switch: test_server_reasoning.py)
    assert headers[HEADER] == ("frequency_penalty,keep_alive,logit_bias,options,"
                               "presence_penalty")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert "error" not in chunks[-1]
    log = server.log.read_text()
    assert (f"POST {CHAT} (stream): fields this server does not honour were ignored: "
            "frequency_penalty,keep_alive") in log
    assert f"200 POST {CHAT} (stream)" in log


IGNORED = [
    # (extra fields, the header)
    ({"logprobs": True, "top_logprobs": 3}, "logprobs,top_logprobs"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ({"frequency_penalty": 0.5, "presence_penalty": -0.5}, "frequency_penalty,presence_penalty"),
    ({"reasoning_effort": "low", "verbosity": "low"}, "verbosity"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"keep_alive": -1, "num_ctx": 4096, "options": {"temperature": 0}},
     "keep_alive,num_ctx,options"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"temprature": 0}, "temprature"),  # a typo: said, so the client can find it
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools.function.strict"),
    ({"\udcff": 1}, "\\udcff"),  # a header carries ASCII: escaped
]


@pytest.mark.parametrize("extra,header", IGNORED, ids=[h for _, h in IGNORED])
def test_unhonoured_fields_are_ignored_and_said(server, extra, header):
    status, headers, r = server.request("POST", CHAT, {"messages": MSGS, "max_tokens": 2,
                                                       **extra})
    assert status == 200, r
    assert headers[HEADER] == header
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert f"were ignored: {header}" in server.log.read_text()


HONOURED = [
    {"seed": 3, "temperature": 0.7},
    {"n": 1, "user": "u", "metadata": {"k": "v"}, "store": False},
    {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}},
    {"response_format": {"type": "text"}},
    {"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False},
    {"repeat_penalty": 1.1},
    {"stream": True, "stream_options": {"include_usage": True}},
]


@pytest.mark.parametrize("extra", HONOURED, ids=[",".join(e) for e in HONOURED])
def test_honoured_fields_give_no_header(server, extra):
    body = {"messages": MSGS, "max_tokens": 2, **extra}
    if extra.get("stream"):
        headers, events = sse_events(server, CHAT, body)
        assert events[-1] == "[DONE]"
    else:
        status, headers, r = server.request("POST", CHAT, body)
        assert status == 200, r
    assert HEADER not in headers


def test_repeat_penalty_is_repetition_penalty(server):
    """llama.cpp's and Ollama's name for the same setting: the same greedy reply."""
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    model = server.health()["model"]
    replies = [client.chat.completions.create(model=model, messages=MSGS, max_tokens=24,
                                              temperature=0, extra_body=extra)
               .choices[0].message.content
               for extra in ({"repeat_penalty": 0.05}, {"repetition_penalty": 0.05}, {})]
    assert replies[0] == replies[1]
    # It takes effect: a penalty below 1 favours the tokens already seen (the prompt's).
    assert replies[0] != replies[2]


def test_completions_ignore_logprobs_and_unknown_fields(server):
    status, headers, r = server.request("POST", "/v1/completions", {
        "prompt": "Once", "max_tokens": 2, "logprobs": 2, "keep_alive": "1m"})
    assert status == 200, r
    assert headers[HEADER] == "keep_alive,logprobs"


def test_messages_default_fields_get_a_reply_and_the_header(server):
    """An Anthropic client's defaults: metadata, extended thinking, top_k, stop_sequences,
    tool_choice auto; thinking is the model's reasoning switch (this model has none: its
    template renders the same prompt), context edits none; only speed is said."""
    status, headers, r = server.request("POST", "/v1/messages", {
        "max_tokens": 4, "messages": MSGS, "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "top_k": 5,
        "stop_sequences": ["\n\nHuman:"], "tool_choice": {"type": "auto"},
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "speed": "fast", "context_management": {"edits": []}})
    assert status == 200, r
    assert r["type"] == "message" and r["usage"]["output_tokens"] >= 1
    assert headers[HEADER] == "speed"
    status, headers, r = server.request("POST", "/v1/messages", {
        "max_tokens": 2, "messages": MSGS, "thinking": {"type": "disabled"}})
    assert status == 200 and HEADER not in headers, r
