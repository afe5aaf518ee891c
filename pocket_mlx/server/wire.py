"""What every wire format's parser needs alike: typed fields with their 400s, the sampling
fields, stop strings, and function definitions in the shape chat templates receive.

Why a module of their own: OpenAI's, Anthropic's and the other wire formats check the same
values the same way; none of them should import another to get these. Pure data: no MLX, no
engine, no HTTP.
"""

from __future__ import annotations

import re
from typing import Any

from pocket_mlx.server.requests import ApiError, Sampling, check

MAX_STOPS = 16
# A function's name: what OpenAI allows (letters, digits, _ and -, up to 64), plus the . and :
# some clients' namespaced tools use (MCP servers: "server.tool").
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


def unsupported(name: str, why: str) -> ApiError:
    return ApiError(400, f"{name} is not supported by this server: {why}", param=name,
                    code="unsupported_parameter")


def bool_field(body: dict, name: str) -> bool:
    """`body[name]` as a bool (absent or null: False); a 400 for any other type."""
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false, got {v!r}", param=name,
                       code="invalid_type")
    return v


def type_field(body: dict, name: str, kinds: tuple, what: str) -> None:
    """A 400 for a value of the wrong type, even in a field that is then ignored."""
    v = body.get(name)
    if v is not None and (not isinstance(v, kinds) or (isinstance(v, bool)
                                                       and bool not in kinds)):
        raise ApiError(400, f"{name} must be {what}, got {v!r}", param=name,
                       code="invalid_type")


def sampling(body: dict, names: dict[str, str] | None = None) -> Sampling:
    """The sampling fields of a body (`names`: field -> the body's key where it differs),
    checked with engine/params.py's ranges; temperature defaults to 1, as OpenAI's and
    Anthropic's APIs do."""
    names = names or {}
    return Sampling.checked({f: body.get(names.get(f, f)) for f in SAMPLING_FIELDS}, names)


def stop_list(value: Any, name: str) -> list[str]:
    """Stop strings: a string or a list of non-empty strings, at most `MAX_STOPS`."""
    if value is None:
        stops = []
    elif isinstance(value, str):
        stops = [value]
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        stops = list(value)
    else:
        raise ApiError(400, f"{name} must be a string or a list of strings", param=name,
                       code="invalid_type")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"{name}: at most {MAX_STOPS} stop strings", param=name,
                       code="invalid_value")
    if any(s == "" for s in stops):
        raise ApiError(400, f"{name}: an empty stop string would match everywhere", param=name,
                       code="invalid_value")
    return stops


def max_tokens(body: dict, name: str = "max_tokens") -> int | None:
    return check(name, body.get(name), "max_tokens")


def function_tool(name, description, parameters, where: str) -> dict:
    """One function definition, checked, in the shape chat templates receive (transformers'
    OpenAI shape, keys in this order: the order they are rendered in)."""
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise ApiError(400, f"{where}: the name must be 1-128 letters, digits, _, -, . or :, "
                            f"got {name!r}", param=where, code="invalid_value")
    fn: dict = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise ApiError(400, f"{where}: description must be a string", param=where,
                           code="invalid_type")
        fn["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise ApiError(400, f"{where}: parameters must be a JSON Schema object",
                           param=where, code="invalid_type")
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def unique_tools(tools: list[dict], what: str = "function") -> list[dict] | None:
    """`tools` (None when empty), or a 400 naming a function defined twice."""
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ApiError(400, f"tools: the {what} {dup!r} is defined twice", param="tools",
                       code="invalid_value")
    return tools or None


def choice_target(choice: str, name: str | None, tools: list[dict] | None, label: str,
                  what: str = "function") -> None:
    """The 400s of a tool_choice that needs tools (`label`: its wire name), or names a
    `what` (function, tool) not among them."""
    if choice in ("required", "function") and not tools:
        raise ApiError(400, f"tool_choice {label!r} needs tools", param="tool_choice",
                       code="invalid_value")
    if name is not None and name not in [t["function"]["name"] for t in tools or []]:
        raise ApiError(400, f"tool_choice names the {what} {name!r}, which is not in tools",
                       param="tool_choice", code="invalid_value")
