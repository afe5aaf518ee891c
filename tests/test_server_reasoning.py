"""Reasoning through `pocket-mlx serve`'s OpenAI endpoints, end to end: a real server on the
bundled model with Qwen3.5's real chat template (tests/fixtures/templates), driven by the
official `openai` client.

Why the bundled model: under Qwen3.5's template its reply starts inside `<think>` and it never
closes the block by itself, which is the hard case: the budget must close it, a reply cut by
max_tokens must come back as reasoning only, and the answer must never carry the tags.
(Anthropic's thinking blocks and the other wire formats have their own tests.)
"""

from __future__ import annotations

import json
import shutil
import sys

import openai
import pytest
from conftest import ASSET, ROOT
from test_server import Server

TEMPLATE = ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja"
MODEL = "qwen-tiny"
LONG = "Tell me about the sea and the ships that sail on it, and the sailors who " * 8


def qwen_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(ASSET, folder)
    shutil.copyfile(TEMPLATE, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model",
               str(qwen_model(tmp_path_factory)), "--device", "cpu", "--reasoning-budget", "16")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The same server with its prompt cache off."""
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model",
               str(qwen_model(tmp_path_factory)), "--device", "cpu", "--reasoning-budget", "16",
               "--prompt-cache-mb", "0")
    yield openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
    s.stop()


def ask(client, content=LONG, **kw):
    kw = {"max_tokens": 40, "temperature": 0, **kw}
    return client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": content}], **kw)


def test_the_budget_closes_the_block_and_the_answer_follows(client):
    for prompt in ("Hello there", "What is the sea?", LONG):
        r = ask(client, prompt)
        m = r.choices[0].message
        assert 0 < r.usage.completion_tokens_details.reasoning_tokens <= 16
        assert m.reasoning_content and m.reasoning == m.reasoning_content
        assert m.content, "an answer after the forced close"
        for tag in ("<think>", "</think>"):
            assert tag not in m.content and tag not in m.reasoning_content


def test_streamed_reasoning_comes_before_the_answer(client):
    stream = ask(client, stream=True, stream_options={"include_usage": True})
    kinds, reasoning, answer, use = [], [], [], None
    for chunk in stream:
        if not chunk.choices:
            use = chunk.usage
            continue
        d = chunk.choices[0].delta
        if getattr(d, "reasoning_content", None):
            kinds.append("r")
            reasoning.append(d.reasoning_content)
            assert d.reasoning == d.reasoning_content
        if d.content:
            kinds.append("a")
            answer.append(d.content)
    assert "r" in kinds and "a" in kinds
    assert "".join(kinds).index("a") > len(kinds) - 1 - "".join(kinds)[::-1].index("r")
    whole = ask(client).choices[0].message
    assert "".join(reasoning) == whole.reasoning_content
    assert "".join(answer) == whole.content
    assert use.completion_tokens_details.reasoning_tokens <= 16


def test_a_request_budget_wins_over_the_servers(client):
    r = ask(client, reasoning_effort="minimal")  # 128 > 40: the block runs to max_tokens
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == ""
    assert r.usage.completion_tokens_details.reasoning_tokens > 16


@pytest.mark.parametrize("switch", [{"reasoning_effort": "none"},
                                    {"extra_body": {"chat_template_kwargs":
                                                    {"enable_thinking": False}}}])
def test_thinking_off_by_each_switch(client, server, switch):
    r = ask(client, **switch)
    m = r.choices[0].message
    assert m.content and not getattr(m, "reasoning_content", None)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    headers = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False}})[1]
    assert "x-pocket-fields-ignored" not in headers


def test_a_bad_switch_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="reasoning_effort must be one of"):
        ask(client, reasoning_effort="lots")
    with pytest.raises(openai.BadRequestError, match="enable_thinking must be true or false"):
        ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": "no"}})


def test_a_block_never_closed_is_reasoning_only(client):
    r = ask(client, max_tokens=10, reasoning_effort="high")  # no budget: runs to max_tokens
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert c.message.content == "" and c.message.reasoning_content
    assert r.usage.completion_tokens_details.reasoning_tokens == 10


def test_turn_two_reuses_turn_one_up_to_its_generation_prompt(client, cold):
    """Qwen3.5's template drops earlier turns' reasoning, so turn 2 shares turn 1's prompt up
    to the end of its user message: the snapshot taken there serves it, whether the client
    sends the reasoning back or not. The same reply with the cache as without it."""
    first = ask(client)
    gen_prompt = 7  # "<|im_start|>assistant\n<think>\n" in the bundled tokenizer
    m = first.choices[0].message
    for back in (True, False):
        reply = {"role": "assistant", "content": m.content}
        if back:
            reply["reasoning_content"] = m.reasoning_content
        msgs = [{"role": "user", "content": LONG}, reply, {"role": "user", "content": "More?"}]
        r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30,
                                            temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens >= (
            first.usage.prompt_tokens - gen_prompt)
        r0 = cold.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30,
                                          temperature=0)
        assert r0.usage.prompt_tokens_details.cached_tokens == 0
        assert (r0.choices[0].message.content, r0.choices[0].message.reasoning_content) \
            == (r2.choices[0].message.content, r2.choices[0].message.reasoning_content)


# ---- the thinking test model (tests/fixtures/think-model): it closes its block itself -------
sys.path.insert(0, str(ROOT / "scripts"))
import make_think_model as tk  # noqa: E402


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "--model",
               str(ROOT / "tests" / "fixtures" / "think-model"), "--device", "cpu")
    client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
    client._server = s  # the Anthropic tests below ask the same server
    yield client
    s.stop()
    assert "Traceback" not in s.log.read_text()


def think(client, messages, **kw):
    return client.chat.completions.create(model="think-model", messages=messages,
                                          temperature=0, max_tokens=80, **kw)


def test_reasoning_and_answer_apart(thinker):
    r = think(thinker, tk.ADD)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (tk.ADD_REASONING, tk.ADD_ANSWER)
    assert r.choices[0].finish_reason == "stop"
    n = len(thinker_tokens(tk.ADD_REASONING + "\n</think>"))
    assert abs(r.usage.completion_tokens_details.reasoning_tokens - n) <= 2


def thinker_tokens(text: str) -> list[int]:
    from pocket_mlx.engine.tokenizer import load_tokenizer

    return load_tokenizer(ROOT / "tests" / "fixtures" / "think-model").encode(
        text, add_special_tokens=False)


def test_thinking_off_renders_the_empty_block(thinker):
    for switch in ({"reasoning_effort": "none"},
                   {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        m = think(thinker, tk.ADD, **switch).choices[0].message
        assert (m.content, getattr(m, "reasoning_content", None)) == (tk.ADD_DIRECT, None)


def test_a_tool_call_after_reasoning_is_a_tool_call(thinker):
    r = think(thinker, tk.WEATHER_Q, tools=tk.TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == tk.TOOL_REASONING
    call = c.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    assert not c.message.content
    stream = think(thinker, tk.WEATHER_Q, tools=tk.TOOLS, stream=True)
    seen = ""
    for chunk in stream:
        d = chunk.choices[0].delta
        seen += "r" if getattr(d, "reasoning_content", None) else ""
        seen += "c" if d.tool_calls else ""
        assert not d.content or "<tool_call>" not in d.content
    assert seen.rstrip("c").count("c") == 0 and seen.endswith("c") and "r" in seen
    # The round trip: reasoning sent back, the tool's result, the trained answer.
    back = [*tk.WEATHER_Q, {"role": "assistant", "content": "", "reasoning_content":
                            tk.TOOL_REASONING, "tool_calls": [{
                                "id": "call_1", "type": "function", "function": {
                                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": tk.RESULT}]
    m = think(thinker, back, tools=tk.TOOLS).choices[0].message
    assert (m.reasoning_content, m.content) == (tk.RESULT_REASONING, tk.RESULT_ANSWER)


# ---- the same through Anthropic's Messages API and its official client ----------------------
def claude_for(server: Server):
    import anthropic

    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused",
                               max_retries=0, timeout=60)


def message(claude, messages, model=MODEL, max_tokens=40, tools=None, **body):
    """`body` (thinking, ...) as sent, with temperature 0 (this SDK takes neither as keyword
    arguments)."""
    extra = {"tools": tools} if tools else {}
    return claude.messages.create(model=model, max_tokens=max_tokens, messages=messages,
                                  extra_body={"temperature": 0, **body}, **extra)


def test_anthropic_budget_tokens_closes_the_block(server):
    claude = claude_for(server)
    m = message(claude, [{"role": "user", "content": LONG}],
                thinking={"type": "enabled", "budget_tokens": 8})
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "text"], kinds
    from pocket_mlx.server.anthropic import from_signature

    thought = from_signature(m.content[0].signature)
    assert thought and m.content[0].thinking == thought
    assert m.content[1].text and "</think>" not in m.content[1].text
    n = len(load_bundled_tokens(thought))
    assert n <= 8 + 1, (n, thought)  # the block's text, re-encoded (boundary tokens may merge)


def load_bundled_tokens(text: str) -> list[int]:
    from pocket_mlx.engine.tokenizer import load_tokenizer

    return load_tokenizer(ASSET).encode(text, add_special_tokens=False)


def test_anthropic_turn_two_reuses_turn_one(server):
    """The history sent back with its thinking block (as Claude Code does) or without it."""
    claude = claude_for(server)
    first = message(claude, [{"role": "user", "content": LONG}])
    t1 = first.usage.input_tokens + first.usage.cache_read_input_tokens
    blocks = [b.model_dump(exclude_none=True) for b in first.content]
    for history in (blocks, [b for b in blocks if b["type"] != "thinking"]):
        msgs = [{"role": "user", "content": LONG}, {"role": "assistant", "content": history},
                {"role": "user", "content": "More?"}]
        second = message(claude, msgs)
        assert second.usage.cache_read_input_tokens >= t1 - 7  # its generation prompt


def test_anthropic_tool_call_after_reasoning(thinker):
    s = thinker._server
    claude = claude_for(s)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in tk.TOOLS]
    m = message(claude, tk.WEATHER_Q, model="think-model", tools=tools, max_tokens=80)
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == tk.TOOL_REASONING and m.stop_reason == "tool_use"
    assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris"})
    off = message(claude, tk.ADD, model="think-model", thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in off.content] == [("text", tk.ADD_DIRECT)]
