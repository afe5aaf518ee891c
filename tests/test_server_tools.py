"""Tool calls through `pocket-mlx serve`, end to end: a real server process serving a real model
that has learnt to call tools (tests/fixtures/tool-model, trained by scripts/make_tool_model.py
on prompts rendered by the server's own code), driven by the official `openai` and `anthropic`
clients with greedy sampling: the call comes back parsed (mlx-lm's qwen3_coder parser), the
tool's result goes back through the chat template, and the model answers. Raw HTTP for the
refusals. The splitter's hold-back and failure paths are checked on text, with the real parser.
"""

from __future__ import annotations

import json
import shutil
import sys

import anthropic
import openai
import pytest
from conftest import ASSET, ROOT
from test_server import Server

sys.path.insert(0, str(ROOT / "scripts"))
import make_tool_model as tm  # noqa: E402

from pocket_mlx.server.tools import CallSplitter, ToolCall, ToolFormat, detect_format  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "tool-model"
MODEL = "tool-model"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(FIXTURE, folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSET / f, folder / f)
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu", "--max-queue", "4", "--prompt-cache-mb", "0")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused",
                               max_retries=0, timeout=60)


def ask(client, **kw):
    return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=60, **kw)


# ---- OpenAI ------------------------------------------------------------------------------------

