"""OpenAI's Responses API (`POST /v1/responses`) on `pocket-mlx serve`: the parser on the body
Codex CLI 0.171.0 really sends (captured from a server, trimmed: tests/fixtures/agents/), the
renderer's event sequence, and a real server driven by the official `openai` client, whole and
streamed: the tool-trained fixture model (tests/fixtures/tool-model) makes a function call,
takes its output back and says the trained sentence; a freeform tool's call comes back as a
`custom_tool_call`; Qwen3.5's template on the bundled model gives reasoning items; bad input
is a 400 in one line and the server stays up.
"""

from __future__ import annotations

import http.client
import json
import shutil
import sys

import openai
import pytest
import test_server
from conftest import ASSET, ROOT
from test_server import Server
from test_server_reasoning import qwen_model

sys.path.insert(0, str(ROOT / "scripts"))
import make_tool_model as tm  # noqa: E402

from pocket_mlx.server.jobs import Call, Done, Reasoning, Text  # noqa: E402
from pocket_mlx.server.requests import ApiError  # noqa: E402
from pocket_mlx.server.responses import Response, parse_responses  # noqa: E402
from pocket_mlx.server.tools import ToolCall  # noqa: E402

CODEX = ROOT / "tests" / "fixtures" / "agents" / "codex-0.171.0-responses.json"
FIXTURE = ROOT / "tests" / "fixtures" / "tool-model"
MODEL = "tool-model"
# The fixture's tools in the Responses shape (flat: no "function" wrapper).
TOOLS = [{"type": "function", **t["function"]} for t in tm.TOOLS]
QUESTION = "What is the weather in Paris?"
PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
              "format": {"type": "grammar", "syntax": "lark",
                         "definition": 'start: "*** Begin Patch" LF'}}


# ---- the parser and the renderer, without a server -------------------------------------------

def codex_body() -> dict:
    return json.loads(CODEX.read_text())


def test_codex_request_parses():
    parsed = parse_responses(codex_body())
    req = parsed.req
    roles = [m["role"] for m in req.messages]
    # Two developer messages make one system turn; then the environment, the prompt, the
    # assistant's call and its output.
    assert roles == ["system", "user", "user", "assistant", "tool"]
    assert req.messages[0]["content"].startswith("You are a coding agent running in the Codex")
    assert "<skills_instructions>" in req.messages[0]["content"]
    call = req.messages[3]["tool_calls"][0]
    assert call["function"] == {"name": "exec_command", "arguments": {"cmd": "echo hi > made.txt"}}
    assert req.messages[4]["tool_call_id"] == call["id"] == "call_1"
    names = [t["function"]["name"] for t in req.tools]
    assert "exec_command" in names and "multi_agent_v1.close_agent" in names
    assert parsed.names["multi_agent_v1.close_agent"].namespace == "multi_agent_v1"
    assert req.tool_choice == "auto" and req.parallel_tool_calls and req.stream
    assert req.thinking is None  # {"summary": "auto"} alone leaves the server's default
    # Hosted web_search is left out and said; so are summaries and encrypted reasoning.
    assert req.ignored == ["include.reasoning.encrypted_content", "reasoning.summary",
                           "tools.web_search"]


def test_history_items_fold_into_chat_messages():
    body = {"instructions": "Be brief.", "reasoning": {"effort": "none"}, "tools": [
        *TOOLS, PATCH_TOOL,
        {"type": "namespace", "name": "ns", "description": "d", "tools": [TOOLS[0]]},
        {"type": "function", "name": "later", "defer_loading": True, "parameters": {}}],
        "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Think."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "namespace": "ns",
         "arguments": '{"city": "Paris"}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "P"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "22 C"}]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done"},
        {"role": "developer", "content": "Later note."}]}
    parsed = parse_responses(body)
    m = parsed.req.messages
    assert m[0] == {"role": "system", "content": "Be brief.\n\nUse tools."}
    assert m[1] == {"role": "user", "content": "Hi"}
    assert m[2]["content"] == "Checking." and m[2]["reasoning_content"] == "Think."
    assert [c["function"] for c in m[2]["tool_calls"]] == [
        {"name": "ns.get_weather", "arguments": {"city": "Paris"}},
        {"name": "apply_patch", "arguments": {"input": "P"}}]
    assert m[3:5] == [{"role": "tool", "tool_call_id": "c1", "content": "22 C"},
                      {"role": "tool", "tool_call_id": "c2", "content": "Done"}]
    assert m[5] == {"role": "system", "content": "Later note."}
    assert parsed.req.thinking is False
    names = [t["function"]["name"] for t in parsed.req.tools]
    assert names == ["get_weather", "get_time", "apply_patch", "ns.get_weather"]  # no "later"
    patch = parsed.req.tools[2]["function"]["parameters"]["properties"]["input"]
    assert 'start: "*** Begin Patch" LF' in patch["description"]
    assert parsed.names["apply_patch"].kind == "custom"


