"""The OpenAI wire format: request bodies checked into a `GenRequest` (server/requests.py), and
the response shapes.

Every field a request may carry is named here, and each is honoured, accepted without effect
(who the caller is, what OpenAI would store), or ignored and said: an optional feature this
server or model lacks (`logprobs`, `logit_bias`, penalties other than repetition_penalty,
`response_format` json, Ollama's `keep_alive`/`options`, any unknown field)
is left out, and the reply's `X-Pocket-Fields-Ignored` header and the server's log name it
(`GenRequest.ignored`), as llama.cpp's server and Ollama answer such requests rather than
refusing them: web UIs (Open WebUI) send several by default. A 400 is kept for malformed
values and for what would change a reply's meaning unseen: `n` > 1 (as llama.cpp), content the
model cannot read (images), the deprecated functions API, audio output, `echo`, `suffix`,
`best_of` > 1. docs/SERVE.md has the table. Value ranges are engine/params.py's `check_*`
functions, the same sentences the CLI prints. No MLX here: this module only shapes data.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from pocket_mlx.server.requests import ApiError, GenRequest, check, effort
from pocket_mlx.server.wire import (
    bool_field,
    choice_target,
    function_tool,
    max_tokens,
    sampling,
    stop_list,
    type_field,
    unique_tools,
    unsupported,
)

# Accepted and without effect on a local server: who the caller is, what OpenAI would store.
_HARMLESS = {"user", "metadata", "store", "service_tier", "safety_identifier",
             "prompt_cache_key"}
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p",
             "repetition_penalty", "repeat_penalty", "stop", "seed", "stream", "stream_options",
             "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"}
CHAT_FIELDS = _HARMLESS | _SAMPLING | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
    "function_call", "parallel_tool_calls", "response_format", "audio", "modalities",
    "prediction", "reasoning_effort", "web_search_options", "verbosity",
    "chat_template_kwargs"}
COMPLETION_FIELDS = _HARMLESS | _SAMPLING | {"prompt", "echo", "suffix", "best_of"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
# Fields of an assistant message that clients echo back from a response (the openai SDK's
# `message.model_dump()`): accepted when empty.
_ECHOED_EMPTY = {"refusal", "audio", "function_call", "annotations"}
# An assistant message's reasoning as clients send it back (both names: clients disagree).
_REASONING = ("reasoning_content", "reasoning")
_unsupported = unsupported
_bool = bool_field
_type = type_field


def _unknown_fields(body: dict, known: set[str]) -> list[str]:
    """Fields this server does not know (Ollama's keep_alive and options, another server's
    extensions, a typo): ignored, and named in the reply's header and the log."""
    return sorted(set(body) - known)


