"""Perplexity over a text file of documents, in fixed non-overlapping token windows.

Documents are joined with the `<|endoftext|>` token and cut into windows of `window` tokens; in
each window every token after the first is predicted from the ones before it in that window.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from pocket_mlx.corpus import SEPARATOR, read_documents, token_stream, windows
from pocket_mlx.errors import PocketError


@dataclass
class PplResult:
    ppl: float
    tokens: int  # predicted tokens
    seconds: float
    nll: float  # mean negative log-likelihood, nats
    windows: int

    def as_dict(self) -> dict:
        return asdict(self)


def window_nll(model, batch: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood and predicted-token count for windows of equal length."""
    x = mx.array(batch, mx.int32)
    # A half KV cache (--cache-type-k f16, opt-in) rounds the keys and values the attention
    # reads: measured by running each window through a fresh cache of that type.
    half = getattr(model, "kv_cache_dtype", None) is not None
    logits = model(x[:, :-1], cache=model.make_cache() if half else None).astype(mx.float32)
    targets = x[:, 1:]
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)
    nll = (lse - picked).sum()
    return float(nll.item()), int(targets.size)


def perplexity(model, ids: list[int], window: int = 512, max_tokens: int | None = None,
               batch: int = 1, progress: Callable[[int, int], None] | None = None) -> PplResult:
    if window < 2:
        raise PocketError(f"--window must be at least 2, got {window}")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    chunks = windows(ids, window)
    if not chunks:
        raise PocketError("too little text to measure perplexity (fewer than 2 tokens)")
    t0 = time.perf_counter()
    total, count = 0.0, 0
    i = 0
    while i < len(chunks):
        n = len(chunks[i])
        group = [c for c in chunks[i:i + batch] if len(c) == n]
        nll, k = window_nll(model, group)
        total += nll
        count += k
        i += len(group)
        if progress:
            progress(i, len(chunks))
    mean = total / count
    return PplResult(math.exp(mean), count, time.perf_counter() - t0, mean, len(chunks))


def file_perplexity(model, tokenizer, data: Path, window: int = 512,
                    separator: str = SEPARATOR, max_tokens: int | None = None,
                    progress: Callable[[int, int], None] | None = None) -> PplResult:
    ids = token_stream(read_documents(data, separator), tokenizer, separator)
    return perplexity(model, ids, window, max_tokens=max_tokens, progress=progress)
