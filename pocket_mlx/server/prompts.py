"""A request's prompt: rendered by the model's chat template (tools, forced tool calls,
the reasoning switch), encoded to token ids and checked, with the message boundaries where
prefill keeps reusable snapshots. All of it runs off the model's thread (it only reads the
tokenizer), and these are the 400s a prompt can earn before it is queued.
"""

from __future__ import annotations

import functools

from pocket_mlx.engine import snapshot_points
from pocket_mlx.engine.reasoning import thinking_for, thinking_kwargs
from pocket_mlx.errors import PocketError
from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.server.tools import format_for


def encode_request(tok, request: GenRequest, context: int, vocab: int) -> list[int]:
    """The prompt's token ids (chat template for chat, plain text or ids for completions);
    a prompt that leaves no room in a `context`-token window is a 400, as is an id not
    below `vocab`."""
    try:
        if request.kind == "chat":
            for m in request.messages or []:
                _utf8(m["content"], "messages")
            ids = tok.encode(render_chat(tok, request), add_special_tokens=False)
            # Computed with the cache off too: prefill chunks end at these points, and the
            # same chunks with and without the cache give bit-identical states (a chunk
            # split elsewhere rounds differently, and can change a greedy reply).
            request.boundaries = message_boundaries(tok, request, ids)
        elif isinstance(request.prompt, str):
            ids = tok.encode(_utf8(request.prompt, "prompt"))
        else:
            ids = list(request.prompt or [])
            # Both bounds: an id past the model's embedding table would read out of it.
            if any(t >= vocab for t in ids):
                raise ApiError(400, f"prompt: token ids must be below the vocabulary size "
                                    f"{vocab}", param="prompt", code="invalid_value")
    except PocketError as e:  # the chat template refused the conversation
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    if not ids:
        raise ApiError(400, "the prompt is empty after tokenization", code="invalid_value")
    if len(ids) >= context:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is "
                            f"{context} tokens, and the reply needs at least one: "
                            "shorten the prompt", code="context_length_exceeded")
    return ids


def _utf8(text: str, where: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate, which is not "
                            "valid Unicode", param=where, code="invalid_value") from None
    return text


def render_chat(tok, req: GenRequest) -> str:
    """The chat prompt of `req`, tools included, as the model's template renders it; records
    on `req` the model's tool-call format (when its tools are on) and, for tool_choice
    required or a named function, the text the reply is made to start with (the format's
    start marker, and the name where the format's next words are known), rendered with
    `enable_thinking=False` so that a thinking model's call is not left inside its
    reasoning. Only the named function is shown to the model in that case. Constrained
    decoding it is not: the model chooses the arguments, and may still write nonsense."""
    req.messages = fit_system_messages(tok, req.messages or [])
    tools_on = bool(req.tools) and req.tool_choice != "none"
    history = any("tool_calls" in m or m["role"] == "tool" for m in req.messages or [])
    fmt = None
    if tools_on or history:
        what = "tools" if tools_on else "messages"
        try:
            fmt = format_for(tok.chat_template)
        except ImportError as e:
            raise ApiError(500, f"mlx-lm's tool-call parser could not be loaded ({e}); "
                                "reinstall mlx-lm", type="server_error",
                           code="internal_error") from None
        if fmt is None and tools_on and req.tool_choice == "auto" and not history:
            # Clients such as Open WebUI send their built-in tools with every message, without
            # tool_choice: the model may answer without them, so it does (said in a header and
            # the log) rather than refusing every message. "required" or a named function
            # cannot be honoured without them: those keep the 400 below.
            req.tools_omitted, tools_on = True, False
        elif fmt is None:
            raise ApiError(400, f"{what}: this model's chat template has no tool-call format "
                                "(it does not render tools and tool calls), so this model "
                                "cannot use tools", param=what, code="unsupported_parameter")
    tools = None
    if tools_on:
        tools = [t for t in req.tools or []
                 if req.tool_name is None or t["function"]["name"] == req.tool_name]
        req.tool_format = fmt
        if req.tool_choice in ("required", "function"):
            req.reply_prefix = fmt.forced_prefix(req.tool_name)
    text = tok.apply_chat_template(req.messages, tools=tools, **template_keywords(tok, req))
    text += req.reply_prefix
    # Whether the engine parses the reply for a reasoning block, and starts inside one.
    req.reasoning_open = thinking_for(tok.chat_template, text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "messages: the text holds a lone UTF-16 surrogate, which is not "
                            "valid Unicode", param="messages", code="invalid_value") from None
    return text