def _common(body: dict, kind: str) -> GenRequest:
    """The fields both endpoints share."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r}", param="model",
                       code="invalid_type")
    ignored: list[str] = []
    _type(body, "n", (int,), "an integer")
    n = body.get("n")
    if n is not None and n != 1:
        # Answering one choice where several were asked for would break a client that
        # indexes them: refused, as llama.cpp's server does.
        raise _unsupported("n", "one choice per request (n = 1); send several requests")
    for name in ("presence_penalty", "frequency_penalty"):
        _type(body, name, (int, float), "a number")
        if body.get(name) not in (None, 0):
            ignored.append(name)  # repetition_penalty (an extension) is the one honoured
    _type(body, "logit_bias", (dict,), "an object of token id -> bias")
    if body.get("logit_bias"):
        ignored.append("logit_bias")
    stream = _bool(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, 'stream_options must be an object ({"include_usage": '
                                'true|false})', param="stream_options", code="invalid_type")
        if not stream:
            ignored.append("stream_options")  # nothing to stream: no effect (OpenAI refuses)
        else:
            include_usage = _bool(opts, "include_usage")
            ignored += [f"stream_options.{k}" for k in sorted(set(opts) - {"include_usage"})]
    stops = stop_list(body.get("stop"), "stop")
    chosen = sampling(body)
    repeat = check("repeat_penalty", body.get("repeat_penalty"), "repetition_penalty")
    if repeat is not None:  # llama.cpp's name
        if body.get("repetition_penalty") is not None and chosen.repetition_penalty != repeat:
            raise ApiError(400, "repeat_penalty and repetition_penalty disagree: give one of "
                                "them", param="repeat_penalty", code="invalid_value")
        chosen = replace(chosen, repetition_penalty=repeat)
    return GenRequest(kind=kind, model=model,
                      max_tokens=max_tokens(body), sampling=chosen, stop=stops, stream=stream,
                      include_usage=include_usage, ignored=ignored)


def _content(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ApiError(400, f"{where}[{i}] must be an object with a type",
                               param=where, code="invalid_type")
            if part["type"] != "text":
                raise _unsupported(f"{where}[{i}]", f"content of type {part['type']!r} (this "
                                                    "model reads text only)")
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{i}].text must be a string", param=where,
                               code="invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", param=where,
                   code="invalid_type")


def parse_chat(body: dict) -> GenRequest:
    """A /v1/chat/completions body, checked."""
    unknown = _unknown_fields(body, CHAT_FIELDS)
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise _unsupported(name, "the deprecated functions API; send tools and tool_choice")
    _type(body, "logprobs", (bool,), "true or false")
    _type(body, "top_logprobs", (int,), "an integer")
    _type(body, "response_format", (dict,), 'an object ({"type": ...})')
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt.get("type"), str):
        raise ApiError(400, 'response_format must be {"type": "text" | "json_object" | '
                            '"json_schema", ...}', param="response_format", code="invalid_value")
    if body.get("audio") is not None:
        raise _unsupported("audio", "no audio output (this model writes text)")
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list)
                                   or not set(modalities) <= {"text"}):
        raise _unsupported("modalities", 'text only (["text"])')
    req = _common(body, "chat")
    ignored = [name for name in ("logprobs", "top_logprobs", "prediction", "web_search_options",
                                 "verbosity")
               if body.get(name) not in (None, False)]
    thinking_switches(body, req, ignored)
    if fmt is not None and fmt.get("type") != "text":
        ignored.append("response_format")  # replies are not constrained to JSON here
    req.ignored = sorted(set(req.ignored + ignored + unknown))
    mct = max_tokens(body, "max_completion_tokens")
    if mct is not None:
        if req.max_tokens is not None and req.max_tokens != mct:
            raise ApiError(400, f"max_tokens ({req.max_tokens}) and max_completion_tokens "
                                f"({mct}) disagree: give one of them",
                           param="max_completion_tokens", code="invalid_value")
        req.max_tokens = mct
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "messages is required", param="messages", code="missing_required")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages",
                       code="invalid_type")
    out = []
    for i, m in enumerate(messages):
        out.append(_chat_message(m, f"messages[{i}]"))
    req.messages = out
    req.tools, req.tool_choice, req.tool_name = chat_tools(body)
    if any(isinstance(t, dict) and isinstance(t.get("function"), dict)
           and t["function"].get("strict") for t in body.get("tools") or []):
        req.ignored = sorted(set(req.ignored) | {"tools.function.strict"})
    req.parallel_tool_calls = body.get("parallel_tool_calls") is not False
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise ApiError(400, "parallel_tool_calls must be true or false",
                       param="parallel_tool_calls", code="invalid_type")
    return req


def _chat_message(m, where: str) -> dict:
    """One message of a chat request, as the chat template receives it: role and content
    text, plus an assistant's `tool_calls` (arguments parsed into objects, as transformers'
    templates want them) or a tool result's `tool_call_id`."""
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object", param=where, code="invalid_type")
    role = m.get("role")
    if role == "function":
        raise _unsupported(f"{where}.role", "function messages belong to the deprecated "
                                            "functions API; send role \"tool\" results")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                       param=f"{where}.role", code="invalid_value")
    allowed = {"role", "content", "name"}
    if role == "assistant":
        allowed |= {"tool_calls", *_REASONING}
        allowed |= {k for k in _ECHOED_EMPTY if m.get(k) in (None, [], "")}
    elif role == "tool":
        allowed.add("tool_call_id")
    extra = sorted(set(m) - allowed)
    if extra:
        raise ApiError(400, f"{where}: unrecognized field {extra[0]}",
                       param=f"{where}.{extra[0]}", code="unknown_parameter")
    thought = _reasoning(m, where) if role == "assistant" else None
    calls = m.get("tool_calls")
    if calls is not None and calls != []:
        out = {"role": "assistant",
               "content": "" if m.get("content") is None
               else _content(m["content"], f"{where}.content"),
               "tool_calls": [_tool_call(c, f"{where}.tool_calls[{j}]")
                              for j, c in enumerate(_list(calls, f"{where}.tool_calls"))]}
        return {**out, "reasoning_content": thought} if thought else out
    if "content" not in m or m["content"] is None:
        raise ApiError(400, f"{where}.content is required", param=f"{where}.content",
                       code="missing_required")
    out = {"role": ROLES[role], "content": _content(m["content"], f"{where}.content")}
    if thought:  # the template decides: Qwen3.5's drops it before the last user message
        out["reasoning_content"] = thought
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise ApiError(400, f"{where}.tool_call_id is required (the id of the call this "
                                "result answers)", param=f"{where}.tool_call_id",
                           code="missing_required")
        out["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def thinking_switches(body: dict, req: GenRequest, ignored: list[str]) -> None:
    """`reasoning_effort` (OpenAI's: none switches thinking off, the levels set a budget:
    server/requests.py EFFORTS) and `chat_template_kwargs.enable_thinking` (vLLM's and
    llama.cpp's convention; it wins over the effort's switch) onto `req`; other template
    keywords are named in `ignored`."""
    if body.get("reasoning_effort") is not None:
        req.thinking, req.reasoning_budget = effort("reasoning_effort", body["reasoning_effort"])
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object",
                       param="chat_template_kwargs", code="invalid_type")
    if kwargs.get("enable_thinking") is not None:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                           param="chat_template_kwargs", code="invalid_type")
        req.thinking = kwargs["enable_thinking"]
    ignored += [f"chat_template_kwargs.{k}" for k in sorted(set(kwargs) - {"enable_thinking"})]


