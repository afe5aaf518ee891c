"""Anthropic's Messages API (POST /v1/messages): request checking, response and event shapes.

The same rules as server/openai.py: every field is named, one we do not honour (tools, images,
extended thinking, an assistant "prefill" as the last message) is a 400 in Anthropic's error
shape, never dropped. Requests become the same `GenRequest` the OpenAI endpoints make, so the
engine does not know which API a request came through. Usage follows Anthropic's split:
`input_tokens` counts only the prompt tokens that were prefilled, `cache_read_input_tokens` the
ones the prompt cache supplied.
"""

from __future__ import annotations

import uuid

from pocket_mlx.engine.params import (
    check_max_tokens,
)
from pocket_mlx.server.openai import (
    MAX_STOPS,
    ApiError,
    GenRequest,
    checked_field,
    sampling_fields,
)

# Accepted and without effect here: who is calling, where Anthropic would run it, and
# `cache_control`, a hint to cache the prompt (this server's cache needs no hint).
HARMLESS = {"metadata", "service_tier", "inference_geo", "user_profile_id", "workspace_id",
            "cache_control"}
FIELDS = HARMLESS | {
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "container", "mcp_servers",
    "output_config", "diagnostics", "speed", "min_p", "repetition_penalty", "seed"}
UNSUPPORTED = {"tools": "tool use is not implemented yet",
               "tool_choice": "tool use is not implemented yet",
               "thinking": "this server has no extended-thinking mode",
               "container": "no code-execution containers",
               "mcp_servers": "no MCP connector",
               "output_config": "no output formats or effort settings",
               "diagnostics": "no cache-miss diagnostics"}
# HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens",
                "context": "max_tokens"}


def error_body(e: ApiError) -> dict:
    """`e` in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


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
        extra = sorted(set(block) - {"type", "text", "cache_control"})
        if extra:
            raise ApiError(400, f"{w}: unrecognized field {extra[0]}", param=w,
                           code="unknown_parameter")
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"{w}.text must be a string", param=w, code="invalid_type")
        parts.append(block["text"])
    return "".join(parts)


def parse_messages(body: dict) -> GenRequest:
    """A /v1/messages body, checked."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: Extra inputs are not permitted", param=unknown[0],
                       code="unknown_parameter")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise ApiError(400, f"{name} is not supported by this server: {why}", param=name,
                           code="unsupported_parameter")
    if body.get("speed") not in (None, "standard"):
        raise ApiError(400, f"speed is not supported by this server: one speed only "
                            f"(\"standard\"), got {body['speed']!r}", param="speed",
                       code="unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model", code="invalid_type")
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens is required", param="max_tokens",
                       code="missing_required")
    max_tokens = checked_field(body, "max_tokens", check_max_tokens)
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
    sampling = sampling_fields(body)
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
        messages.append({"role": m["role"],
                         "content": _text_blocks(m["content"], f"{where}.content")})
    if messages[-1]["role"] == "assistant":
        raise ApiError(400, "the last message is from the assistant: continuing a partial "
                            "reply (prefill) is not supported by this server; end with a user "
                            "message", param=f"messages[{len(raw) - 1}]",
                       code="unsupported_parameter")
    return GenRequest(kind="chat", model=model, messages=messages, max_tokens=max_tokens,
                      sampling=sampling, stop=list(stops), stream=stream)


class Message:
    """The id and model one response's objects and events share."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model

    @staticmethod
    def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
        return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}

    def full(self, text: str, reason: str | None, stop_string: str | None, use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": STOP_REASONS.get(reason or "", "end_turn"),
                "stop_sequence": stop_string if reason == "stop" else None, "usage": use}

    def start(self, use: dict) -> list[tuple[str, dict]]:
        """The events that open a stream (up to the text block's start)."""
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": use}
        return [("message_start", {"type": "message_start", "message": msg}),
                ("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}}),
                ("ping", {"type": "ping"})]

    @staticmethod
    def delta(text: str) -> tuple[str, dict]:
        return ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}})

    def end(self, reason: str | None, stop_string: str | None,
            use: dict) -> list[tuple[str, dict]]:
        return [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": STOP_REASONS.get(reason or "", "end_turn"),
                    "stop_sequence": stop_string if reason == "stop" else None},
                    "usage": use}),
                ("message_stop", {"type": "message_stop"})]
