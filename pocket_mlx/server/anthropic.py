"""Anthropic's Messages API (POST /v1/messages): request checking, response and event shapes.

The same rules as server/openai.py: every field is named; an optional feature we lack (output
formats and effort in `output_config`, diagnostics, speed other than standard, context edits
other than keeping thinking, unknown fields) is left out and named in the
X-Pocket-Fields-Ignored header and the log; what would change the reply's meaning unseen (server
tools: container, mcp_servers; images; an assistant "prefill" as the last message) is a 400 in
Anthropic's error shape.

Requests as Claude Code sends them (docs/AGENTS.md): `system`-role messages inside `messages`
are kept where they stand (server/prompts.py fits them to the chat template); `thinking`
(`enabled` with `budget_tokens`, `adaptive`, `disabled`) is the model's reasoning switch
(`GenRequest.thinking` True / None / False, `reasoning_budget`); a system text block or line that
starts with `x-anthropic-billing-header:` (a client's per-request billing line, a nonce in some
versions) is left out of the prompt, so the prompt a session shares with the next stays
byte-identical for the prompt cache; tools with `defer_loading: true` are left out of the
prompt (that is what the field asks), and a `tool_reference` to one in a tool result (the
client's tool search loaded it) is rendered there as the tool's definition; `thinking` blocks
in the history come back as the message's `reasoning_content` (the template keeps or drops
it), `redacted_thinking` blocks are dropped; `cache_control` is accepted anywhere (this
server's prompt cache needs no hint).

Tool use maps onto the chat template's tools: `tools` become OpenAI-shaped function
definitions, `tool_use` blocks an assistant message's `tool_calls`, `tool_result` blocks
`role: "tool"` messages; the reply's calls (server/tools.py) come back as `tool_use` blocks with
`stop_reason: "tool_use"`, its reasoning as a `thinking` block before them, whose `signature`
carries the reasoning itself (so a client that shows none of it, `display: "omitted"`, still
sends it back and the next prompt renders it as the model wrote it). Requests become the same
`GenRequest` the OpenAI endpoints make, so the engine does not know which API a request came
through. Usage follows Anthropic's split: `input_tokens` counts only the prompt tokens that were
prefilled, `cache_read_input_tokens` the ones the prompt cache supplied.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass, field

from pocket_mlx.server.requests import ApiError, GenRequest, check
from pocket_mlx.server.wire import (
    MAX_STOPS,
    choice_target,
    function_tool,
    max_tokens,
    sampling,
    unique_tools,
)

# Accepted and without effect here: who is calling, where Anthropic would run it, and
# `cache_control`, a hint to cache the prompt (this server's cache needs no hint).
HARMLESS = {"metadata", "service_tier", "inference_geo", "user_profile_id", "workspace_id",
            "cache_control"}
FIELDS = HARMLESS | {
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "container", "mcp_servers",
    "output_config", "diagnostics", "speed", "min_p", "repetition_penalty", "seed",
    "context_management"}
UNSUPPORTED = {"container": "no code-execution containers",
               "mcp_servers": "no MCP connector"}
# Left out and said (X-Pocket-Fields-Ignored) when not empty: no output formats or effort
# settings, no cache diagnostics here.
IGNORED = ("output_config", "diagnostics")
THINKING = {"enabled": True, "adaptive": None, "disabled": False}
# A tool's fields: accepted; `strict` and `input_examples` are named as ignored when used.
TOOL_FIELDS = {"name", "description", "input_schema", "defer_loading", "strict",
               "input_examples", "eager_input_streaming", "allowed_callers"}
# A client's per-request line in its system prompt (Claude Code's, with a nonce in some
# versions): left out of the prompt, as llama.cpp's server does, so the prompt cache reuses it.
VOLATILE_PREFIXES = ("x-anthropic-billing-header:",)
SIGNATURE_PREFIX = "pocket-mlx:"  # a thinking block's signature: this, then the text in base64
# HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens",
                "context": "max_tokens"}


def stop_reason(reason: str | None, called: bool = False) -> str:
    """The engine's reason as Anthropic's; tool_use when the reply made calls and ended by
    itself (at its end or at a stop sequence inside a call's aftermath)."""
    r = STOP_REASONS.get(reason or "", "end_turn")
    return "tool_use" if called and r == "end_turn" else r


def error_body(e: ApiError) -> dict:
    """`e` in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def signature(reasoning: str) -> str:
    """A thinking block's signature: the reasoning itself, so that it comes back whole."""
    return SIGNATURE_PREFIX + base64.b64encode(reasoning.encode("utf-8")).decode("ascii")


def from_signature(sig) -> str:
    """The reasoning a signature of ours carries ("" for any other)."""
    if not isinstance(sig, str) or not sig.startswith(SIGNATURE_PREFIX):
        return ""
    try:
        return base64.b64decode(sig[len(SIGNATURE_PREFIX):], validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return ""


def invalid(msg: str, where: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, msg, param=where, code=code)


def _blocks(content, where: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content blocks", where,
                      "invalid_type")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}[{i}] must be an object with a type", f"{where}[{i}]",
                          "invalid_type")
    return content


