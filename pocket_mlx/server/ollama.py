"""Ollama's wire format: /api/chat and /api/generate bodies checked into a `GenRequest`
(server/requests.py), the reply event stream (server/jobs.py) as Ollama's NDJSON chunks or
whole objects, and the shapes of /api/tags, /api/show, /api/ps and its errors.

Why a wire format of its own: the apps that know one local server (GitHub Copilot's Ollama
provider, Open WebUI's Ollama connection, litellm's `ollama_chat/`, the `ollama` client
libraries) speak only this, on the same model, engine, batching and cache as OpenAI's and
Anthropic's endpoints.

Fields, as docs/SERVE.md's table says: `messages` (tool calls with `function.arguments` an
object, tool results as role "tool" with an optional `tool_name`), generate's `prompt`,
`system` and `raw` (the prompt as is, no template), `tools`, `think` (true/false, or "low" /
"medium" / "high": thinking on with server/requests.py's `effort` budget), `stream` (absent:
true), `options` (num_predict, temperature, top_p, top_k, min_p, seed, stop, repeat_penalty
honoured; num_ctx accepted when it fits the served window; the rest accepted and named in
X-Pocket-Fields-Ignored), `format` (accepted and named there: decoding is not constrained
here), `keep_alive` (accepted: the one model stays loaded). Refused with a 400: `images`,
`suffix` (no fill-in-the-middle), `context` (an earlier reply's token ids). Errors are Ollama's
`{"error": "message"}` with the HTTP status. Pure data: no MLX, no engine, no HTTP.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pocket_mlx.server.jobs import Call, Done, Reasoning, Text, Whole
from pocket_mlx.server.requests import ApiError, GenRequest, Sampling, check, effort
from pocket_mlx.server.wire import (
    bool_field,
    function_tool,
    stop_list,
    type_field,
    unique_tools,
    unsupported,
)

# What GET /api/version answers: a numeric x.y.z, as clients check it (GitHub Copilot's
# Ollama provider wants 0.6.4 or later); the Ollama release whose API this server follows.
VERSION = "0.12.0"
TAG = ":latest"
_COMMON = {"model", "stream", "options", "format", "keep_alive", "think", "logprobs",
           "top_logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "tools"}
GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "system", "template", "context", "raw",
                             "images", "width", "height", "steps"}
# options honoured: Ollama's name -> Sampling's field.
SAMPLING_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repeat_penalty": "repetition_penalty", "seed": "seed"}
HONOURED_OPTIONS = set(SAMPLING_OPTIONS) | {"num_predict", "num_ctx", "stop"}
# Ollama's runner settings (threads, GPU layers, memory mapping, batch): the server's own
# command line decides those; accepted without a word, as they change no reply.
RUNNER_OPTIONS = {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
                  "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only",
                  "num_thread"}
THINK_LEVELS = ("low", "medium", "high")
ROLES = ("system", "user", "assistant", "tool")


def error_body(e: ApiError) -> dict:
    """`e` in Ollama's shape: {"error": "message"} (the status is the HTTP status)."""
    return {"error": e.message}


def base_name(name: str) -> str:
    """A model name as Ollama clients write it, without the default tag (`NAME:latest`)."""
    return name[: -len(TAG)] if name.endswith(TAG) else name


def _bad(where: str, message: str, code: str = "invalid_type") -> ApiError:
    return ApiError(400, f"{where} {message}", param=where, code=code)


# ---- requests ------------------------------------------------------------------------------

def _options(opts: Any, req: GenRequest, window: int | None) -> None:
    """`options` onto `req`: sampling, num_predict, stop; the others named in `ignored`."""
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise _bad("options", f"must be an object, got {opts!r}")
    values = {field: opts.get(name) for name, field in SAMPLING_OPTIONS.items()}
    if values["seed"] == -1:  # Ollama's "random"
        values["seed"] = None
    names = {field: f"options.{name}" for name, field in SAMPLING_OPTIONS.items()}
    req.sampling = Sampling.checked(values, names)
    n = opts.get("num_predict")
    if n is not None and n not in (-1, -2):  # -1: no cap; -2: until the window is full
        req.max_tokens = check("options.num_predict", n, "max_tokens")
    req.stop = stop_list(opts.get("stop"), "options.stop")
    ctx = opts.get("num_ctx")
    if ctx is not None:
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
            raise _bad("options.num_ctx", f"must be an integer >= 1, got {ctx!r}")
        if window is None or ctx > window:  # a larger window than this server serves
            req.ignored.append("options.num_ctx")
    req.ignored += [f"options.{k}" for k in sorted(opts) if k not in HONOURED_OPTIONS
                    and k not in RUNNER_OPTIONS and opts[k] is not None]


