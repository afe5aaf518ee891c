"""Tool calls: which format a model's chat template uses, mlx-lm's parser for it, and the
splitter that turns a reply's text into plain text and `ToolCall`s as it streams.

Where the formats come from: mlx-lm ships one parser per model family (`mlx_lm/tool_parsers`,
each a module with `tool_call_start`, `tool_call_end` and `parse_tool_call(text, tools)`) and
picks one by looking at the chat template (`mlx_lm.tokenizer_utils._infer_tool_parser`). We use
those very parser files. But importing anything under `mlx_lm` runs `mlx_lm/__init__`, which
imports transformers (~2 s, hundreds of MB) and makes a generation stream; so `parser_module`
loads the parser files as submodules of a private package whose path is mlx-lm's
`tool_parsers/` folder: the same code, without the package's side effects. The template test
below mirrors `_infer_tool_parser`'s order (its vocabulary fallback is left out: our tokenizer
has no `get_vocab`, and the two formats found only that way have no template marker to render).

The same `ToolFormat` serves OpenAI's `tool_calls` and Anthropic's `tool_use` blocks; this
module holds no HTTP shapes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import json
import sys
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pocket_mlx.server.requests import GenRequest

# (marker test on the template, mlx-lm parser module), in `_infer_tool_parser`'s order.
_FORMATS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<minimax:tool_call>",), "minimax_m2"),
    (("<|tool_call>", "<tool_call|>"), "gemma4"),
    (("<start_function_call>",), "function_gemma"),
    (("<longcat_tool_call>",), "longcat"),
    (("<arg_key>",), "glm47"),
    (("<|tool_list_start|>",), "pythonic"),
    (("<|tool_call_start|>",), "pythonic"),
    (("<tool_call>\\n<function=",), "qwen3_coder"),
    (("<tool_call>\n<function=",), "qwen3_coder"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (('<function name="', '<param name="'), "minicpm5"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<atem:function_calls>",), "muse_spark"),
    (("<tool_call>", "tool_call.name"), "json_tools"),
)
_PACKAGE = "pocket_mlx._mlx_lm_tool_parsers"


def detect_format(template: str | None) -> str | None:
    """The mlx-lm parser name for a chat template's tool-call format, or None."""
    if not isinstance(template, str):
        return None
    for markers, name in _FORMATS:
        if all(m in template for m in markers):
            return name
    return None


def parser_module(name: str) -> ModuleType:
    """mlx-lm's `tool_parsers/<name>.py`, loaded without running `mlx_lm/__init__` (see the
    module's docstring). Raises ImportError when mlx-lm or that parser is missing."""
    pkg = sys.modules.get(_PACKAGE)
    if pkg is None:
        spec = importlib.util.find_spec("mlx_lm")  # finds the folder; imports nothing
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mlx-lm is not installed")
        folder = [f"{p}/tool_parsers" for p in spec.submodule_search_locations]
        pkg_spec = importlib.machinery.ModuleSpec(_PACKAGE, None, is_package=True)
        pkg_spec.submodule_search_locations = folder
        pkg = importlib.util.module_from_spec(pkg_spec)
        sys.modules[_PACKAGE] = pkg
    return importlib.import_module(f"{_PACKAGE}.{name}")


@dataclass
class ToolCall:
    """One call the model made: the function's name and its arguments (JSON values)."""

    name: str
    arguments: Any
    id: str = ""

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolFormat:
    """A model's tool-call format: its markers and mlx-lm's parser for the text between them."""

    def __init__(self, name: str) -> None:
        mod = parser_module(name)
        self.name = name
        self.start: str = mod.tool_call_start
        self.end: str = mod.tool_call_end or ""
        self._parse = mod.parse_tool_call

    def parse(self, text: str, tools: list[dict] | None) -> list[ToolCall]:
        """The calls in the text between one start and end marker; ValueError if it is not
        one (the model wrote something else, or was cut off)."""
        try:
            got = self._parse(text, tools)
        except (ValueError, KeyError, TypeError, SyntaxError, IndexError) as e:
            raise ValueError(f"{type(e).__name__}: {e}") from None
        calls = []
        for c in got if isinstance(got, list) else [got]:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                raise ValueError(f"parser gave {c!r}, not a call with a name")
            args = c.get("arguments", {})
            if isinstance(args, str):  # some formats hand back the JSON text
                try:
                    args = json.loads(args)
                except ValueError:
                    raise ValueError(f"arguments are not JSON: {args[:80]!r}") from None
            calls.append(ToolCall(c["name"], args))
        return calls

    def forced_prefix(self, name: str | None) -> str:
        """Text that starts the reply when a call is required (`name`: that function): the
        start marker, and for the formats whose next words we know, the function's name."""
        if name is not None and self.name == "qwen3_coder":
            return f"{self.start}\n<function={name}>\n"
        if name is not None and self.name == "json_tools":
            return f'{self.start}\n{{"name": {json.dumps(name)}, "arguments": '
        return self.start


