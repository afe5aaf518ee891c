"""OpenAI's Responses API (`POST /v1/responses`), stateless as llama.cpp's server and Ollama
serve it: a body checked into a `GenRequest` (server/requests.py), and the reply events
(server/jobs.py) rendered as the response object and the stream of events Codex CLI and the
openai SDK parse.

Why stateless: the server stores no response, so `previous_response_id`, `conversation`,
stored prompts and `background` are refused in one line (the client resends its input: Codex
does, with `store: false`); `store` itself is accepted without effect.

The request, as Codex CLI sends it: `input` items (messages of role user, system, developer
or assistant; `function_call` / `function_call_output`; `custom_tool_call` /
`custom_tool_call_output`; `reasoning`) become chat-template messages as server/openai.py makes
them (assistant `tool_calls` with parsed arguments, role "tool" with `tool_call_id`); the
leading system and developer messages, after `instructions`, become one system message (chat
templates render one system turn, first). Tools: function tools; freeform `custom` tools
(Codex's `apply_patch`) rendered as a function taking one string, `input`, whose call comes
back as a `custom_tool_call`; `namespace` tools flattened to `namespace.name` and their calls
given back with the namespace; tools with `defer_loading` left out of the prompt (what the
field asks for); hosted tools (web_search, file_search, ...) left out and named in the reply's
X-Pocket-Fields-Ignored header, as are the fields this server or model cannot honour. Reasoning
effort maps onto the model's thinking switch and budget (server/requests.py `EFFORTS`).

No MLX and no HTTP here: this module only shapes data.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pocket_mlx.server.jobs import Call, Done, Reasoning, Text, Whole
from pocket_mlx.server.requests import ApiError, GenRequest, effort
from pocket_mlx.server.tools import ToolCall
from pocket_mlx.server.wire import (
    bool_field,
    choice_target,
    function_tool,
    max_tokens,
    sampling,
    type_field,
    unique_tools,
    unsupported,
)

# Accepted and without effect on a local server: who the caller is, what OpenAI would store,
# how its cache would be keyed (this server's prompt cache matches on the prompt itself).
_HARMLESS = {"metadata", "user", "store", "service_tier", "safety_identifier",
             "prompt_cache_key", "prompt_cache_retention", "client_metadata", "stream_options"}
_KNOWN = _HARMLESS | {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning", "max_output_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "seed", "stream", "include", "text", "truncation", "top_logprobs",
    "max_tool_calls", "previous_response_id", "conversation", "prompt", "background",
    "context_management"}
# What needs a stored response or prompt: one line each, as the client can do without.
_STATEFUL = {
    "previous_response_id": "this server keeps no responses; resend the whole conversation "
                            "in input (with store false)",
    "conversation": "this server keeps no conversations; resend the whole conversation in "
                    "input",
    "prompt": "this server keeps no stored prompts; send instructions and input instead",
}
# Tools the server runs itself at OpenAI (or whose calls are items of their own): left out.
HOSTED = {"web_search", "web_search_preview", "web_search_2025_08_26",
          "web_search_preview_2025_03_11", "file_search", "computer_use_preview", "computer",
          "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
          "tool_search"}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
# Known fields of each input item (others are named in the ignored header).
_ITEM_FIELDS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "namespace", "id", "status",
                      "caller", "async"},
    "custom_tool_call": {"type", "call_id", "name", "input", "namespace", "id", "status",
                         "caller", "async"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "custom_tool_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
CUSTOM_ARG = "input"  # the one argument a freeform tool's function takes


@dataclass(frozen=True)
class ToolRef:
    """What a rendered function name stands for: a function or custom tool, maybe in a
    namespace."""

    kind: str  # "function" | "custom"
    name: str
    namespace: str | None = None


@dataclass
class Parsed:
    """A checked Responses body: the generation request, what each rendered tool name stands
    for, and the request's fields the response object repeats."""

    req: GenRequest
    names: dict[str, ToolRef] = field(default_factory=dict)
    echo: dict = field(default_factory=dict)