def _think(value: Any) -> tuple[bool | None, int | None]:
    """`think` as (thinking, reasoning budget): a bool, or a level (an effort's budget)."""
    if value is None or isinstance(value, bool):
        return value, None
    if value in THINK_LEVELS:
        return effort("think", value)
    raise _bad("think", f"must be true, false, \"low\", \"medium\" or \"high\", got {value!r}",
               code="invalid_value")


def _common(body: dict, kind: str, known: set[str], window: int | None) -> GenRequest:
    """The fields /api/chat and /api/generate share."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"is required (a model name), got {model!r}", code="missing_required")
    stream = True if body.get("stream") is None else bool_field(body, "stream")
    req = GenRequest(kind=kind, model=model, stream=stream)
    _options(body.get("options"), req, window)
    type_field(body, "format", (str, dict), '"json" or a JSON schema object')
    if body.get("format") not in (None, ""):
        req.ignored.append("format")  # replies are not constrained to JSON here
    type_field(body, "keep_alive", (str, int, float), "a duration")
    req.thinking, req.reasoning_budget = _think(body.get("think"))
    type_field(body, "logprobs", (bool,), "true or false")
    type_field(body, "top_logprobs", (int,), "an integer")
    req.ignored += [k for k in ("logprobs", "top_logprobs") if body.get(k) not in (None, False, 0)]
    req.ignored += sorted(set(body) - known)
    req.ignored = sorted(set(req.ignored))
    return req


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(where, f"must be a string, got {value!r}")
    return value


def _no_images(value: Any, where: str) -> None:
    if value not in (None, []):
        raise unsupported(where, "images (this model reads text only)")


def _tool_call(c: Any, where: str) -> dict:
    """An assistant message's tool call in Ollama's shape ({"function": {"name", "arguments":
    an object}}; an id and index are allowed) as the chat template receives it."""
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise _bad(where, 'must be {"function": {"name": ..., "arguments": {...}}}',
                   code="invalid_value")
    f = c["function"]
    name = f.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.function.name", "must be a non-empty string", code="invalid_value")
    args = f.get("arguments", {})
    if isinstance(args, str):  # OpenAI's habit, from a client that mixes the two
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise _bad(f"{where}.function.arguments", "is not valid JSON",
                       code="invalid_value") from None
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments", "must be an object", code="invalid_value")
    call_id = c.get("id")
    return {"id": call_id if isinstance(call_id, str) else "", "type": "function",
            "function": {"name": name, "arguments": args}}


def _message(m: Any, where: str) -> dict:
    """One message as the chat template receives it. An assistant's `thinking` (an earlier
    reply's reasoning, as clients send it back) goes to the template as `reasoning_content`,
    as OpenAI's does: a thinking template shows it where it belongs (the current turn's tool
    calls) and drops it from earlier turns itself."""
    if not isinstance(m, dict):
        raise _bad(where, "must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}",
                   code="invalid_value")
    _no_images(m.get("images"), f"{where}.images")
    out: dict = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    calls = m.get("tool_calls")
    if calls not in (None, []):
        if role != "assistant" or not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls", "must be a list, on an assistant message")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]")
                             for i, c in enumerate(calls)]
    thought = _text(m.get("thinking"), f"{where}.thinking")
    if role == "assistant" and thought:
        out["reasoning_content"] = thought
    if role == "tool":
        name = m.get("tool_name", m.get("name"))
        out["tool_call_id"] = ""
        if name is not None:
            out["name"] = _text(name, f"{where}.tool_name")
    return out


def _tools(raw: Any) -> list[dict] | None:
    """`tools` in Ollama's (OpenAI's) shape: [{"type": "function", "function": {...}}]."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools", "must be a list")
    tools = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise _bad(where, 'must be {"type": "function", "function": {...}}',
                       code="invalid_value")
        if t.get("type", "function") != "function":
            raise unsupported(where, f"tools of type {t.get('type')!r} (function tools only)")
        f = t["function"]
        tools.append(function_tool(f.get("name"), f.get("description"),
                                   _schema_order(f.get("parameters")), f"{where}.function"))
    return unique_tools(tools)