def _only(block: dict, keys: set[str], w: str) -> None:
    """No fields but `keys` (and type, cache_control); a null field counts as absent, and a
    tool_use's `caller` may say it was called directly: the SDKs' `model_dump()` of a
    response's blocks carries both."""
    extra = sorted(k for k in set(block) - keys - {"type", "cache_control"}
                   if block[k] is not None
                   and not (k == "caller" and block[k] == {"type": "direct"}))
    if extra:
        raise invalid(f"{w}: unrecognized field {extra[0]}", w, "unknown_parameter")


def _text(block: dict, w: str) -> str:
    _only(block, {"text"}, w)
    if not isinstance(block.get("text"), str):
        raise invalid(f"{w}.text must be a string", w, "invalid_type")
    return block["text"]


def _text_blocks(content, where: str) -> str:
    """A string, or a list of text blocks (cache_control, a caching hint, allowed), as text."""
    if isinstance(content, str):
        return content
    parts = []
    for i, block in enumerate(_blocks(content, where)):
        w = f"{where}[{i}]"
        if block["type"] != "text":
            raise invalid(f"{w}: content blocks of type {block['type']!r} are not supported "
                          "by this server (text only)", w, "unsupported_parameter")
        parts.append(_text(block, w))
    return "".join(parts)


def _steady(text: str) -> str:
    """`text` without the lines a client changes on every request (`VOLATILE_PREFIXES`)."""
    if not text.startswith(VOLATILE_PREFIXES) and "\nx-anthropic-" not in text:
        return text
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(VOLATILE_PREFIXES))


def system_text(content, where: str) -> str:
    """A system prompt (a string or text blocks) without its volatile lines; each block is
    looked at on its own, as the blocks are joined without a separator."""
    if isinstance(content, str):
        return _steady(content)
    blocks = _blocks(content, where)
    return "".join(_steady(_text_blocks([b], f"{where}[{i}]")) for i, b in enumerate(blocks))


@dataclass
class Settings:
    """What a body asks besides its messages: the reasoning switch and budget, whether the
    reasoning is shown (`display`), and the fields named as ignored."""

    thinking: bool | None = None
    budget: int | None = None
    shown: bool = True
    ignored: list[str] = field(default_factory=list)


def settings(body: dict) -> Settings:
    """`thinking`, `context_management`, `output_config`, `diagnostics` and `speed`, checked;
    unknown fields are named as ignored."""
    out = Settings(ignored=sorted(set(body) - FIELDS))
    for name in (*IGNORED, "thinking", "context_management"):
        v = body.get(name)
        if v is not None and not isinstance(v, dict):
            raise invalid(f"{name} must be an object", name, "invalid_type")
        if v and name in IGNORED:
            out.ignored.append(name)
    if body.get("speed") not in (None, "standard"):
        out.ignored.append("speed")  # one speed only
    if not _context_kept(body.get("context_management")):
        out.ignored.append("context_management")
    t = body.get("thinking")
    if t:
        kind = t.get("type")
        if kind not in (*THINKING, "between_tools"):
            raise invalid(f"thinking.type must be one of {', '.join(THINKING)}, got {kind!r}",
                          "thinking")
        _only(t, {"budget_tokens", "display"}, "thinking")
        if t.get("display") not in (None, "summarized", "omitted"):
            raise invalid('thinking.display must be "summarized" or "omitted"', "thinking")
        out.thinking = THINKING.get(kind)
        out.shown = t.get("display") != "omitted"
        if kind == "between_tools":
            out.ignored.append("thinking")
        if kind == "enabled":
            if t.get("budget_tokens") is None:
                raise invalid("thinking.budget_tokens is required with type enabled",
                              "thinking.budget_tokens", "missing_required")
            out.budget = check("thinking.budget_tokens", t["budget_tokens"], "max_tokens")
    return out