def test_openai_round_trip(client):
    r = ask(client, messages=tm.QUESTION, tools=tm.TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The assistant message as the client got it, then the tool's result: the model answers.
    messages = [*tm.QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": tm.RESULT}]
    r2 = ask(client, messages=messages, tools=tm.TOOLS)
    assert r2.choices[0].message.content == tm.ANSWER
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    # The SDK's own echo (model_dump() with its null fields) is accepted too.
    r3 = ask(client, messages=[*tm.QUESTION, choice.message.model_dump(),
                               {"role": "tool", "tool_call_id": call.id, "content": tm.RESULT}],
             tools=tm.TOOLS)
    assert r3.choices[0].message.content == tm.ANSWER


def test_openai_streamed_tool_call(client):
    chunks = list(ask(client, messages=tm.QUESTION, tools=tm.TOOLS, stream=True,
                      stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # No piece of the call's markup leaks into the text.
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 10
    # The answer after the tool's result streams as text.
    text = "".join(c.choices[0].delta.content or "" for c in ask(
        client, messages=tm.after_call(), tools=tm.TOOLS, stream=True) if c.choices)
    assert text == tm.ANSWER


def test_openai_tool_choice(client):
    required = ask(client, messages=tm.QUESTION, tools=tm.TOOLS, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"
    named = ask(client, messages=tm.QUESTION, tools=tm.TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {
        "city": "Paris"}
    # Streamed, the forced start is part of the call, not text.
    chunks = list(ask(client, messages=tm.QUESTION, tools=tm.TOOLS, stream=True,
                      tool_choice={"type": "function", "function": {"name": "get_time"}}))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_time"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # none: the tools are not shown, the reply is text.
    none = ask(client, messages=tm.QUESTION, tools=tm.TOOLS, tool_choice="none")
    assert none.choices[0].message.content == tm.NO_TOOLS
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"
    plain = ask(client, messages=tm.QUESTION)
    assert plain.choices[0].message.content == tm.NO_TOOLS


# ---- Anthropic ---------------------------------------------------------------------------------

def anthropic_tools() -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tm.TOOLS]


def test_anthropic_round_trip(claude, client):
    r = claude.messages.create(model=MODEL, max_tokens=60, messages=tm.QUESTION,
                               tools=anthropic_tools(), extra_body={"temperature": 0})
    # Anthropic's tools render the very prompt OpenAI's do (no prompt cache on this server:
    # input_tokens is the whole prompt).
    assert r.usage.input_tokens == ask(client, messages=tm.QUESTION,
                                       tools=tm.TOOLS).usage.prompt_tokens
    assert r.stop_reason == "tool_use"
    [block] = r.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and block.input == {"city": "Paris"}
    messages = [*tm.QUESTION,
                {"role": "assistant", "content": [b.model_dump() for b in r.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                              "content": tm.RESULT}]}]
    r2 = claude.messages.create(model=MODEL, max_tokens=60, messages=messages,
                                tools=anthropic_tools(), extra_body={"temperature": 0})
    assert r2.usage.input_tokens == ask(client, messages=tm.after_call(),
                                        tools=tm.TOOLS).usage.prompt_tokens
    assert r2.stop_reason == "end_turn"
    assert [b.type for b in r2.content] == ["text"] and r2.content[0].text == tm.ANSWER
    # tool_result content as text blocks: the same prompt, the same answer.
    messages[-1]["content"][0]["content"] = [{"type": "text", "text": tm.RESULT}]
    r3 = claude.messages.create(model=MODEL, max_tokens=60, messages=messages,
                                tools=anthropic_tools(), extra_body={"temperature": 0})
    assert r3.content[0].text == tm.ANSWER and r3.usage.input_tokens == r2.usage.input_tokens


def test_anthropic_streamed_tool_use(claude):
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=tm.QUESTION,
                                tools=anthropic_tools(), extra_body={"temperature": 0}) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].name == "get_weather" and final.content[0].input == {"city": "Paris"}
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["tool_use"]
    json_deltas = [e for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
    assert json.loads("".join(e.delta.partial_json for e in json_deltas)) == {"city": "Paris"}
    assert not any(e.type == "content_block_delta" and e.delta.type == "text_delta"
                   for e in events)


def test_anthropic_tool_choice(claude):
    def ask_claude(choice: dict):
        return claude.messages.create(model=MODEL, max_tokens=60, messages=tm.QUESTION,
                                      tools=anthropic_tools(), tool_choice=choice,
                                      extra_body={"temperature": 0})

    assert ask_claude({"type": "any"}).content[0].name == "get_weather"
    r = ask_claude({"type": "tool", "name": "get_time"})
    assert r.content[0].type == "tool_use" and r.content[0].name == "get_time"
    assert r.stop_reason == "tool_use"
    r = ask_claude({"type": "none"})
    assert r.content[0].type == "text" and r.content[0].text == tm.NO_TOOLS


# ---- refusals ----------------------------------------------------------------------------------

Q = tm.QUESTION
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_OPENAI = [
    # (body, param, code)
    ({"messages": Q, "tools": "f"}, "tools", "invalid_type"),
    ({"messages": Q, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0]",
     "unsupported_parameter"),
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function", "invalid_value"),
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
     "tools[0].function.strict", "invalid_type"),
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
     "tools[0].function.x", "unknown_parameter"),
    ({"messages": Q, "tools": [FN, FN]}, "tools", "invalid_value"),
    ({"messages": Q, "tools": [FN], "tool_choice": "always"}, "tool_choice", "invalid_value"),
    ({"messages": Q, "tools": [FN],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "invalid_value"),
    ({"messages": Q, "tools": [FN], "parallel_tool_calls": "no"}, "parallel_tool_calls",
     "invalid_type"),
    ({"messages": Q, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"messages": [*Q, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    ({"messages": [*Q, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    ({"messages": [*Q, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id",
     "missing_required"),
    ({"messages": [*Q, {"role": "function", "name": "f", "content": "x"}]}, "messages[1].role",
     "unsupported_parameter"),
    ({"messages": [*Q, {"role": "assistant", "content": "x", "refusal": "no"}]},
     "messages[1].refusal", "unknown_parameter"),
]


@pytest.mark.parametrize("body,param,code", BAD_OPENAI,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_OPENAI)])
def test_openai_tool_refusals(server, body, param, code):
    status, _, err = server.request("POST", CHAT, body)
    assert status == 400, err
    e = err["error"]
    assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", param, code)
    assert "\n" not in e["message"]
    assert f"400 POST {CHAT}: {e['message']}" in server.log.read_text()


BAD_ANTHROPIC = [
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tools": [{"name": "f"}]},  # no input_schema
    {"tools": [{"name": "f", "input_schema": {}, "bogus": 1}]},
    {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}},
    {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool",
                                                                  "name": "g"}},
    {"tool_choice": {"type": "any"}},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f",
                                                "input": {}}]}]},
    {"messages": [*Q, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": "city"}]},
        {"role": "user", "content": "go on"}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
]


@pytest.mark.parametrize("extra", BAD_ANTHROPIC, ids=[str(i) for i in range(len(BAD_ANTHROPIC))])
def test_anthropic_tool_refusals(server, extra):
    status, _, err = server.request("POST", "/v1/messages",
                                    {"max_tokens": 5, "messages": Q, **extra})
    assert status == 400, err
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert server.health()["status"] == "ok"


def test_tools_on_a_model_without_a_tool_format(tmp_path):
    """The bundled model's template renders no tools. Tools it may ignore (tool_choice absent
    or auto, as Open WebUI sends its built-in ones) are left out and said (header and log);
    tools it must call (required, a named function) and tool-call history are refused."""
    s = Server(tmp_path / "serve.log", "--max-queue", "0")
    anth_tool = {"name": "f", "input_schema": {"type": "object"}}
    try:
        for path, body in ((CHAT, {"messages": Q, "tools": [FN]}),  # no max_tokens, as sent
                           (CHAT, {"messages": Q, "tools": [FN], "tool_choice": "auto",
                                   "max_tokens": 4}),
                           ("/v1/messages", {"max_tokens": 4, "messages": Q,
                                             "tools": [anth_tool]})):
            status, headers, r = s.request("POST", path, body)
            assert status == 200, r
            assert headers["x-pocket-tools-omitted"] == "1", headers
        # streamed: the header comes with the stream
        status, headers, r = s.request("POST", CHAT, {"messages": Q, "tools": [FN, {
            "type": "function", "function": {"name": "g"}}], "stream": True, "max_tokens": 3})
        assert status == 200 and headers["x-pocket-tools-omitted"] == "2", headers
        assert "data: [DONE]" in r["text"]
        log = s.log.read_text()
        assert log.count("renders no tools; answered without the") == 4, log
        assert "(f, g)" in log
        for path, body in (
                (CHAT, {"messages": Q, "tools": [FN], "tool_choice": "required"}),
                (CHAT, {"messages": Q, "tools": [FN], "tool_choice": {
                    "type": "function", "function": {"name": "f"}}}),
                (CHAT, {"messages": tm.after_call()}),
                ("/v1/messages", {"max_tokens": 5, "messages": Q, "tools": [anth_tool],
                                  "tool_choice": {"type": "any"}})):
            status, headers, err = s.request("POST", path, body)
            assert status == 400 and "cannot use tools" in json.dumps(err), err
            assert "x-pocket-tools-omitted" not in headers
        # tool_choice none: the tools are not shown to the model, so nothing is lost or said.
        status, headers, r = s.request("POST", CHAT, {"messages": Q, "tools": [FN],
                                                      "tool_choice": "none", "max_tokens": 2})
        assert status == 200 and r["choices"][0]["finish_reason"] in ("stop", "length")
        assert "x-pocket-tools-omitted" not in headers
    finally:
        s.stop()
    assert "Traceback" not in s.log.read_text()


# ---- the splitter, on text, with mlx-lm's real parser ------------------------------------------

def weather(city: str) -> str:
    return (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            "</function>\n</tool_call>")


def split(text: str, step: int, **kw) -> tuple[list, CallSplitter]:
    s = CallSplitter(ToolFormat("qwen3_coder"), tm.TOOLS, "call_", **kw)
    out = []
    for i in range(0, len(text), step):
        out += s.feed(text[i:i + step])
    return out + s.close(), s


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_splitter_text_and_calls_in_any_pieces(step):
    text = f"Let me look.\n\n{weather('Paris')}\n{weather('Rome')}"
    out, s = split(text, step)
    assert "".join(p for p in out if isinstance(p, str)) == "Let me look."
    # No piece of text ever holds part of a marker.
    assert not any("<" in p for p in out if isinstance(p, str))
    calls = [p for p in out if isinstance(p, ToolCall)]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                      ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2
    # Text that only looks like the start of a marker comes out whole.
    out, s = split("a <tool box> and <tool_", step)
    assert "".join(out) == "a <tool box> and <tool_" and not s.calls


def test_splitter_limit_and_unreadable_call():
    out, s = split(weather("Paris") + weather("Rome"), 3, limit=1)
    assert [c.arguments for c in s.calls] == [{"city": "Paris"}] and s.dropped == 1
    bad = "<tool_call>\nno function here\n</tool_call>"
    out, s = split(f"Hi {bad}", 4)
    assert "".join(out) == f"Hi{bad}" and not s.calls and len(s.failed) == 1
    # A call cut off before its end marker (max_tokens) is still read when it parses.
    out, s = split(weather("Paris")[:-len("</tool_call>")], 7)
    assert [c.name for c in s.calls] == ["get_weather"]


def test_format_detection_follows_mlx_lm():
    assert detect_format(tm.TEMPLATE.read_text()) == "qwen3_coder"
    assert detect_format((ASSET / "chat_template.jinja").read_text()) is None
    assert detect_format("{{ '<tool_call>' }}{{ tool_call.name }}") == "json_tools"
    fmt = ToolFormat("json_tools")
    s = CallSplitter(fmt, None, "call_")
    out = s.feed('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>') + s.close()
    assert [(c.name, c.arguments) for c in out] == [("f", {"x": 1})]


def test_tojson_renders_as_transformers_does():
    """Tool definitions reach the model as transformers renders them: keys in the caller's
    order, nothing escaped for HTML (jinja's own tojson sorts keys and writes < as \\u003c)."""
    from pocket_mlx.engine.templates import render_template

    tool = {"name": "f", "description": "a <b> & 'c' é", "parameters": {"z": 1, "a": 2}}
    assert render_template("{{ t | tojson }}", t=tool) == json.dumps(tool, ensure_ascii=False)
    assert render_template("{{ t | tojson(indent=2) }}", t=tool) == json.dumps(
        tool, ensure_ascii=False, indent=2)