def _schema_order(params: Any) -> Any:
    """A function's parameters with "type", "properties", "required" first, in the order
    JSON Schemas are written and OpenAI's clients send them. Why: the `ollama` clients' models
    reorder them ("required" before "properties"), and a template shows the model the text
    as given; the order means nothing to JSON, so the model reads them as it was trained to,
    and the same tools make the same prompt from either API."""
    if not isinstance(params, dict):
        return params
    first = [k for k in ("type", "properties", "required") if k in params]
    return {k: params[k] for k in first + [k for k in params if k not in first]}


def parse_chat(body: dict, window: int | None = None) -> GenRequest:
    """An /api/chat body, checked; `window`: the served context (options.num_ctx past it is
    named ignored). No messages (or an empty list) is Ollama's "load the model" request:
    `messages` is then []."""
    req = _common(body, "chat", CHAT_FIELDS, window)
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise _bad("messages", "must be a list of messages")
    req.messages = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    req.tools = _tools(body.get("tools"))
    req.tool_choice = "auto" if req.tools else "none"
    return req


def parse_generate(body: dict, window: int | None = None) -> GenRequest:
    """An /api/generate body, checked: `prompt` (with `system`) rendered by the chat template
    as one user turn, or with `raw` the prompt as is (a completion). An absent or empty prompt
    is Ollama's "load the model" request: `messages` is then [] (and `prompt` None)."""
    req = _common(body, "chat", GENERATE_FIELDS, window)
    _no_images(body.get("images"), "images")
    if _text(body.get("suffix"), "suffix"):
        raise unsupported("suffix", "no fill-in-the-middle")
    if body.get("context") not in (None, []):
        raise unsupported("context", "token ids of an earlier reply are not taken back; send "
                                     "the conversation as /api/chat messages")
    prompt = _text(body.get("prompt"), "prompt")
    system = _text(body.get("system"), "system")
    if _text(body.get("template"), "template"):
        req.ignored = sorted(set(req.ignored) | {"template"})  # the model's own template
    raw = bool_field(body, "raw")
    if not prompt:
        req.messages = []
        return req
    if raw:
        req.kind, req.prompt = "completion", prompt
        if system:
            req.ignored = sorted(set(req.ignored) | {"system"})  # raw: no template to put it in
        return req
    req.messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return req


# ---- replies -------------------------------------------------------------------------------

def created_at() -> str:
    """Ollama's timestamps: RFC 3339 in UTC with fractional seconds."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def done_reason(engine_reason: str | None) -> str:
    """The engine's reason (eos, stop, length, context, cancelled) as Ollama's."""
    return "length" if engine_reason in ("length", "context") else "stop"


def tool_call_json(call, index: int) -> dict:
    """A `ToolCall` (server/tools.py) in Ollama's shape: arguments as an object."""
    return {"id": call.id, "function": {"index": index, "name": call.name,
                                        "arguments": call.arguments}}


def ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


@dataclass
class Timings:
    """A reply's durations in seconds, measured: `total` from the request's arrival to its
    end, `start` from arrival until the job began on the model's thread (tokenizing and
    waiting for a slot: what Ollama calls load_duration), `prompt` from the job's start to
    its first reply text (the prompt's evaluation and the first token), `decode` the rest."""

    total: float
    start: float
    prompt: float
    decode: float

    @classmethod
    def of(cls, t0: float, done: Done) -> Timings:
        """From the request's arrival `t0` (time.perf_counter) and the job's `Done`."""
        total = time.perf_counter() - t0
        ran = done.seconds if done.seconds is not None else total
        first = done.first_s if done.first_s is not None else ran
        return cls(total, max(0.0, total - ran), first, max(0.0, ran - first))

    def fields(self, done: Done) -> dict:
        return {"done_reason": done_reason(done.finish_reason),
                "total_duration": ns(self.total), "load_duration": ns(self.start),
                "prompt_eval_count": done.prompt_tokens,
                "prompt_eval_duration": ns(self.prompt),
                "eval_count": done.completion_tokens, "eval_duration": ns(self.decode)}