def _err(where: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{where}: {message}" if where else message, param=where or None,
                    code=code)


def parse_responses(body: dict) -> Parsed:
    """A /v1/responses body, checked."""
    for name, why in _STATEFUL.items():
        if body.get(name) is not None:
            raise unsupported(name, why)
    if bool_field(body, "background"):
        raise unsupported("background", "this server keeps no responses to poll; stream or "
                                        "wait for the reply")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _err("model", f"must be a string, got {model!r}", "invalid_type")
    for name, kinds, what in (("metadata", (dict,), "an object"),
                              ("include", (list,), "a list of strings"),
                              ("text", (dict,), "an object"),
                              ("reasoning", (dict,), "an object"),
                              ("user", (str,), "a string"),
                              ("prompt_cache_key", (str,), "a string"),
                              ("top_logprobs", (int,), "an integer"),
                              ("max_tool_calls", (int,), "an integer")):
        type_field(body, name, kinds, what)
    bool_field(body, "store")
    ignored = sorted(set(body) - _KNOWN)
    req = GenRequest(kind="chat", model=model, max_tokens=max_tokens(body, "max_output_tokens"),
                     sampling=sampling(body), stream=bool_field(body, "stream"))
    ignored += _options(body, req)
    tools, names, skipped = parse_tools(body.get("tools"))
    req.tools = tools
    req.tool_choice, req.tool_name = tool_choice(body.get("tool_choice"), tools, names)
    req.parallel_tool_calls = body.get("parallel_tool_calls") is not False
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise _err("parallel_tool_calls", "must be true or false", "invalid_type")
    req.messages = messages(body.get("instructions"), body.get("input"), ignored)
    req.ignored = sorted(set(ignored + skipped))
    echo = {k: body.get(k) for k in ("instructions", "metadata", "temperature", "top_p",
                                      "max_output_tokens", "user", "store", "truncation",
                                      "prompt_cache_key")}
    echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice", "auto"),
                parallel_tool_calls=req.parallel_tool_calls,
                reasoning=body.get("reasoning") or {"effort": None, "summary": None},
                text=body.get("text") or {"format": {"type": "text"}})
    return Parsed(req, names, echo)


def _options(body: dict, req: GenRequest) -> list[str]:
    """The reasoning switch, and the optional fields left without effect (named)."""
    ignored = []
    r = body.get("reasoning") or {}
    if r.get("effort") is not None:
        req.thinking, req.reasoning_budget = effort("reasoning.effort", r["effort"])
    # Summaries are not written here: a thinking model's reasoning comes back whole.
    ignored += [f"reasoning.{k}" for k in ("summary", "generate_summary")
                if r.get(k) not in (None, "none")]
    ignored += [f"reasoning.{k}" for k in sorted(set(r) - {"effort", "summary",
                                                           "generate_summary"})]
    include = body.get("include") or []
    if not all(isinstance(v, str) for v in include):
        raise _err("include", "must be a list of strings", "invalid_type")
    ignored += [f"include.{v}" for v in include]  # nothing here is encrypted or scored
    text = body.get("text") or {}
    fmt = text.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str)):
        raise _err("text.format", 'must be {"type": "text" | "json_schema" | "json_object", '
                                  '...}')
    if fmt is not None and fmt["type"] != "text":
        ignored.append("text.format")  # replies are not constrained to JSON here
    if text.get("verbosity") is not None:
        ignored.append("text.verbosity")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise _err("truncation", f'must be "auto" or "disabled", got {truncation!r}')
    if truncation == "auto":
        ignored.append("truncation")  # a prompt past the window is a 400, never cut
    for name in ("top_logprobs", "max_tool_calls", "context_management"):
        if body.get(name) not in (None, 0, []):
            ignored.append(name)
    return ignored


# ---- tools ---------------------------------------------------------------------------------

