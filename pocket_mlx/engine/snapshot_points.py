"""Where a prefill stops a chunk to store a prompt-cache snapshot, for `serve` and `chat` alike.

Why one home: a snapshot is reusable only if a later prompt that shares the prefix is split
at the same positions (the chunked Gated DeltaNet kernel gives the same state however a prompt
is split into pieces of 16+ tokens, not for shorter ones), so both front ends must choose the
points, and the chunks between them, the same way: the chat template's message boundaries
(after the system message and tools, after each earlier turn) and every SNAPSHOT_INTERVAL
tokens, chunks of the prefill step restarting at each point (`chunk_size`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pocket_mlx.engine.prompt_cache import SNAPSHOT_INTERVAL
from pocket_mlx.errors import PocketError
from pocket_mlx.models.qwen3_5_moe import CHUNKED_MIN_TOKENS

#: At most this many message boundaries per prompt (the first and the latest): each costs a
#: render and an encode of the messages before it.
MAX_BOUNDARIES = 32


def message_boundaries(tok, msgs: list[dict], ids: list[int], *, through_last: bool = False,
                       **template) -> list[int]:
    """Token positions inside `ids` (the rendered prompt of `msgs`) where an earlier message
    ends (with `through_last`, where the last one ends too, before the generation prompt: a
    thinking model's next turn renders this reply without its reasoning, so it shares the
    prompt only up to there). Why: a snapshot there is reusable by another conversation with the same system
    prompt, or by the same history resent with a new last message. Each prefix of the messages
    is rendered (with `template`'s keywords, e.g. the tools) without the generation prompt and
    kept only where its tokens are a true token prefix of `ids` (a template that renders
    earlier turns differently, or a merge of tokens across the boundary, gives no position
    rather than a wrong one)."""
    ks = list(range(1, len(msgs) + (1 if through_last else 0)))
    if len(ks) > MAX_BOUNDARIES:
        ks = ks[:1] + ks[-(MAX_BOUNDARIES - 1):]
    out = []
    for k in ks:
        try:
            text = tok.apply_chat_template(msgs[:k], add_generation_prompt=False, **template)
        except PocketError:  # e.g. a template that refuses a history without a user turn
            continue
        head = tok.encode(text, add_special_tokens=False)
        if 0 < len(head) < len(ids) and ids[:len(head)] == head:
            if k == len(msgs) and out and len(head) - out[-1] < CHUNKED_MIN_TOKENS:
                # The end of a short last message gives way to the boundary before it
                # (`chunk_points` would keep the later of the two): that one is what other
                # conversations with the same system prompt share.
                continue
            out.append(len(head))
    return sorted(set(out))


def chunk_points(points: list[tuple[int, str]], start: int, end: int) -> list[tuple[int, str]]:
    """The snapshot points prefill can end a chunk at: past `start`, before `end` (the last
    prompt token, fed alone), and at least CHUNKED_MIN_TOKENS past the previous point (of two
    points closer than that, the later is kept: the boundary before a new message). Why: a
    piece that short takes the model's step-by-step Gated DeltaNet kernel, which rounds
    differently from the chunked one (pieces of 16+ tokens give the same state however a
    prompt is split, measured on the bundled model), and a snapshot that close to the last
    is worth little; `chunk_size` keeps the pieces between points at 16+ too. The piece
    after the last point may be short (a short user message after a long system prompt):
    prefill splits there with the cache on or off alike, so replies do not depend on the
    cache, but may differ in rounding from `generate`'s prefill of the same prompt."""
    points = [(p, k) for p, k in points if start < p < end]
    points = [(p, k) for i, (p, k) in enumerate(points)
              if i + 1 == len(points) or points[i + 1][0] - p >= CHUNKED_MIN_TOKENS]
    out: list[tuple[int, str]] = []
    pos = start
    for p, kind in points:
        if p - pos >= CHUNKED_MIN_TOKENS:
            out.append((p, kind))
            pos = p
    return out


def chunk_size(pos: int, left: int, step: int, point: int | None) -> int:
    """Tokens in the prefill chunk at prompt position `pos`, `left` tokens to feed before the
    last, the next snapshot point at `point` (None: none left): a prefill step, cut at the
    point, and shortened when it would leave fewer than CHUNKED_MIN_TOKENS before the point
    (a 515-token system prompt is fed as 499 + 16, not 512 + 3). Depends only on the
    position, the point and the step, so a prefill resumed from a snapshot splits the rest
    of the prompt as a cold one does."""
    n = min(step, left)
    if point is None:
        return n
    to_point = point - pos
    if to_point <= n:
        return to_point
    if to_point - n < CHUNKED_MIN_TOKENS:
        return to_point - CHUNKED_MIN_TOKENS
    return n


def snapshot_points(n_prompt: int, boundaries: Sequence[int],
                    start: int) -> list[tuple[int, str]]:
    """(position, kind) where a prefill of an `n_prompt`-token prompt, resumed at `start`
    (the cached prefix), ends a chunk and stores a snapshot: the message `boundaries`, then
    every SNAPSHOT_INTERVAL tokens (a boundary wins a tie), as `chunk_points` keeps them."""
    points = {p: "interval" for p in range(SNAPSHOT_INTERVAL, n_prompt, SNAPSHOT_INTERVAL)}
    points.update((p, "boundary") for p in boundaries)
    return chunk_points(sorted(points.items()), start, n_prompt - 1)

