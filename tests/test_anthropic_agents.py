"""Anthropic's Messages API as coding agents send it today (Claude Code 2.1.332, issue 50):
`system` messages inside `messages`, `thinking` (enabled / adaptive / disabled, display
omitted), `context_management`, `output_config`, tools with `defer_loading` and the tool
search's `tool_reference` results, `thinking` blocks in the history, a volatile billing line
in the system prompt, `?beta=true` on the path; thinking blocks in replies, and the keep-alive
beat while a prompt prefills. The parser and the prompt layout on their own (no server), then
a real `serve` process on the bundled model with the official `anthropic` client.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
from pathlib import Path

import anthropic
import pytest
import test_server
from conftest import ASSET, ROOT
from test_server import Server

from pocket_mlx.engine.tokenizer import load_tokenizer
from pocket_mlx.server import anthropic as wire
from pocket_mlx.server.prompts import fit_system_messages, render_chat
from pocket_mlx.server.requests import ApiError
from pocket_mlx.server.streaming import kept_alive
from pocket_mlx.server.tools import ToolCall

QWEN = ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja"
TOOL_TEMPLATE = ROOT / "scripts" / "tool_template.jinja"
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; cch=1f2e;"
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}},
          "required": ["command"]}


def claude_code_body(prompt: str = "say hi", **over) -> dict:
    """A request in the shape Claude Code 2.1.332 sends its first one (texts shortened): the
    billing line as the system prompt's first block, the user's turn (a reminder, then the
    prompt), the environment as a `system` message after it, a deferred tool beside the
    others and its own ToolSearch, thinking adaptive with display omitted."""
    return {
        "model": "pocket-tiny", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": BILLING},
                   {"type": "text", "text": "You are a coding agent.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "\nAnswer briefly."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nBe nice.\n</system-reminder>\n"},
                {"type": "text", "text": prompt}]},
            {"role": "system", "content": [
                {"type": "text", "text": "# Environment\n - Primary working directory: /w",
                 "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA},
                  {"name": "ToolSearch", "description": "Find tools.",
                   "input_schema": {"type": "object", "properties": {
                       "query": {"type": "string"}}}},
                  {"name": "WebFetch", "description": "Fetch a page.", "defer_loading": True,
                   "input_schema": {"type": "object", "properties": {
                       "url": {"type": "string"}}}}],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        **over}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSET)


def with_template(tok, path: Path):
    """The bundled tokenizer with another chat template (a fresh one: templates are cached
    per tokenizer)."""
    t = load_tokenizer(ASSET)
    t.chat_template = path.read_text()
    return t


# ---- the parser ---------------------------------------------------------------------------

def test_claude_code_request_parses():
    req = wire.parse_messages(claude_code_body())
    assert [m["role"] for m in req.messages] == ["system", "user", "system"]
    # The billing line is not in the prompt; the rest of the system prompt is, as sent.
    assert req.messages[0]["content"] == "You are a coding agent.\nAnswer briefly."
    assert req.messages[1]["content"].endswith("say hi")
    assert req.messages[2]["content"].startswith("# Environment")
    # The deferred tool is not rendered; ToolSearch is.
    assert [t["function"]["name"] for t in req.tools] == ["Bash", "ToolSearch"]
    assert req.thinking is None and req.reasoning_budget is None  # adaptive: the server's
    assert req.ignored == ["output_config"]  # effort is not honoured; the rest is
    assert wire.settings(claude_code_body()).shown is False


@pytest.mark.parametrize("thinking,want", [
    ({"type": "enabled", "budget_tokens": 2048}, (True, 2048)),
    ({"type": "adaptive"}, (None, None)),
    ({"type": "disabled"}, (False, None)),
])
def test_thinking_is_the_reasoning_switch(thinking, want):
    req = wire.parse_messages(claude_code_body(thinking=thinking))
    assert (req.thinking, req.reasoning_budget) == want


@pytest.mark.parametrize("over,param", [
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, "thinking"),
    ({"context_management": {"edits": "all"}}, "context_management"),
    ({"tools": [{"name": "f", "input_schema": SCHEMA, "defer_loading": "yes"}]}, "tools[0]"),
    ({"messages": [{"role": "system", "content": "only a system message"}]}, "messages"),
])
def test_bad_agent_fields_are_one_line_400s(over, param):
    with pytest.raises(ApiError) as e:
        wire.parse_messages(claude_code_body(**over))
    assert e.value.status == 400 and e.value.param == param and "\n" not in e.value.message


def test_context_edits_we_do_not_make_are_said():
    body = claude_code_body(context_management={"edits": [
        {"type": "clear_tool_uses_20250919"}]})
    assert "context_management" in wire.parse_messages(body).ignored
    assert "context_management" not in wire.parse_messages(
        claude_code_body(context_management={"edits": []})).ignored


def test_history_thinking_tool_use_and_tool_reference():
    """A turn that searched for the deferred tool: the reference is rendered as its
    definition; the assistant's thinking (shown or only in our signature) comes back as
    reasoning_content; redacted thinking and cache_control anywhere are accepted."""
    body = claude_code_body()
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": wire.signature("I should look.")},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
             "input": {"query": "select:WebFetch"}, "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "tool_reference", "tool_name": "WebFetch"}],
             "cache_control": {"type": "ephemeral"}}]}]
    req = wire.parse_messages(body)
    assistant, result = req.messages[3], req.messages[4]
    assert assistant["reasoning_content"] == "I should look."
    assert assistant["tool_calls"][0]["function"]["name"] == "ToolSearch"
    assert result["role"] == "tool" and json.loads(result["content"])["function"]["name"] \
        == "WebFetch"
    body["messages"][-1]["content"][0]["content"] = [{"type": "tool_reference",
                                                      "tool_name": "Nope"}]
    with pytest.raises(ApiError, match="Nope"):
        wire.parse_messages(body)


def test_signature_carries_the_reasoning():
    assert wire.from_signature(wire.signature("déjà vu")) == "déjà vu"
    assert wire.from_signature("EqQBCkYIBxgCKkD") == ""  # someone else's: nothing


def test_thinking_blocks_in_a_stream_and_a_whole_message():
    blocks = wire.Blocks(shown=True)
    events = blocks.thinking("Let me ") + blocks.thinking("see.") + blocks.text("Hi") + \
        blocks.call(ToolCall("Bash", {"command": "ls"}, "toolu_2")) + blocks.close()
    kinds = [(n, o.get("content_block", o.get("delta", {})).get("type")) for n, o in events]
    assert kinds == [
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None), ("content_block_start", "text"),
        ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None)]
    assert wire.from_signature(events[3][1]["delta"]["signature"]) == "Let me see."
    hidden = wire.Blocks(shown=False)
    assert [o["delta"]["type"] for n, o in hidden.thinking("x") + hidden.close()
            if n == "content_block_delta"] == ["signature_delta"]
    msg = wire.Message("m", shown=False).full("Hi", "eos", None, {}, [], "hmm")
    assert msg["content"][0] == {"type": "thinking", "thinking": "",
                                 "signature": wire.signature("hmm")}


# ---- the prompt's layout ---------------------------------------------------------------------

@pytest.mark.parametrize("template", [QWEN, TOOL_TEMPLATE, ASSET / "chat_template.jinja"],
                         ids=["qwen3.5", "tool_template", "bundled"])
def test_system_messages_are_rendered_where_the_template_can(tok, template):
    """The opening's system messages join the system prompt (the environment reaches the
    prompt, before the question); a later one stays where it stands, as the template's own
    system turn where it renders one there, else as a user turn."""
    t = with_template(tok, template)
    body = claude_code_body(thinking={"type": "disabled"})
    body["messages"] += [{"role": "assistant", "content": "Hello."},
                         {"role": "system", "content": "Reminder: the date changed."},
                         {"role": "user", "content": "And now?"}]
    req = wire.parse_messages(body)
    text = render_chat(t, req)
    assert text.index("Answer briefly.") < text.index("# Environment") < text.index("say hi")
    assert text.index("Hello.") < text.index("Reminder: the date") < text.index("And now?")
    assert "x-anthropic-billing-header" not in text
    roles = [m["role"] for m in req.messages]
    late = "system" if template.name == "chat_template.jinja" else "user"
    assert roles == ["system", "user", "assistant", late, "user"]


def test_a_template_that_renders_late_system_messages_keeps_them(tok):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "system", "content": "c"}, {"role": "user", "content": "d"}]
    assert fit_system_messages(tok, msgs) == msgs  # the bundled template renders it
    qwen = with_template(tok, QWEN)
    assert fit_system_messages(qwen, msgs)[2] == {"role": "user", "content": "c"}


def test_second_session_shares_everything_but_the_question(tok):
    """Two new sessions in one folder: the rendered prompts differ only from the question
    on (the billing line's nonce is not in them)."""
    t = with_template(tok, TOOL_TEMPLATE)
    a = render_chat(t, wire.parse_messages(claude_code_body("say hi")))
    other = claude_code_body("what is 2+2?")
    other["system"][0]["text"] = BILLING.replace("1f2e", "9a9a")
    b = render_chat(t, wire.parse_messages(other))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert a[:shared].endswith("Be nice.\n</system-reminder>\n")
    assert "# Environment" in a[:shared]


# ---- keep-alive ------------------------------------------------------------------------------

def test_kept_alive_beats_in_silences_and_passes_items():
    async def slow():
        yield "a"
        await asyncio.sleep(0.35)
        yield "b"

    async def run(every):
        return [x async for x in kept_alive(slow(), ".", every)]

    got = asyncio.run(run(0.1))
    assert got[0] == "a" and got[-1] == "b" and 2 <= got.count(".") <= 4
    assert asyncio.run(run(0)) == ["a", "b"]


def test_kept_alive_cancels_the_stream_when_the_client_goes():
    closed = asyncio.Event()

    async def endless():
        try:
            while True:
                await asyncio.sleep(10)
                yield "x"
        finally:
            closed.set()

    async def run():
        task = asyncio.ensure_future(_drain(kept_alive(endless(), ".", 0.05)))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.wait_for(closed.wait(), 2)

    asyncio.run(run())


async def _drain(stream):
    async for _ in stream:
        pass


# ---- a real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setitem(test_server.ENV, "POCKET_MLX_KEEPALIVE_S", "0.05")
    folder = tmp_path_factory.mktemp("models") / "pocket-tiny"
    shutil.copytree(ASSET, folder)
    shutil.copyfile(TOOL_TEMPLATE, folder / "chat_template.jinja")
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def raw_stream(server: Server, path: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "x-api-key": "dummy",
                              "anthropic-version": "2023-06-01",
                              "anthropic-beta": "claude-code-20250219,effort-2025-11-24"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def test_claude_code_request_is_answered_with_pings_first(server):
    """The request as Claude Code sends it, on its path with `?beta=true`: a 200 stream whose
    prefill is covered by pings after message_start; count_tokens gives the same prompt size."""
    body = claude_code_body("Tell me a story. " * 60, max_tokens=8)
    status, text = raw_stream(server, "/v1/messages?beta=true", body)
    assert status == 200, text
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.count("ping") >= 2, names  # the first one, then beats during prefill
    start = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])
    use = start["message"]["usage"]
    count = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
    status, _, n = server.request("POST", "/v1/messages/count_tokens?beta=true", count)
    assert status == 200 and n["input_tokens"] == use["input_tokens"] + \
        use["cache_read_input_tokens"]
    assert " 400 " not in server.log.read_text()