def _context_kept(cm: dict | None) -> bool:
    """Whether `context_management` asks nothing this server does not do: no edits, or
    thinking cleared with `keep: "all"` (the history is rendered as sent)."""
    edits = (cm or {}).get("edits") or []
    if not isinstance(edits, list):
        raise invalid("context_management.edits must be a list", "context_management",
                      "invalid_type")
    return all(isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking")
               and e.get("keep") in (None, "all") for e in edits)


@dataclass
class Tools:
    """A body's `tools` and `tool_choice`: OpenAI-shaped tools for the prompt (None: none),
    the deferred ones by name (not in the prompt), the choice, the named tool, whether
    parallel calls are allowed, and the tool fields named as ignored."""

    tools: list[dict] | None = None
    deferred: dict[str, dict] = field(default_factory=dict)
    choice: str = "none"
    name: str | None = None
    parallel: bool = True
    ignored: list[str] = field(default_factory=list)


def _tool(t, w: str, out: Tools) -> dict:
    """One client tool, checked, as a function definition."""
    if not isinstance(t, dict):
        raise invalid(f"{w} must be an object", w, "invalid_type")
    if t.get("type") not in (None, "custom"):
        raise invalid(f"{w}: server tools ({t.get('type')!r}) are not supported by this "
                      "server; define client tools with name and input_schema", w,
                      "unsupported_parameter")
    _only(t, TOOL_FIELDS, w)
    if not isinstance(t.get("input_schema"), dict):
        raise invalid(f"{w}.input_schema is required (a JSON Schema object)", w,
                      "missing_required")
    if t.get("defer_loading") not in (None, True, False):
        raise invalid(f"{w}.defer_loading must be true or false", w, "invalid_type")
    for name, used in (("strict", t.get("strict") is True), ("input_examples",
                                                              bool(t.get("input_examples")))):
        if used and f"tools.{name}" not in out.ignored:
            out.ignored.append(f"tools.{name}")
    return function_tool(t.get("name"), t.get("description"), t["input_schema"], w)


def tools(body: dict) -> Tools:
    """`tools` and `tool_choice`, checked; deferred tools (`defer_loading: true`) apart."""
    raw = body.get("tools")
    out = Tools()
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid("tools must be a list", "tools", "invalid_type")
        shown = []
        for i, t in enumerate(raw):
            fn = _tool(t, f"tools[{i}]", out)
            if t.get("defer_loading") is True:
                out.deferred[fn["function"]["name"]] = fn
            else:
                shown.append(fn)
        unique_tools(shown + list(out.deferred.values()), "tool")
        out.tools = shown or None
    choice = body.get("tool_choice")
    kinds = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    if choice is None:
        out.choice = "auto" if out.tools else "none"
        return out
    if not isinstance(choice, dict) or choice.get("type") not in kinds:
        raise invalid('tool_choice must be {"type": "auto" | "any" | "none"} or '
                      '{"type": "tool", "name": ...}', "tool_choice")
    _only(choice, {"name", "disable_parallel_tool_use"}, "tool_choice")
    out.choice = kinds[choice["type"]]
    out.name = choice.get("name") if out.choice == "function" else None
    if out.choice == "function" and not isinstance(out.name, str):
        raise invalid("tool_choice: type tool needs a name", "tool_choice")
    choice_target(out.choice, out.name, out.tools, choice["type"], "tool")
    out.parallel = choice.get("disable_parallel_tool_use") is not True
    return out


def _reference(block: dict, w: str, known: Tools) -> str:
    """A `tool_reference` in a tool result (the client's tool search found a tool): a deferred
    tool's definition, as the chat template would list it; a tool already in the prompt is
    named only."""
    _only(block, {"tool_name"}, w)
    name = block.get("tool_name")
    if name in known.deferred:
        return json.dumps(known.deferred[name], ensure_ascii=False)
    if name in [t["function"]["name"] for t in known.tools or []]:
        return f"The tool {name} is available."
    raise invalid(f"{w}: tool_reference names the tool {name!r}, which is not in tools", w)


def _tool_result_text(block: dict, w: str, known: Tools) -> str:
    """A tool_result's content (a string, text blocks, tool references) as text; an error
    result says so."""
    _only(block, {"tool_use_id", "content", "is_error"}, w)
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise invalid(f"{w}.tool_use_id is required", w, "missing_required")
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for i, b in enumerate(_blocks(content, f"{w}.content")):
            where = f"{w}.content[{i}]"
            parts.append(_reference(b, where, known) if b["type"] == "tool_reference"
                         else _text_blocks([b], where))
        text = "\n".join(p for p in parts if p) if any(
            b["type"] == "tool_reference" for b in content) else "".join(parts)
    if block.get("is_error") not in (None, False, True):
        raise invalid(f"{w}.is_error must be true or false", w, "invalid_type")
    return f"Error: {text}" if block.get("is_error") else text