def message_boundaries(tok, req: GenRequest, ids: list[int]) -> list[int]:
    """Token positions inside `ids` (the rendered prompt of `req`) where an earlier message
    ends (engine/snapshot_points.py), rendered with the tools the prompt itself carries."""
    tools_on = bool(req.tools) and req.tool_choice != "none" and not req.tools_omitted
    tools = [t for t in req.tools or []
             if req.tool_name is None or t["function"]["name"] == req.tool_name] \
        if tools_on else None
    # The next turn of the conversation shares this prompt up to the end of its last message
    # for sure, but not always further: a thinking model's template drops the reasoning of
    # earlier turns, a template renders the reply's tool calls in its own words, a client
    # trims the reply, or the model wrote a token sequence that the reply's text does not
    # encode back to (a sampled reply can). So a snapshot there too, whatever the template.
    return snapshot_points.message_boundaries(tok, req.messages or [], ids, tools=tools,
                                              through_last=True,
                                              **template_keywords(tok, req))


def template_keywords(tok, req: GenRequest) -> dict:
    """The chat template's keywords besides messages and tools: thinking off for a forced tool
    call (its call must not be left inside the model's reasoning), else the request's
    reasoning switch (engine/reasoning.py `thinking_kwargs`; none for the template's own
    default)."""
    if req.reply_prefix:
        return {"enable_thinking": False}
    return thinking_kwargs(tok.chat_template, req.thinking)


def fit_system_messages(tok, messages: list[dict]) -> list[dict]:
    """`messages` with their `system` messages after the first laid out as the chat template
    can render them. Clients put system text mid-conversation: Claude Code's environment
    block (its folder, platform, tools to search, skills) follows the user's first message.
    The system messages of the conversation's opening (before the model's first turn) are
    joined, in order, into one system prompt at the top: that is where templates put
    instructions, and it makes what every session in a folder shares (system prompt, tools,
    environment) one prefix of the prompt that the prompt cache reuses, the user's question
    after it. A later one (a reminder between turns) stays where it stands when the template
    renders a system message there, else becomes a user message in its place, its text as
    sent (Qwen3.5's template refuses a system message that is not first, others drop it
    unseen): either way the prompt before it is the previous request's, reused from the
    cache."""
    if not any(m["role"] == "system" for m in messages[1:]):
        return messages
    opening = next((i for i, m in enumerate(messages) if m["role"] in ("assistant", "tool")),
                   len(messages))
    head = [m["content"] for m in messages[:opening] if m["role"] == "system"]
    out = [{"role": "system", "content": "\n\n".join(head)}] if head else []
    out += [m for m in messages[:opening] if m["role"] != "system"]
    late = renders_late_system(tok)
    out += [m if m["role"] != "system" or late else {**m, "role": "user"}
            for m in messages[opening:]]
    return out


def renders_late_system(tok) -> bool:
    """Whether the chat template renders a system message after a user turn, where it
    stands (tried once per template)."""
    return _renders_late_system(tok.chat_template, tok)


@functools.lru_cache(maxsize=8)
def _renders_late_system(template: str | None, tok) -> bool:
    probe = "pocket-mlx: a system message after a user turn"
    try:
        text = tok.apply_chat_template([{"role": "system", "content": "s"},
                                        {"role": "user", "content": "u"},
                                        {"role": "system", "content": probe},
                                        {"role": "user", "content": "v"}])
    except PocketError:
        return False
    return probe in text
