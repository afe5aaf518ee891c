"""Anthropic's Messages API (POST /v1/messages): request checking, response and event shapes.

The same rules as server/openai.py: every field is named; an optional feature we lack
(extended thinking, output_config, diagnostics, speed other than standard, unknown fields) is
left out and named in the X-Pocket-Fields-Ignored header and the log; what would change the
reply's meaning unseen (server tools: container, mcp_servers; images; an assistant "prefill"
as the last message) is a 400 in Anthropic's error shape. Tool use maps onto the chat template's tools: `tools` become
OpenAI-shaped function definitions, `tool_use` blocks an assistant message's `tool_calls`,
`tool_result` blocks `role: "tool"` messages; the reply's calls (server/tools.py) come back as
`tool_use` blocks with `stop_reason: "tool_use"`. Requests become the same `GenRequest` the OpenAI endpoints make, so the
engine does not know which API a request came through. Usage follows Anthropic's split:
`input_tokens` counts only the prompt tokens that were prefilled, `cache_read_input_tokens` the
ones the prompt cache supplied.
"""

from __future__ import annotations

import json
import uuid

from pocket_mlx.server.requests import ApiError, GenRequest
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
    "output_config", "diagnostics", "speed", "min_p", "repetition_penalty", "seed"}
UNSUPPORTED = {"container": "no code-execution containers",
               "mcp_servers": "no MCP connector"}
# Left out and said (X-Pocket-Fields-Ignored): no extended-thinking blocks, output formats,
# effort settings or cache diagnostics here.
IGNORED = ("thinking", "output_config", "diagnostics")
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


def _blocks(content, where: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks", param=where,
                       code="invalid_type")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, f"{where}[{i}] must be an object with a type",
                           param=f"{where}[{i}]", code="invalid_type")
    return content


def _only(block: dict, keys: set[str], w: str) -> None:
    """No fields but `keys` (and type, cache_control); a null field counts as absent, and a
    tool_use's `caller` may say it was called directly: the SDKs' `model_dump()` of a
    response's blocks carries both."""
    extra = sorted(k for k in set(block) - keys - {"type", "cache_control"}
                   if block[k] is not None
                   and not (k == "caller" and block[k] == {"type": "direct"}))
    if extra:
        raise ApiError(400, f"{w}: unrecognized field {extra[0]}", param=w,
                       code="unknown_parameter")


def _tool_result_text(block: dict, w: str) -> str:
    """A tool_result's content (a string or text blocks) as text; an error result says so."""
    _only(block, {"tool_use_id", "content", "is_error"}, w)
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise ApiError(400, f"{w}.tool_use_id is required", param=w, code="missing_required")
    content = block.get("content", "")
    text = _text_blocks(content, f"{w}.content") if content is not None else ""
    if block.get("is_error") not in (None, False, True):
        raise ApiError(400, f"{w}.is_error must be true or false", param=w, code="invalid_type")
    return f"Error: {text}" if block.get("is_error") else text


def _turn(m: dict, where: str) -> list[dict]:
    """One Anthropic message as chat-template messages: a user turn's tool_result blocks
    become `role: "tool"` messages (before its text), an assistant turn's tool_use blocks
    its `tool_calls`."""
    role = m["role"]
    blocks = _blocks(m["content"], f"{where}.content")
    texts, calls, results = [], [], []
    for i, block in enumerate(blocks):
        w = f"{where}.content[{i}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_text_blocks([block], w))
        elif kind == "tool_use" and role == "assistant":
            _only(block, {"id", "name", "input"}, w)
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(400, f"{w}.name must be a non-empty string", param=w,
                               code="invalid_value")
            if not isinstance(block.get("input"), dict):
                raise ApiError(400, f"{w}.input must be an object", param=w,
                               code="invalid_type")
            calls.append({"id": block.get("id") if isinstance(block.get("id"), str) else "",
                          "type": "function",
                          "function": {"name": name, "arguments": block["input"]}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _tool_result_text(block, w)})
        else:
            raise ApiError(400, f"{w}: content blocks of type {kind!r} are not supported by "
                                f"this server in {role} messages", param=w,
                           code="unsupported_parameter")
    text = "".join(texts)
    if role == "assistant":
        msg = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _tools(body: dict) -> tuple[list[dict] | None, str, str | None, bool]:
    """`tools` and `tool_choice`: (OpenAI-shaped tools or None, choice, named tool,
    parallel calls allowed)."""
    raw = body.get("tools")
    tools = None
    if raw is not None:
        if not isinstance(raw, list):
            raise ApiError(400, "tools must be a list", param="tools", code="invalid_type")
        tools = []
        for i, t in enumerate(raw):
            w = f"tools[{i}]"
            if not isinstance(t, dict):
                raise ApiError(400, f"{w} must be an object", param=w, code="invalid_type")
            if t.get("type") not in (None, "custom"):
                raise ApiError(400, f"{w}: server tools ({t.get('type')!r}) are not supported "
                                    "by this server; define client tools with name and "
                                    "input_schema", param=w, code="unsupported_parameter")
            _only(t, {"name", "description", "input_schema"}, w)
            if not isinstance(t.get("input_schema"), dict):
                raise ApiError(400, f"{w}.input_schema is required (a JSON Schema object)",
                               param=w, code="missing_required")
            tools.append(function_tool(t.get("name"), t.get("description"), t["input_schema"],
                                       w))
        tools = unique_tools(tools, "tool")
    choice = body.get("tool_choice")
    kinds = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    if choice is None:
        return tools, "auto" if tools else "none", None, True
    if not isinstance(choice, dict) or choice.get("type") not in kinds:
        raise ApiError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or '
                            '{"type": "tool", "name": ...}', param="tool_choice",
                       code="invalid_value")
    _only(choice, {"name", "disable_parallel_tool_use"}, "tool_choice")
    kind = kinds[choice["type"]]
    name = choice.get("name") if kind == "function" else None
    if kind == "function" and not isinstance(name, str):
        raise ApiError(400, "tool_choice: type tool needs a name", param="tool_choice",
                       code="invalid_value")
    choice_target(kind, name, tools, choice["type"], "tool")
    parallel = choice.get("disable_parallel_tool_use") is not True
    return tools, kind, name, parallel


