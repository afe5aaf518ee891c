"""The server's one request model: what every wire format (OpenAI chat and completions,
Anthropic Messages, and those to come) parses a body into, and the refusal they share.

Why typed and checked here: a request is validated once, where its wire format is parsed
(`Sampling.checked`, `check`), so the serve worker and the prompt code read values they can
trust and never re-check them; and no wire format imports another to get them. The value
ranges are engine/params.py's `check_*` functions (pure Python, no MLX), the same sentences the
CLI prints. No Starlette and no MLX here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pocket_mlx.engine import params


class ApiError(Exception):
    """A request the server refuses: HTTP status plus OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# A checked value's range, by the name of what it is (engine/params.py's sentences).
CHECKS: dict[str, Callable[[Any], Any]] = {
    "temperature": params.check_temperature,
    "top_p": params.check_top_p,
    "top_k": params.check_top_k,
    "min_p": params.check_min_p,
    "repetition_penalty": params.check_repetition_penalty,
    "seed": params.check_seed,
    "max_tokens": params.check_max_tokens,
}


def check(param: str, value: Any, kind: str | None = None) -> Any:
    """`value` checked as a `kind` (default: `param`) value, None when absent; a 400 naming
    the wire format's `param` otherwise."""
    if value is None:
        return None
    try:
        return CHECKS[kind or param](value)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; defaults as OpenAI's and Anthropic's (temperature 1) and
    the engine's (the rest off). Made only through `checked`, so every value is in range."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # The fields the request set: the others take serve's defaults (`under`).
    given: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def checked(cls, values: dict[str, Any], names: dict[str, str] | None = None) -> Sampling:
        """From `values` (field -> wire value; None: the default), each checked; `names`:
        the wire format's name of a field, for the 400 (default: the field's own)."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"Sampling has no field {sorted(unknown)[0]!r}")
        names = names or {}
        got = {k: check(names.get(k, k), v, k) for k, v in values.items()}
        kept = {k: v for k, v in got.items() if v is not None}
        return cls(**kept, given=frozenset(kept))

    def under(self, defaults: dict[str, Any]) -> Sampling:
        """This request's sampling over serve's defaults (`serve --temp ...`, checked when
        serve started): what the request set wins, as llama.cpp's server does."""
        return replace(self, **{k: v for k, v in defaults.items() if k not in self.given})

    def keywords(self) -> dict[str, Any]:
        """As engine/generation.py's `SamplingParams` keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "given"}


# Reasoning effort (OpenAI's `reasoning_effort`, the Responses API's `reasoning.effort`,
# Ollama's `think` levels) as the reasoning switch and budget in tokens (None: no cap).
EFFORTS: dict[str, tuple[bool, int | None]] = {
    "none": (False, None), "minimal": (True, 128), "low": (True, 512),
    "medium": (True, 2048), "high": (True, None), "xhigh": (True, None)}


def effort(param: str, value: Any) -> tuple[bool, int | None]:
    """A reasoning effort's (thinking, budget); a 400 naming `param` for an unknown one."""
    if value not in EFFORTS:
        raise ApiError(400, f"{param} must be one of {', '.join(EFFORTS)}, got {value!r}",
                       param=param, code="invalid_value")
    return EFFORTS[value]


@dataclass
class GenRequest:
    """One checked generation request, independent of the wire format it came in."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None = None  # completion: text (no template) or token ids
    max_tokens: int | None = None  # None: the server's default
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    # Reasoning switches (thinking models): `thinking` None leaves it to the server's
    # --reasoning and the template's default; `reasoning_budget` caps the reasoning's tokens
    # (None: the server's --reasoning-budget, else no cap).
    thinking: bool | None = None
    reasoning_budget: int | None = None
    # Set when the prompt is rendered (server/prompts.py): whether the reply is parsed for a
    # reasoning block (None: the template knows none) and begins inside one (True: Qwen3.5).
    reasoning_open: bool | None = None
    # Tools (chat only): OpenAI-shaped function definitions, as the chat template receives
    # them; tool_choice is auto | none | required | function (then tool_name names it).
    tools: list[dict] | None = None
    tool_choice: str = "none"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    # Set when the prompt is rendered (server/prompts.py `render_chat`): the model's tool-call
    # format (None: replies are plain text) and the text the reply is forced to start with.
    tool_format: Any = None
    reply_prefix: str = ""
    # Set by `render_chat` when the template renders no tools and tool_choice was auto: the
    # tools were left out of the prompt (the reply says so in X-Pocket-Tools-Omitted).
    tools_omitted: bool = False
    # Set when the prompt is encoded (server/prompts.py): prompt positions at the end of an
    # earlier message, where prefill stores a reusable snapshot.
    boundaries: list[int] = field(default_factory=list)
    # Fields left out because this server or model lacks the feature (server/openai.py's
    # docstring): named in the reply's X-Pocket-Fields-Ignored header and the log.
    ignored: list[str] = field(default_factory=list)
