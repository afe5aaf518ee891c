"""models/cache.KVCache against mlx-lm's KVCache (which it replaces to keep mlx_lm unimported)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache as LmKVCache

from pocket_mlx.models.cache import KVCache


def _kv(n: int, seed: int, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed + 1)).astype(dtype)
    return k, v


def test_updates_and_trims_match_mlx_lm():
    ours, theirs = KVCache(), LmKVCache()
    # Chunks that cross the 256-position growth steps, trims (the chat's rewind) in between.
    for i, (n, trim) in enumerate([(100, 0), (200, 0), (1, 30), (7, 0), (300, 5), (1, 0)]):
        k, v = _kv(n, i)
        a, b = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
        assert ours.offset == theirs.offset
        assert ours.trim(trim) == theirs.trim(trim) and ours.offset == theirs.offset
    assert ours.keys.shape == theirs.keys.shape and ours.is_trimmable()
    assert ours.nbytes == theirs.nbytes > 0