@pytest.mark.parametrize("body, message", [
    ({"previous_response_id": "resp_1", "input": "hi"},
     "previous_response_id is not supported by this server: this server keeps no responses; "
     "resend the whole conversation in input (with store false)"),
    ({"conversation": "conv_1", "input": "hi"},
     "conversation is not supported by this server: this server keeps no conversations; "
     "resend the whole conversation in input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]},
     "input[0] is not supported by this server: input items of type 'web_search_call' (this "
     "server reads message, function_call, function_call_output, custom_tool_call, "
     "custom_tool_call_output and reasoning)"),
    ({"input": "hi", "tools": [{"type": "function", "description": "no name"}]},
     "tools[0]: a function tool needs a name"),
    ({"input": "hi", "tools": [{"name": "f"}]}, "tools[0]: must be an object with a type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]},
     "tools[0]: the name must be 1-128 letters, digits, _, -, . or :, got 'bad name'"),
    ({"input": []}, "input: must be a string or a non-empty list of items"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments: is not valid JSON"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}},
     "reasoning.effort must be one of none, minimal, low, medium, high, xhigh, got 'extreme'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0] is not supported by this server: content of type 'input_image' "
     "(this model reads text only)"),
])
def test_bad_input_is_one_line_naming_the_field(body, message):
    with pytest.raises(ApiError) as e:
        parse_responses(body)
    assert e.value.status == 400
    assert e.value.message == message and "\n" not in message