def _reasoning(m: dict, where: str) -> str | None:
    """An assistant message's reasoning sent back (reasoning_content or reasoning)."""
    got = None
    for k in _REASONING:
        v = m.get(k)
        if v in (None, ""):
            continue
        if not isinstance(v, str):
            raise ApiError(400, f"{where}.{k} must be a string", param=f"{where}.{k}",
                           code="invalid_type")
        got = v
    return got


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise ApiError(400, f"{where} must be a list", param=where, code="invalid_type")
    return v


def _tool_call(c, where: str) -> dict:
    """An assistant message's tool call, its JSON arguments parsed."""
    if not isinstance(c, dict) or c.get("type", "function") != "function" \
            or not isinstance(c.get("function"), dict):
        raise ApiError(400, f"{where} must be {{\"type\": \"function\", \"id\": ..., "
                            "\"function\": {\"name\": ..., \"arguments\": ...}}",
                       param=where, code="invalid_value")
    extra = sorted(set(c) - {"id", "type", "function", "index"})
    if extra:
        raise ApiError(400, f"{where}: unrecognized field {extra[0]}",
                       param=f"{where}.{extra[0]}", code="unknown_parameter")
    f = c["function"]
    name = f.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.function.name must be a non-empty string",
                       param=f"{where}.function.name", code="invalid_value")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments is not valid JSON",
                           param=f"{where}.function.arguments", code="invalid_value") from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object",
                       param=f"{where}.function.arguments", code="invalid_value")
    call_id = c.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ApiError(400, f"{where}.id must be a string", param=f"{where}.id",
                       code="invalid_type")
    return {"id": call_id or "", "type": "function",
            "function": {"name": name, "arguments": args}}