def parse_tools(raw) -> tuple[list[dict] | None, dict[str, ToolRef], list[str]]:
    """(function definitions as chat templates receive them, rendered name -> tool, tools left
    out and named)."""
    if raw is None:
        return None, {}, []
    if not isinstance(raw, list):
        raise _err("tools", "must be a list", "invalid_type")
    out: list[dict] = []
    names: dict[str, ToolRef] = {}
    skipped: list[str] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise _err(where, "must be an object with a type", "invalid_type")
        if t["type"] == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not ns or not isinstance(t.get("tools"), list):
                raise _err(where, 'a namespace needs a name and a list of tools '
                                  '({"type": "namespace", "name": ..., "tools": [...]})')
            for j, sub in enumerate(t["tools"]):
                _one_tool(sub, f"{where}.tools[{j}]", ns, out, names, skipped)
        else:
            _one_tool(t, where, None, out, names, skipped)
    return unique_tools(out, "tool"), names, skipped


def _one_tool(t, where: str, ns: str | None, out: list[dict], names: dict[str, ToolRef],
              skipped: list[str]) -> None:
    if not isinstance(t, dict) or not isinstance(t.get("type"), str):
        raise _err(where, "must be an object with a type", "invalid_type")
    kind = t["type"]
    if kind not in ("function", "custom"):
        skipped.append(f"tools.{kind}")  # hosted (or unknown) tools: this server runs none
        return
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise _err(where, f"a {kind} tool needs a name", "missing_required")
    if t.get("defer_loading") is True:
        return  # loaded on demand by a tool search: not in the prompt
    full = f"{ns}.{name}" if ns else name
    if kind == "function":
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _err(f"{where}.strict", "must be true or false", "invalid_type")
        if strict:
            skipped.append("tools.function.strict")  # decoding is not constrained here
        out.append(function_tool(full, t.get("description"), t.get("parameters"), where))
    else:
        out.append(function_tool(full, t.get("description"), _custom_schema(t, where), where))
        if isinstance(t.get("format"), dict) and t["format"].get("type") == "grammar":
            skipped.append("tools.custom.format")  # the grammar is shown, not enforced
    names[full] = ToolRef(kind, name, ns)


def _custom_schema(t: dict, where: str) -> dict:
    """A freeform tool as a function taking one string: its text, in the tool's format."""
    fmt = t.get("format")
    about = "The tool's input: raw text, not JSON."
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
            raise _err(f"{where}.format", 'must be {"type": "text"} or {"type": "grammar", '
                                          '"syntax": ..., "definition": ...}')
        if fmt["type"] == "grammar":
            syntax, definition = fmt.get("syntax"), fmt.get("definition")
            if not isinstance(syntax, str) or not isinstance(definition, str):
                raise _err(f"{where}.format", "a grammar needs a syntax and a definition "
                                              "(strings)")
            about = (f"The tool's input: raw text, not JSON, in this {syntax} grammar:\n"
                     f"{definition}")
    return {"type": "object", "properties": {CUSTOM_ARG: {"type": "string",
                                                          "description": about}},
            "required": [CUSTOM_ARG]}


def tool_choice(choice, tools: list[dict] | None,
                names: dict[str, ToolRef]) -> tuple[str, str | None]:
    """(auto | none | required | function, the named function) of a Responses tool_choice."""
    usage = ('tool_choice must be "none", "auto", "required", {"type": "function", "name": '
             '...} or {"type": "custom", "name": ...}')
    name = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
            choice = choice["mode"]  # the tools it allows are all offered
        elif kind in ("function", "custom") and isinstance(choice.get("name"), str):
            ns = choice.get("namespace")
            choice, name = "function", f"{ns}.{choice['name']}" if ns else choice["name"]
        elif kind in HOSTED:
            raise unsupported("tool_choice", f"the hosted tool {kind!r} (this server runs "
                                             "no hosted tools)")
        else:
            raise ApiError(400, usage, param="tool_choice", code="invalid_value")
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, usage, param="tool_choice", code="invalid_value")
    if choice in ("auto", "required") and not tools:
        choice = "none" if choice == "auto" else choice
    choice_target(choice, name, tools, choice, "tool")
    return choice, name