@functools.lru_cache(maxsize=4)
def format_for(template: str | None) -> ToolFormat | None:
    """The `ToolFormat` of a chat template, or None when it shows no format we know."""
    name = detect_format(template)
    return ToolFormat(name) if name is not None else None


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class CallSplitter:
    """Splits a reply, piece by piece as it streams, into text and `ToolCall`s.

    Text that could still become a start marker ("<tool" of "<tool_call>") is held back until
    the next piece decides it, so a client never sees half a marker. Whitespace next to a call
    (the template puts "\\n\\n" between text and a call) is held too and dropped when a call
    follows or the reply ends after calls. A call the parser cannot read is given back as the
    text it was (markers included), never dropped; `failed` lists why."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None, id_prefix: str,
                 prefix: str = "", limit: int | None = None) -> None:
        self.fmt, self.tools, self.id_prefix, self.limit = fmt, tools, id_prefix, limit
        self.dropped = 0  # calls past `limit` (parallel_tool_calls false)
        self.pending = ""  # text not yet handed out
        self.in_call = False
        self.calls: list[ToolCall] = []
        self.failed: list[str] = []
        self._forced = prefix  # the reply's forced start (tool_choice), fed first
        self._fed = False

    def _held(self, text: str) -> int:
        """How many characters at the end of `text` to hold back."""
        n = 0
        for k in range(min(len(self.fmt.start) - 1, len(text)), 0, -1):
            if self.fmt.start.startswith(text[-k:]):
                n = k
                break
        rest = text[:len(text) - n]
        return n + (len(rest) - len(rest.rstrip()))

    def feed(self, text: str) -> list[str | ToolCall]:
        if not self._fed:
            self._fed = True
            text = self._forced + text
        self.pending += text
        out: list[str | ToolCall] = []
        while True:
            if not self.in_call:
                i = self.pending.find(self.fmt.start)
                if i < 0:
                    keep = self._held(self.pending)
                    emit = self.pending[:len(self.pending) - keep]  # ends in non-space
                    if emit:
                        out.append(emit)
                        self.pending = self.pending[len(emit):]
                    return out
                before = self.pending[:i]
                if before.strip():
                    out.append(before.rstrip())
                self.pending = self.pending[i + len(self.fmt.start):]
                self.in_call = True
            if not self.fmt.end:  # the call runs to the end of the reply
                return out
            j = self.pending.find(self.fmt.end)
            if j < 0:
                return out
            body = self.pending[:j]
            self.pending = self.pending[j + len(self.fmt.end):].lstrip()
            self.in_call = False
            out += self._calls(body)

    def _calls(self, body: str) -> list[str | ToolCall]:
        try:
            calls = self.fmt.parse(body, self.tools)
        except ValueError as e:
            self.failed.append(str(e))
            return [f"{self.fmt.start}{body}{self.fmt.end}"]
        if self.limit is not None:
            room = max(0, self.limit - len(self.calls))
            self.dropped += max(0, len(calls) - room)
            calls = calls[:room]
        for c in calls:
            c.id = new_call_id(self.id_prefix)
        self.calls += calls
        return list(calls)

    def close(self) -> list[str | ToolCall]:
        """What is left when the reply ends: held text, or an unfinished call (parsed if it
        reads as one: a reply cut right before its end marker still made its call)."""
        if not self._fed:
            self.feed("")
        out: list[str | ToolCall] = []
        if self.in_call:
            body, self.pending, self.in_call = self.pending, "", False
            got = self._calls(body)
            if got and isinstance(got[0], str):  # unreadable: the text without a made-up end
                got = [f"{self.fmt.start}{body}"]
            out += got
        elif self.pending and (self.pending.strip() or not self.calls):
            out.append(self.pending)
        self.pending = ""
        return out


def splitter_for(req: GenRequest, id_prefix: str) -> CallSplitter | None:
    """The reply splitter of a rendered request whose tools are on, else None."""
    if req.tool_format is None:
        return None
    return CallSplitter(req.tool_format, req.tools, id_prefix, prefix=req.reply_prefix,
                        limit=None if req.parallel_tool_calls else 1)