def _assistant(blocks: list[dict], where: str) -> dict:
    """An assistant message: its text, tool_use blocks as `tool_calls`, thinking blocks as
    `reasoning_content` (their text, or what our signature carries); redacted thinking is
    dropped."""
    texts, calls, thoughts = [], [], []
    for i, block in enumerate(blocks):
        w = f"{where}[{i}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, w))
        elif kind == "tool_use":
            _only(block, {"id", "name", "input"}, w)
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise invalid(f"{w}.name must be a non-empty string", w)
            if not isinstance(block.get("input"), dict):
                raise invalid(f"{w}.input must be an object", w, "invalid_type")
            calls.append({"id": block.get("id") if isinstance(block.get("id"), str) else "",
                          "type": "function",
                          "function": {"name": name, "arguments": block["input"]}})
        elif kind == "thinking":
            _only(block, {"thinking", "signature"}, w)
            if not isinstance(block.get("thinking", ""), str):
                raise invalid(f"{w}.thinking must be a string", w, "invalid_type")
            thoughts.append(block.get("thinking") or from_signature(block.get("signature")))
        elif kind != "redacted_thinking":
            raise invalid(f"{w}: content blocks of type {kind!r} are not supported by this "
                          "server in assistant messages", w, "unsupported_parameter")
    msg = {"role": "assistant", "content": "".join(texts)}
    if any(thoughts):
        msg["reasoning_content"] = "\n\n".join(t for t in thoughts if t)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[dict], where: str, known: Tools) -> list[dict]:
    """A user turn: its tool_result blocks as `role: "tool"` messages, then its text."""
    texts, results = [], []
    for i, block in enumerate(blocks):
        w = f"{where}[{i}]"
        if block["type"] == "text":
            texts.append(_text(block, w))
        elif block["type"] == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _tool_result_text(block, w, known)})
        else:
            raise invalid(f"{w}: content blocks of type {block['type']!r} are not supported "
                          "by this server in user messages", w, "unsupported_parameter")
    return results + ([{"role": "user", "content": "".join(texts)}]
                      if texts or not results else [])


def _messages(raw, known: Tools) -> list[dict]:
    """`messages` as chat-template messages; `system` ones stay where they stand."""
    if raw is None:
        raise invalid("messages is required", "messages", "missing_required")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object", where, "invalid_type")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise invalid(f"{where}.{extra[0]}: Extra inputs are not permitted",
                          f"{where}.{extra[0]}", "unknown_parameter")
        if m.get("role") not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role must be user, assistant or system, got "
                          f"{m.get('role')!r}", f"{where}.role")
        if "content" not in m:
            raise invalid(f"{where}.content is required", f"{where}.content",
                          "missing_required")
        w = f"{where}.content"
        if m["role"] == "system":
            out.append({"role": "system", "content": system_text(m["content"], w)})
        elif m["role"] == "assistant":
            out.append(_assistant(_blocks(m["content"], w), w))
        else:
            out += _user(_blocks(m["content"], w), w, known)
    turns = [(i, m) for i, m in enumerate(raw) if m["role"] != "system"]
    if not turns:
        raise invalid("messages has no user message", "messages")
    if turns[-1][1]["role"] == "assistant":
        raise invalid("the last message is from the assistant: continuing a partial reply "
                      "(prefill) is not supported by this server; end with a user message",
                      f"messages[{turns[-1][0]}]", "unsupported_parameter")
    return out