def test_chat_completions_streams_beat_with_comments(server):
    """The same keep-alive on OpenAI's streams: SSE comments, which the openai client skips."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({
            "messages": [{"role": "user", "content": "Tell me a story. " * 200}],
            "max_tokens": 2, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    assert ": keep-alive\n\n" in text and text.rstrip().endswith("data: [DONE]")


def test_a_second_session_comes_from_the_cache(server):
    first = claude_code_body("What is the capital of France? " * 20, max_tokens=4,
                             stream=False)
    status, _, r1 = server.request("POST", "/v1/messages?beta=true", first)
    assert status == 200, r1
    second = claude_code_body("Name three colours.", max_tokens=4, stream=False)
    status, _, r2 = server.request("POST", "/v1/messages?beta=true", second)
    assert status == 200, r2
    use = r2["usage"]
    total = use["input_tokens"] + use["cache_read_input_tokens"]
    # Everything up to the question: system prompt, tools, environment, the reminder.
    assert use["cache_read_input_tokens"] >= 0.8 * total, use


def test_sdk_reads_thinking_and_tool_round_trip(server):
    """The official client parses the stream (pings and all) and a history with thinking
    blocks and a tool result."""
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}",
                                 api_key="unused", max_retries=0, timeout=60)
    body = claude_code_body(max_tokens=6)
    body.pop("stream")
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "ls first", "signature": wire.signature("x")},
            {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": "a.txt"}]}]
    extra = {k: body.pop(k) for k in ("context_management", "output_config")}
    with claude.messages.stream(**body, extra_body=extra) as stream:
        final = stream.get_final_message()
    assert final.role == "assistant" and final.usage.output_tokens >= 1
    assert all(b.type in ("text", "tool_use", "thinking") for b in final.content)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """The bundled model under Qwen3.5's real template (its reply starts inside <think>), the
    reasoning closed after 16 tokens."""
    folder = tmp_path_factory.mktemp("models") / "qwen-tiny"
    shutil.copytree(ASSET, folder)
    shutil.copyfile(QWEN, folder / "chat_template.jinja")
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(folder),
               "--device", "cpu", "--reasoning-budget", "16")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.mark.parametrize("display", ["summarized", "omitted"])
def test_sdk_reads_thinking_blocks(thinking_server, display):
    """Reasoning as a thinking block before the text, streamed and whole alike; its signature
    carries the reasoning, its text is empty when the client asked for `omitted`."""
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{thinking_server.port}",
                                 api_key="unused", max_retries=0, timeout=60)
    kw = {"model": "qwen-tiny", "max_tokens": 24, "messages": [{"role": "user",
                                                                  "content": "Hello"}],
          "extra_body": {"temperature": 0,
                         "thinking": {"type": "adaptive", "display": display}}}
    with claude.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    whole = claude.messages.create(**kw)
    for msg in (streamed, whole):
        first = msg.content[0]
        assert first.type == "thinking", msg.content
        reasoning = wire.from_signature(first.signature)
        assert reasoning and first.thinking == (reasoning if display == "summarized" else "")
    assert streamed.content[0].signature == whole.content[0].signature
    # Disabled: no thinking block.
    off = claude.messages.create(**{**kw, "extra_body": {"temperature": 0,
                                                         "thinking": {"type": "disabled"}}})
    assert all(b.type != "thinking" for b in off.content)
