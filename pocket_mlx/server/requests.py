"""A checked request and a refusal, the two types every part of the server shares.

Why a module of their own: the OpenAI and Anthropic parsers make the same `GenRequest`, the
engine and the tool-call code read it, and any of them may refuse with an `ApiError`; none of
those should import another API's wire format to get them. No Starlette and no MLX here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


@dataclass
class GenRequest:
    """One checked generation request, independent of the endpoint it came from."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None = None  # completion: text (no template) or token ids
    max_tokens: int | None = None  # None: the server's default
    sampling: dict = field(default_factory=dict)  # SamplingParams keywords
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    # Tools (chat only): OpenAI-shaped function definitions, as the chat template receives
    # them; tool_choice is auto | none | required | function (then tool_name names it).
    tools: list[dict] | None = None
    tool_choice: str = "none"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    # Set when the prompt is rendered (server/tools.py `render_chat`): the model's tool-call
    # format (None: replies are plain text) and the text the reply is forced to start with.
    tool_format: Any = None
    reply_prefix: str = ""
    # Set by `render_chat` when the template renders no tools and tool_choice was auto: the
    # tools were left out of the prompt (the reply says so in X-Pocket-Tools-Omitted).
    tools_omitted: bool = False
    # Set when the prompt is encoded (server/tools.py `message_boundaries`): prompt positions
    # at the end of an earlier message, where prefill stores a reusable snapshot.
    boundaries: list[int] = field(default_factory=list)
    # Fields left out because this server or model lacks the feature (server/openai.py's
    # docstring): named in the reply's X-Pocket-Fields-Ignored header and the log.
    ignored: list[str] = field(default_factory=list)