class Reply:
    """The chunks and whole objects of one /api/chat or /api/generate reply (`chat`: which);
    `model`: the name as the client wrote it (Ollama echoes it)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model

    def _obj(self, text: str = "", thinking: str = "", calls: list | None = None,
             done: bool = False) -> dict:
        out: dict = {"model": self.model, "created_at": created_at()}
        if self.chat:
            msg: dict = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            out["message"] = msg
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    def chunk(self, ev: Reasoning | Text | Call) -> dict:
        """One streamed part."""
        if isinstance(ev, Reasoning):
            return self._obj(thinking=ev.text)
        if isinstance(ev, Call):
            return self._obj(calls=[tool_call_json(ev.call, ev.index)])
        return self._obj(ev.text)

    def final(self, done: Done, timings: Timings) -> dict:
        """The stream's last line: done, why, and the measured counts and durations."""
        return {**self._obj(done=True), **timings.fields(done)}

    def whole(self, whole: Whole, timings: Timings) -> dict:
        """A `stream: false` reply."""
        calls = [tool_call_json(c, i) for i, c in enumerate(whole.calls)]
        return {**self._obj(whole.text, whole.reasoning, calls, done=True),
                **timings.fields(whole.done)}

    def loaded(self, unload: bool) -> dict:
        """The answer to a request without a prompt (Ollama's way to load or unload a
        model): nothing generated; the model stays loaded here either way."""
        return {**self._obj(done=True), "done_reason": "unload" if unload else "load"}


def line(obj: dict) -> str:
    """One NDJSON line."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


# ---- the model ------------------------------------------------------------------------------

def human_count(n: int) -> str:
    """A parameter count as Ollama writes it: 7.6B, 494.0M, 12.3K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def digest(name: str, about: dict) -> str:
    """A stable sha256 for the served build (Ollama's is its manifest's)."""
    key = json.dumps([name, about.get("family"), about.get("parameters"), about.get("bytes"),
                      about.get("quantization")])
    return hashlib.sha256(key.encode()).hexdigest()


def details(about: dict) -> dict:
    family = str(about.get("family") or "")
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family] if family else [],
            "parameter_size": human_count(int(about.get("parameters") or 0)),
            "quantization_level": str(about.get("quantization") or "")}


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def model_entry(name: str, about: dict, created: float) -> dict:
    """One model of /api/tags (modified: its config.json's time, else the server's start)."""
    return {"name": name + TAG, "model": name + TAG,
            "modified_at": iso(about.get("modified") or created),
            "size": int(about.get("bytes") or 0), "digest": digest(name, about),
            "details": details(about)}


def running_entry(name: str, about: dict, created: float, context: int, device: str) -> dict:
    """One model of /api/ps: loaded until the server stops."""
    size = int(about.get("bytes") or 0)
    return {**model_entry(name, about, created), "expires_at": "9999-12-31T23:59:59Z",
            "size_vram": size if device == "gpu" else 0, "context_length": context}


def show(about: dict, created: float, context: int, template: str, capabilities: list[str],
         ) -> dict:
    """/api/show: details, model_info (the architecture's context length: the served
    window; the parameter count), the capabilities and the chat template (a Jinja template,
    not Ollama's Go template: shown for reading)."""
    arch = str(about.get("family") or "unknown")
    info = {"general.architecture": arch, "general.basename": about.get("name", ""),
            "general.parameter_count": int(about.get("parameters") or 0),
            f"{arch}.context_length": context}
    if about.get("hidden_size"):
        info[f"{arch}.embedding_length"] = about["hidden_size"]
    return {"license": "", "modelfile": f"# served by pocket-mlx\nFROM {about.get('path', '')}\n",
            "parameters": "", "template": template, "details": details(about),
            "model_info": info, "capabilities": capabilities,
            "modified_at": iso(about.get("modified") or created)}


def managed_elsewhere(path: str, served: str) -> ApiError:
    """/api/pull, /api/push, /api/create, /api/copy, /api/delete: models are not managed
    through this server (501: the endpoint exists in Ollama's API, not here)."""
    return ApiError(501, f"{path} is not available: this server serves the one model it was "
                         f"started with ({served!r}); to serve another, restart "
                         "`pocket-mlx serve --model ...`", code="not_implemented")
