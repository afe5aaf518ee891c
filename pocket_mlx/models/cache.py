"""The model's per-layer caches: the full-attention layers' KV cache (preallocated in steps,
trimmable) and the Gated DeltaNet layers' carried state.

Why not mlx-lm's `KVCache` (which this mirrors): importing `mlx_lm.models.cache` runs the
`mlx_lm` package's `__init__`, which imports `transformers` (~2.3 s), and every generation makes
a cache. Same growth rule (blocks of `step` positions), same trimming (the chat rewinds to a
snapshot). After a device switch the held positions are cast once, with the model, by
`engine.loader.cast_cache`: no dtype check per token here.
"""

from __future__ import annotations

import mlx.core as mx

# What `--cache-type-k/--cache-type-v` (llama.cpp's names) may say, and the dtype each stores.
CACHE_TYPES = {"f32": None, "f16": mx.float16, "bf16": mx.bfloat16}


class KVCache:
    """Keys and values [B, heads, positions, head_dim] of one attention layer.

    `dtype`: what the positions are stored in (None: the activations' dtype, float32 on the
    CPU: exact). A half cache (`mx.float16` / `mx.bfloat16`, opt-in) halves the bytes a decode
    step reads at depth; its values are rounded once, when written, and read back exactly as
    float32 (the decode node converts as it loads; the prefill path casts what it fetches)."""

    step = 256

    def __init__(self, dtype: mx.Dtype | None = None) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.dtype = dtype

    def reserve(self, n: int, heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype,
                batch: int = 1) -> None:
        """Make room for `n` more positions after those held (grown by whole blocks of `step`)."""
        prev = self.offset
        if self.keys is None or prev + n > self.keys.shape[2]:
            size = (self.step + n - 1) // self.step * self.step
            new_k = mx.zeros((batch, heads, size, k_dim), dtype)
            new_v = mx.zeros((batch, heads, size, v_dim), dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append the new positions; return every position held so far."""
        prev = self.offset
        B, heads, n, k_dim = keys.shape
        dtype = self.dtype or keys.dtype
        self.reserve(n, heads, k_dim, values.shape[3], dtype, B)
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys.astype(dtype)
        self.values[..., prev : self.offset, :] = values.astype(dtype)
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (the arrays keep their room for reuse)."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def attend_as(k: mx.array, v: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """What `update_and_fetch` returned, in the queries' dtype: a half cache's positions are
    attended in float32 (exact conversions); a float32 cache's arrays pass as they are."""
    return (k, v) if k.dtype == dtype else (k.astype(dtype), v.astype(dtype))


class LinearAttentionCache:
    """Carried state of one Gated DeltaNet layer: the conv window and the delta-rule state
    (fixed size whatever the length; not trimmable: the chat rewinds to a snapshot instead)."""

    def __init__(self) -> None:
        self.conv_state: mx.array | None = None
        self.state: mx.array | None = None
        self.offset = 0

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.conv_state, self.state) if a is not None]
