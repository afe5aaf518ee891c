"""A request's prompt as token ids, checked: what the server can tokenize off the engine
thread (it only reads the tokenizer), and the 400s a prompt can earn before it is queued.
"""

from __future__ import annotations

from pocket_mlx.errors import PocketError
from pocket_mlx.server.requests import ApiError, GenRequest
from pocket_mlx.server.tools import message_boundaries, render_chat


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