def _text_blocks(content, where: str) -> str:
    """A string, or a list of text blocks (cache_control, a caching hint, allowed), as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks", param=where,
                       code="invalid_type")
    parts = []
    for i, block in enumerate(content):
        w = f"{where}[{i}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, f"{w} must be an object with a type", param=w,
                           code="invalid_type")
        if block["type"] != "text":
            raise ApiError(400, f"{w}: content blocks of type {block['type']!r} are not "
                                "supported by this server (text only)", param=w,
                           code="unsupported_parameter")
        _only(block, {"text"}, w)
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"{w}.text must be a string", param=w, code="invalid_type")
        parts.append(block["text"])
    return "".join(parts)


def parse_messages(body: dict) -> GenRequest:
    """A /v1/messages body, checked."""
    ignored = sorted(set(body) - FIELDS)  # unknown fields: left out and said
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise ApiError(400, f"{name} is not supported by this server: {why}", param=name,
                           code="unsupported_parameter")
    for name in IGNORED:
        v = body.get(name)
        if v is not None and not isinstance(v, dict):
            raise ApiError(400, f"{name} must be an object", param=name, code="invalid_type")
        if v and v != {"type": "disabled"}:
            ignored.append(name)
    if body.get("speed") not in (None, "standard"):
        ignored.append("speed")  # one speed only
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model", code="invalid_type")
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens is required", param="max_tokens",
                       code="missing_required")
    cap = max_tokens(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream",
                       code="invalid_type")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop_sequences must be a list of non-empty strings",
                       param="stop_sequences", code="invalid_value")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop_sequences: at most {MAX_STOPS}", param="stop_sequences",
                       code="invalid_value")
    chosen = sampling(body)
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    raw = body.get("messages")
    if raw is None:
        raise ApiError(400, "messages is required", param="messages", code="missing_required")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list", param="messages",
                       code="invalid_type")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", param=where, code="invalid_type")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise ApiError(400, f"{where}.{extra[0]}: Extra inputs are not permitted",
                           param=f"{where}.{extra[0]}", code="unknown_parameter")
        if m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be user or assistant, got "
                                f"{m.get('role')!r}", param=f"{where}.role",
                           code="invalid_value")
        if "content" not in m:
            raise ApiError(400, f"{where}.content is required", param=f"{where}.content",
                           code="missing_required")
        messages += _turn(m, where)
    tools, choice, name, parallel = _tools(body)
    if messages[-1]["role"] == "assistant":
        raise ApiError(400, "the last message is from the assistant: continuing a partial "
                            "reply (prefill) is not supported by this server; end with a user "
                            "message", param=f"messages[{len(raw) - 1}]",
                       code="unsupported_parameter")
    return GenRequest(kind="chat", model=model, messages=messages, max_tokens=cap,
                      sampling=chosen, stop=list(stops), stream=stream, tools=tools,
                      tool_choice=choice, tool_name=name, parallel_tool_calls=parallel,
                      ignored=sorted(ignored))


class Message:
    """The id and model one response's objects and events share."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model

    @staticmethod
    def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
        return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}

    def full(self, text: str, reason: str | None, stop_string: str | None, use: dict,
             calls: list | None = None) -> dict:
        """The non-streaming message: a text block (left out when empty and the reply made
        calls), then one tool_use block per call."""
        content = [{"type": "text", "text": text}] if text or not calls else []
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


class Blocks:
    """The content-block events of a streamed message: a text block opens at the first text
    and closes before a tool_use block; each call is one tool_use block whose input arrives as
    one input_json_delta. A reply with no content at all still gets an (empty) text block."""

    def __init__(self) -> None:
        self.index = -1
        self.text_open = False

    def _open(self, block: dict) -> tuple[str, dict]:
        self.index += 1
        return ("content_block_start", {"type": "content_block_start", "index": self.index,
                                        "content_block": block})

    def _close(self) -> tuple[str, dict]:
        self.text_open = False
        return ("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def text(self, text: str) -> list[tuple[str, dict]]:
        out = []
        if not self.text_open:
            out.append(self._open({"type": "text", "text": ""}))
            self.text_open = True
        out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                            "delta": {"type": "text_delta", "text": text}}))
        return out

    def call(self, call) -> list[tuple[str, dict]]:
        out = [self._close()] if self.text_open else []
        block = tool_use(call)
        out.append(self._open({**block, "input": {}}))
        out.append(("content_block_delta", {
            "type": "content_block_delta", "index": self.index,
            "delta": {"type": "input_json_delta",
                      "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        out.append(("content_block_stop", {"type": "content_block_stop",
                                           "index": self.index}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        if self.index < 0:  # nothing was said: an empty text block, as before tools
            return [self._open({"type": "text", "text": ""}), self._close()]
        return [self._close()] if self.text_open else []
