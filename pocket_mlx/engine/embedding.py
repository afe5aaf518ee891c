"""A text's embedding from a generative model: the trunk's final hidden states (after the final
norm, before the vocabulary head) averaged over the text's tokens and scaled to unit length,
what llama.cpp's server gives for a generative model (mean pooling, L2-normalized).

Why so: the model was not trained to embed, so there is no pooling head to use; the mean of
its last hidden states is the usual stand-in. It places texts by rough similarity (cosine, as
the vectors have length 1: dot products), good enough to rank a handful of passages or spot
near-duplicates; a trained embedding model does retrieval much better. The prompt is fed in
chunks through a fresh cache (as prefill does), so a long text costs one chunk's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from pocket_mlx import kernels
from pocket_mlx.errors import PocketError


def mean_pooled(model, ids: Sequence[int], cache: list, chunk: int) -> list[float]:
    """The unit-length mean of `model`'s post-norm hidden states over `ids`, fed `chunk`
    tokens at a time through `cache` (`model.make_cache()`, consumed)."""
    if not ids:
        raise PocketError("nothing to embed: the input is empty after tokenization")
    lm = model.language_model
    if lm.pipe is not None:
        raise PocketError("embeddings are not available from a pipelined model")
    total = mx.zeros((model.args.hidden_size,), dtype=mx.float32)
    with kernels.pinned():
        for i in range(0, len(ids), chunk):
            h = lm.model(mx.array(list(ids[i:i + chunk]), dtype=mx.uint32)[None], cache)
            total = total + h[0].astype(mx.float32).sum(axis=0)
            mx.eval(total, [a for c in cache for a in c.arrays])
    mean = total / len(ids)
    norm = mx.sqrt((mean * mean).sum())
    out = mean / mx.maximum(norm, 1e-12)
    mx.eval(out)
    return out.tolist()