# ---- input ---------------------------------------------------------------------------------

def messages(instructions, items, ignored: list[str]) -> list[dict]:
    """`instructions` and `input` as chat-template messages."""
    if instructions is not None and not isinstance(instructions, str):
        raise _err("instructions", "must be a string", "invalid_type")
    if items is None:
        raise _err("input", "is required", "missing_required")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _err("input", "must be a string or a non-empty list of items", "invalid_type")
    out = History()
    if instructions:
        out.system(instructions)
    for i, item in enumerate(items):
        out.add(item, f"input[{i}]", ignored)
    return out.done()


class History:
    """Input items folded into chat messages: leading system and developer text into one
    system message; an assistant message and the calls after it (and the reasoning before
    them) into one assistant turn; each call's output a "tool" message."""

    def __init__(self) -> None:
        self.out: list[dict] = []
        self.lead: list[str] = []  # system text before any other message
        self.turn: dict | None = None  # the assistant turn being built
        self.thought = ""  # reasoning waiting for the assistant turn it precedes

    def system(self, text: str) -> None:
        if not self.out and self.turn is None:
            self.lead.append(text)
        else:
            self._flush()
            self.out.append({"role": "system", "content": text})

    def add(self, item, where: str, ignored: list[str]) -> None:
        if not isinstance(item, dict):
            raise _err(where, "must be an object", "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_FIELDS:
            raise unsupported(where, f"input items of type {kind!r} (this server reads "
                                     "message, function_call, function_call_output, "
                                     "custom_tool_call, custom_tool_call_output and reasoning)")
        ignored += [f"input.{kind}.{k}" for k in sorted(set(item) - _ITEM_FIELDS[kind])]
        if kind == "message":
            self._message(item, where)
        elif kind == "reasoning":
            self.thought += _reasoning_text(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            self._call(item, kind, where)
        else:
            call_id = _string(item, "call_id", where)
            self._flush()
            self.out.append({"role": "tool", "tool_call_id": call_id,
                             "content": _output(item.get("output"), f"{where}.output")})

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise _err(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        text = _content(item.get("content"), f"{where}.content")
        if ROLES[role] == "system":
            return self.system(text)
        self._flush()
        if role == "assistant":
            self.turn = {"role": "assistant", "content": text}
            self._take_thought()
        else:
            self._lead()
            self.out.append({"role": "user", "content": text})

    def _call(self, item: dict, kind: str, where: str) -> None:
        call_id = _string(item, "call_id", where)
        name = _string(item, "name", where)
        ns = item.get("namespace")
        if ns is not None and not isinstance(ns, str):
            raise _err(f"{where}.namespace", "must be a string", "invalid_type")
        if kind == "custom_tool_call":
            args = {CUSTOM_ARG: _string(item, "input", where, empty=True)}
        else:
            args = _arguments(item.get("arguments"), f"{where}.arguments")
        if self.turn is None:
            self._lead()
            self.turn = {"role": "assistant", "content": ""}
        self._take_thought()
        self.turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function",
             "function": {"name": f"{ns}.{name}" if ns else name, "arguments": args}})

    def _take_thought(self) -> None:
        """The reasoning before the turn's message or call, as the turn's reasoning_content
        (the template decides: Qwen3.5's drops it before the last user turn)."""
        if self.thought:
            before = self.turn.get("reasoning_content", "")
            self.turn["reasoning_content"] = before + self.thought
            self.thought = ""

    def _lead(self) -> None:
        if self.lead and not self.out:
            self.out.append({"role": "system", "content": "\n\n".join(self.lead)})
            self.lead = []

    def _flush(self) -> None:
        self._lead()
        if self.turn is not None:
            self.out.append(self.turn)
            self.turn = None

    def done(self) -> list[dict]:
        self._flush()
        return self.out


def _string(item: dict, key: str, where: str, empty: bool = False) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (not v and not empty):
        raise _err(f"{where}.{key}", "must be a non-empty string" if not empty
                   else "must be a string", "invalid_type" if not isinstance(v, str)
                   else "invalid_value")
    return v


def _content(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _err(where, "must be a string or a list of content parts", "invalid_type")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _err(f"{where}[{i}]", "must be an object with a type", "invalid_type")
        if part["type"] == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
            continue
        if part["type"] not in _TEXT_PARTS:
            raise unsupported(f"{where}[{i}]", f"content of type {part['type']!r} (this "
                                               "model reads text only)")
        if not isinstance(part.get("text"), str):
            raise _err(f"{where}[{i}].text", "must be a string", "invalid_type")
        parts.append(part["text"])
    return "".join(parts)


def _output(output, where: str) -> str:
    """A call's output: a string, or a list of text parts."""
    if output is None:
        raise _err(where, "is required", "missing_required")
    return _content(output, where)


def _arguments(args, where: str) -> dict:
    """A function call's JSON arguments, parsed (chat templates want objects)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise _err(where, "is not valid JSON") from None
    if not isinstance(args, dict):
        raise _err(where, "must be a JSON object (as a string)")
    return args


def _reasoning_text(item: dict, where: str) -> str:
    """The readable reasoning of a reasoning item (its reasoning_text parts); summaries and
    encrypted content (another server's) are not the model's own words and are dropped."""
    content = item.get("content")
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _err(f"{where}.content", "must be a list of reasoning_text parts", "invalid_type")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise _err(f"{where}.content[{i}]", 'must be {"type": "reasoning_text", "text": '
                                                '...}', "invalid_type")
        texts.append(part["text"])
    return "".join(texts)


# ---- the response --------------------------------------------------------------------------

def _hex() -> str:
    return uuid.uuid4().hex[:24]


def usage(done: Done, reasoning: bool) -> dict:
    """The Responses usage object (reasoning tokens 0 where the reply had no block)."""
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens
                                      if reasoning else 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class Response:
    """One response: its id and head, the output items built from the reply events, and the
    stream events that announce each step (each a dict with its `type` and
    `sequence_number`)."""

    def __init__(self, parsed: Parsed, model: str) -> None:
        self.id = f"resp_{_hex()}"
        self.created = int(time.time())
        self.model, self.names, self.echo = model, parsed.names, parsed.echo
        self.req = parsed.req
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written (message or reasoning)
        self.seq = 0

    def object(self, status: str, done: Done | None = None, error: ApiError | None = None
               ) -> dict:
        """The response object: in_progress (no output yet), completed, incomplete or
        failed."""
        reasoning = self.echo["reasoning"]
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "background": False, "error": None,
               "incomplete_details": None, "model": self.model, "output": list(self.items),
               "previous_response_id": None, "usage": None, **self.echo,
               "reasoning": {"effort": reasoning.get("effort"),
                             "summary": reasoning.get("summary")}}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
        if done is not None:  # reasoning counted where the reply was parsed for it
            out["usage"] = usage(done, self.req.reasoning_open is not None)
        if error is not None:
            out["error"] = {"code": error.code or "server_error", "message": error.message}
        return out

    def event(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        head = self.object("in_progress")
        return [self.event("response.created", response=head),
                self.event("response.in_progress", response=head)]

    def beat(self) -> dict:
        """A keep-alive while nothing else comes (a long prompt prefilling): response.in_progress
        again, a real event. An SSE comment would not do: Codex's idle timer (and other
        clients') counts events, which comments are not."""
        return self.event("response.in_progress", response=self.object("in_progress"))

    def feed(self, part: Reasoning | Text | Call) -> list[dict]:
        """The events that write `part` into the output."""
        if isinstance(part, Call):
            return self.close() + self._call(part.call)
        kind = "reasoning" if isinstance(part, Reasoning) else "message"
        out = [] if self.open is not None and self.open["type"] == kind else (
            self.close() + self._open(kind))
        item = self.open
        part_json = item["content"][0]
        part_json["text"] += part.text
        delta = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self.event(delta, item_id=item["id"], output_index=len(self.items),
                                 content_index=0, delta=part.text, **extra)]

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": f"msg_{_hex()}", "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": f"rs_{_hex()}", "type": "reasoning", "summary": [], "content": [],
                    "encrypted_content": None, "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.open = item
        at = len(self.items)
        events = [self.event("response.output_item.added", output_index=at,
                             item=json.loads(json.dumps(item))),
                  self.event("response.content_part.added", item_id=item["id"],
                             output_index=at, content_index=0, part=dict(part))]
        item["content"].append(part)
        return events

    def close(self) -> list[dict]:
        """The events that finish the item being written, if one is."""
        item, self.open = self.open, None
        if item is None:
            return []
        at, part = len(self.items), item["content"][0]
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        if item["type"] == "message":
            done = self.event("response.output_text.done", **ids, text=part["text"],
                              logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", **ids, text=part["text"])
        self.items.append(item)
        return [done, self.event("response.content_part.done", **ids, part=dict(part)),
                self.event("response.output_item.done", output_index=at, item=item)]

    def _call(self, call: ToolCall) -> list[dict]:
        """A whole call as its item: added, its arguments (or input) in one delta, done."""
        ref = self.names.get(call.name, ToolRef("function", call.name))
        hexid = call.id.split("_", 1)[-1] if call.id else _hex()
        call_id = call.id or f"call_{hexid}"
        at = len(self.items)
        if ref.kind == "custom":
            item = {"id": f"ctc_{hexid}", "type": "custom_tool_call", "status": "completed",
                    "call_id": call_id, "name": ref.name, "input": custom_input(call)}
            body, field_name, prefix = item["input"], "input", "response.custom_tool_call_input"
        else:
            item = {"id": f"fc_{hexid}", "type": "function_call", "status": "completed",
                    "call_id": call_id, "name": ref.name, "arguments": call.arguments_json()}
            body, field_name = item["arguments"], "arguments"
            prefix = "response.function_call_arguments"
        if ref.namespace:
            item["namespace"] = ref.namespace
        added = {**item, "status": "in_progress", field_name: ""}
        ids = {"item_id": item["id"], "output_index": at}
        self.items.append(item)
        done_fields = {field_name: body}
        if ref.kind == "function":
            done_fields["name"] = ref.name
        return [self.event("response.output_item.added", output_index=at, item=added),
                self.event(f"{prefix}.delta", **ids, delta=body),
                self.event(f"{prefix}.done", **ids, **done_fields),
                self.event("response.output_item.done", output_index=at, item=item)]

    def end(self, done: Done) -> list[dict]:
        """The last events: the open item finished, then response.completed (or
        response.incomplete, when the reply was cut at the token limit or the window)."""
        out = self.close()
        status = status_of(done)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self.event(kind, response=self.object(status, done))]

    def failed(self, error: ApiError) -> list[dict]:
        return self.close() + [self.event("response.failed",
                                          response=self.object("failed", error=error))]

    def whole(self, whole: Whole) -> dict:
        """The non-streaming response object."""
        for part in whole.parts:
            self.feed(part)
        self.close()
        return self.object(status_of(whole.done), whole.done)


def status_of(done: Done) -> str:
    return "incomplete" if done.finish_reason in ("length", "context") else "completed"


def custom_input(call: ToolCall) -> str:
    """A freeform tool's input from the call the model wrote: its one string argument."""
    args = call.arguments
    if isinstance(args, dict):
        if isinstance(args.get(CUSTOM_ARG), str):
            return args[CUSTOM_ARG]
        if len(args) == 1 and isinstance(next(iter(args.values())), str):
            return next(iter(args.values()))
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