def chat_tools(body: dict) -> tuple[list[dict] | None, str, str | None]:
    """`tools` and `tool_choice` of a chat request: (tools or None, choice, named function)."""
    raw = body.get("tools")
    tools: list[dict] | None = None
    if raw is not None:
        tools = []
        for i, t in enumerate(_list(raw, "tools")):
            where = f"tools[{i}]"
            if not isinstance(t, dict):
                raise ApiError(400, f"{where} must be an object", param=where,
                               code="invalid_type")
            if t.get("type") != "function":
                raise _unsupported(where, f"tools of type {t.get('type')!r} (function tools "
                                          "only)")
            f = t.get("function")
            if not isinstance(f, dict) or set(t) - {"type", "function"}:
                raise ApiError(400, f'{where} must be {{"type": "function", "function": '
                                    '{...}}', param=where, code="invalid_value")
            extra = sorted(set(f) - {"name", "description", "parameters", "strict"})
            if extra:
                raise ApiError(400, f"{where}.function: unrecognized field {extra[0]}",
                               param=f"{where}.function.{extra[0]}", code="unknown_parameter")
            if f.get("strict") is not None and not isinstance(f["strict"], bool):
                raise ApiError(400, f"{where}.function.strict must be true or false",
                               param=f"{where}.function.strict", code="invalid_type")
            # strict: decoding is not constrained to the schema here; the call is parsed and
            # checked as any other (parse_chat names strict among the ignored fields).
            tools.append(function_tool(f.get("name"), f.get("description"),
                                       f.get("parameters"), f"{where}.function"))
        tools = unique_tools(tools)
    choice = body.get("tool_choice")
    name = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str):
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or '
                                '{"type": "function", "function": {"name": ...}}',
                           param="tool_choice", code="invalid_value")
        choice, name = "function", f["name"]
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}',
                       param="tool_choice", code="invalid_value")
    choice_target(choice, name, tools, choice)
    return tools, choice, name


def parse_completion(body: dict) -> GenRequest:
    """A /v1/completions body, checked. The prompt is a string, or token ids, or a list holding
    one of them (several prompts would be several choices: refused like n > 1)."""
    unknown = _unknown_fields(body, COMPLETION_FIELDS)
    _type(body, "logprobs", (int,), "an integer")
    if _bool(body, "echo"):
        raise _unsupported("echo", "the prompt is not echoed")
    if body.get("suffix") is not None:
        raise _unsupported("suffix", "no fill-in-the-middle")
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of", "one candidate per request")
    req = _common(body, "completion")
    logprobs = ["logprobs"] if body.get("logprobs") not in (None, 0) else []
    req.ignored = sorted(set(req.ignored + logprobs + unknown))
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError(400, "prompt is required", param="prompt", code="missing_required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
        raise _unsupported("prompt", "one prompt per request (a list of prompts would be "
                                     "several choices)")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                 for t in prompt):
            raise ApiError(400, "prompt must be a string or a non-empty list of token ids",
                           param="prompt", code="invalid_type")
    elif not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt",
                       code="invalid_type")
    if isinstance(prompt, str) and not prompt:
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
    req.prompt = prompt
    return req


# ---- responses -----------------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def finish_reason(engine_reason: str | None, called: bool = False) -> str:
    """The engine's reason (eos, stop, length, context) as OpenAI's (stop, length), and
    tool_calls when the reply made calls and ended by itself."""
    reason = FINISH_REASONS.get(engine_reason or "", "stop")
    return "tool_calls" if called and reason == "stop" else reason


def tool_call_json(call, index: int | None = None) -> dict:
    """A `ToolCall` (server/tools.py) as OpenAI's `tool_calls` item; with `index` (streamed),
    the whole call in one delta, which clients accumulate by index like piecewise ones."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json()}}
    return out if index is None else {"index": index, **out}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None = None) -> dict:
    """`reasoning_tokens`: of the completion, those in the reasoning block (None: a model
    without one, and no `completion_tokens_details`)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


class Reply:
    """The id, timestamp and model name one response's objects share."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, reason: str, use: dict, calls: list | None = None,
             reasoning: str = "") -> dict:
        """The non-streaming response; `calls`: the reply's tool calls (content is then null
        when the model wrote nothing else, as OpenAI's are); `reasoning`: a thinking model's,
        under both names clients read (`reasoning_content`: llama.cpp, DeepSeek;
        `reasoning`: vLLM, Ollama, mlx-lm)."""
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text}
            if reasoning:
                message.update(reasoning_content=reasoning, reasoning=reasoning)
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [tool_call_json(c) for c in calls]
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": use}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": use}

    def chunk(self, text: str | None = None, reason: str | None = None, *, role: bool = False,
              with_usage: bool = False, call: dict | None = None, reasoning: str = "") -> dict:
        """One streamed chunk: a text piece, the opening role (chat), a tool call (`call`, a
        `tool_call_json` with its index), or the closing reason. With `with_usage`
        (stream_options.include_usage) every chunk carries `usage: null`, as OpenAI's do, and
        `usage_chunk` ends the stream."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else (
                {"tool_calls": [call]} if call is not None else
                {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}