def test_the_renderer_announces_every_step_in_order():
    parsed = parse_responses({"input": "hi", "tools": [*TOOLS, PATCH_TOOL]})
    r = Response(parsed, "m")
    evs = r.start()
    evs += r.feed(Reasoning("Hm. ")) + r.feed(Reasoning("Yes."))
    evs += r.feed(Text("Sure")) + r.feed(Text("!"))
    evs += r.feed(Call(ToolCall("get_weather", {"city": "Paris"}, "call_a1"), 0))
    evs += r.feed(Call(ToolCall("apply_patch", {"input": "*** Begin Patch"}, "call_b2"), 1))
    evs += r.end(Done("eos", 10, 8, 4, reasoning_tokens=3))
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"].removeprefix("response.") for e in evs] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done",
        "output_item.added", "custom_tool_call_input.delta", "custom_tool_call_input.done",
        "output_item.done", "completed"]
    out = evs[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call",
                                        "custom_tool_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "Hm. Yes."}]
    assert out[1]["content"][0]["text"] == "Sure!"
    assert out[2]["call_id"] == "call_a1" and out[2]["arguments"] == '{"city": "Paris"}'
    assert out[3]["input"] == "*** Begin Patch" and out[3]["name"] == "apply_patch"
    assert [o["output_index"] for o in evs if o["type"].endswith("item.done")] == [0, 1, 2, 3]
    cut = Response(parsed, "m")
    end = cut.end(Done("length", 10, 8, 0))[-1]
    assert end["type"] == "response.incomplete"
    assert end["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# ---- a real server and the openai client --------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A beat after 50 ms of silence: the prefills here are long enough to show some, and the
    # SDK must parse streams that carry them.
    mp = pytest.MonkeyPatch()
    mp.setitem(test_server.ENV, "POCKET_MLX_KEEPALIVE_S", "0.05")
    folder = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(FIXTURE, folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSET / f, folder / f)
    # A window that takes Codex's prompt (the fixture's position encoding does not depend on
    # it): the captured body is ~4.5k tokens here.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "max_position_embeddings": 8192}))
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu", "--max-queue", "4")
    mp.undo()
    yield s
    s.stop()
    log = s.log.read_text()
    assert "Traceback" not in log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def ask(client, **kw):
    return client.responses.create(model=MODEL, temperature=0, max_output_tokens=60, **kw)


def test_function_call_round_trip(client):
    r = ask(client, input=QUESTION, tools=TOOLS)
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert r.usage.input_tokens > 100 and r.usage.output_tokens > 10
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # The call as the client got it, then its output: the model says the trained sentence.
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": tm.RESULT}]
    r2 = ask(client, input=history, tools=TOOLS)
    assert r2.output_text == tm.ANSWER and r2.output[0].type == "message"
    assert r2.usage.input_tokens_details.cached_tokens > 0  # the first prompt's snapshot
    # Without tools the model has learnt another sentence.
    assert ask(client, input=QUESTION).output_text == tm.NO_TOOLS


def test_streamed_call_and_answer(client):
    events = list(ask(client, input=QUESTION, tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    [call] = events[-1].response.output
    assert call.name == "get_weather"
    assert events[-1].response.usage.output_tokens > 10
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": tm.RESULT}]
    # The SDK's stream helper checks the event sequence as it accumulates it.
    with client.responses.stream(model=MODEL, input=history, tools=TOOLS, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == tm.ANSWER == final.output_text
    assert final.status == "completed"


def test_freeform_tool_call_comes_back_as_custom_tool_call(client):
    # get_time as a freeform tool; the named choice forces its call, as the fixture learnt.
    tools = [TOOLS[0], {"type": "custom", "name": "get_time", "description": "The time."}]
    r = ask(client, input=QUESTION, tools=tools,
            tool_choice={"type": "custom", "name": "get_time"})
    [call] = r.output
    assert call.type == "custom_tool_call" and call.name == "get_time"
    assert call.input == "Paris" and call.call_id.startswith("call_")
    events = list(ask(client, input=QUESTION, tools=tools, stream=True,
                      tool_choice={"type": "custom", "name": "get_time"}))
    assert "response.custom_tool_call_input.done" in [e.type for e in events]
    assert events[-1].response.output[0].input == "Paris"


def test_codex_request_is_answered(server):
    """The captured Codex body (its model name swapped): a 200 stream, every hosted tool and
    unhonoured field named in the header; while the prompt prefills, response.in_progress
    events keep the client's idle timer going (SSE comments would not: Codex counts events)."""
    body = {**codex_body(), "model": MODEL, "max_output_tokens": 8}
    status, headers, got = server.request("POST", "/v1/responses", body)
    assert status == 200, got
    assert headers["content-type"].startswith("text/event-stream")
    assert "tools.web_search" in headers["x-pocket-fields-ignored"]
    lines = got["text"].split("\n")
    events = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: ")]
    names = [x[len("event: "):] for x in lines if x.startswith("event: ")]
    assert names == [e["type"] for e in events]  # an event: line before each data: line
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names.count("response.in_progress") >= 3, names  # beats during the prefill
    assert events[-1]["type"] == "response.incomplete"  # cut at 8 tokens


def raw(server, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", "/v1/responses", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_bad_input_is_a_400_and_the_server_stays_up(server, client):
    cases = [
        ({"model": MODEL, "input": "hi", "previous_response_id": "resp_x"},
         "previous_response_id"),
        ({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, "'item_reference'"),
        ({"model": MODEL, "input": "hi", "tools": [{"type": "function"}]}, "tools[0]"),
        ({"model": MODEL, "input": "hi", "tools": "nope"}, "tools: must be a list"),
        ({"model": "other", "input": "hi"}, "does not exist here"),
    ]
    for body, needle in cases:
        status, got = raw(server, body)
        assert status in (400, 404), got
        assert needle in got["error"]["message"] and "\n" not in got["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        ask(client, input="hi", previous_response_id="resp_x")
    assert server.health()["status"] == "ok"
    assert ask(client, input=QUESTION).output_text == tm.NO_TOOLS


# ---- reasoning: the bundled model under Qwen3.5's real template ------------------------------

@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model",
               str(qwen_model(tmp_path_factory)), "--device", "cpu", "--reasoning-budget", "16")
    yield openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
    s.stop()
    assert "Traceback" not in s.log.read_text()


def test_reasoning_items(thinker):
    kw = {"model": "qwen-tiny", "input": "What is the sea?", "temperature": 0,
          "max_output_tokens": 40}
    r = thinker.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 16
    assert "<think>" not in r.output_text and "</think>" not in r.output_text
    events = list(thinker.responses.create(**kw, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == r.output[0].content[0].text
    assert events[-1].response.output[1].content[0].text == r.output_text
    # effort none: no reasoning at all.
    off = thinker.responses.create(**kw, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0
    # The reasoning item sent back is accepted (Qwen3.5's template drops it before the last
    # user message).
    again = thinker.responses.create(**{**kw, "input": [
        {"role": "user", "content": "What is the sea?"},
        *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "And the sky?"}]})
    assert again.status in ("completed", "incomplete")