def parse_messages(body: dict) -> GenRequest:
    """A /v1/messages body, checked."""
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise invalid(f"{name} is not supported by this server: {why}", name,
                          "unsupported_parameter")
    asked = settings(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model must be a string", "model", "invalid_type")
    if body.get("max_tokens") is None:
        raise invalid("max_tokens is required", "max_tokens", "missing_required")
    cap = max_tokens(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"stream must be true or false, got {stream!r}", "stream",
                      "invalid_type")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop_sequences must be a list of non-empty strings", "stop_sequences")
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop_sequences: at most {MAX_STOPS}", "stop_sequences")
    chosen = sampling(body)
    known = tools(body)
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": system_text(body["system"], "system")})
    messages += _messages(body.get("messages"), known)
    return GenRequest(kind="chat", model=model, messages=messages, max_tokens=cap,
                      sampling=chosen, stop=list(stops), stream=stream, tools=known.tools,
                      tool_choice=known.choice, tool_name=known.name,
                      parallel_tool_calls=known.parallel, thinking=asked.thinking,
                      reasoning_budget=asked.budget,
                      ignored=sorted(set(asked.ignored + known.ignored)))


def thinking_block(reasoning: str, shown: bool) -> dict:
    """A reply's reasoning as a thinking block (its text left out when the client asked for
    `display: "omitted"`; the signature carries it either way)."""
    return {"type": "thinking", "thinking": reasoning if shown else "",
            "signature": signature(reasoning)}


class Message:
    """The id and model one response's objects and events share; `shown`: whether reasoning
    text is sent (thinking's `display`)."""

    def __init__(self, model: str, shown: bool = True) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.shown = shown

    @staticmethod
    def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
        return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}

    def full(self, text: str, reason: str | None, stop_string: str | None, use: dict,
             calls: list | None = None, reasoning: str = "") -> dict:
        """The non-streaming message: a thinking block when the model reasoned, a text block
        (left out when empty and the reply made calls), then one tool_use block per call."""
        content = [thinking_block(reasoning, self.shown)] if reasoning else []
        content += [{"type": "text", "text": text}] if text or not calls else []
        content += [tool_use(c) for c in calls or []]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason(reason, bool(calls)),
                "stop_sequence": stop_string if reason == "stop" else None, "usage": use}

    def start(self, use: dict) -> list[tuple[str, dict]]:
        """The events that open a stream; content blocks open as their content arrives."""
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": use}
        return [("message_start", {"type": "message_start", "message": msg}),
                ("ping", {"type": "ping"})]

    def end(self, reason: str | None, stop_string: str | None, use: dict,
            called: bool = False) -> list[tuple[str, dict]]:
        return [("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": stop_reason(reason, called),
                    "stop_sequence": stop_string if reason == "stop" else None},
                    "usage": use}),
                ("message_stop", {"type": "message_stop"})]


def tool_use(call) -> dict:
    """A `ToolCall` as a tool_use block (`input` must be an object: anything else is wrapped)."""
    args = call.arguments if isinstance(call.arguments, dict) else {"value": call.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": args}


PING = ("ping", {"type": "ping"})  # also what a stream sends while nothing else comes


class Blocks:
    """The content-block events of a streamed message: a thinking block (thinking_delta per
    piece, its signature_delta before it stops) while the model reasons, a text block from the
    first answer text, each call one tool_use block whose input arrives as one
    input_json_delta; a block closes when the next opens. A reply with no content at all
    still gets an (empty) text block."""

    def __init__(self, shown: bool = True) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | None
        self.shown = shown
        self.reasoning: list[str] = []

    def _start(self, block: dict) -> tuple[str, dict]:
        self.index += 1
        self.open = block["type"]
        return ("content_block_start", {"type": "content_block_start", "index": self.index,
                                        "content_block": block})

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                        "delta": delta})

    def _stop(self) -> list[tuple[str, dict]]:
        """The open block's end (a thinking block's signature first)."""
        out = []
        if self.open == "thinking":
            sig = signature("".join(self.reasoning))
            out.append(self._delta({"type": "signature_delta", "signature": sig}))
            self.reasoning = []
        if self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop",
                                               "index": self.index}))
        self.open = None
        return out

    def thinking(self, text: str) -> list[tuple[str, dict]]:
        out = []
        if self.open != "thinking":
            out += self._stop()
            out.append(self._start({"type": "thinking", "thinking": "", "signature": ""}))
        self.reasoning.append(text)
        if self.shown:
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def text(self, text: str) -> list[tuple[str, dict]]:
        out = []
        if self.open != "text":
            out += self._stop()
            out.append(self._start({"type": "text", "text": ""}))
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def call(self, call) -> list[tuple[str, dict]]:
        out = self._stop()
        block = tool_use(call)
        out.append(self._start({**block, "input": {}}))
        out.append(self._delta({"type": "input_json_delta",
                                "partial_json": json.dumps(block["input"],
                                                           ensure_ascii=False)}))
        return out + self._stop()

    def close(self) -> list[tuple[str, dict]]:
        if self.index < 0:  # nothing was said: an empty text block, as before tools
            return [self._start({"type": "text", "text": ""}), *self._stop()]
        return self._stop()
