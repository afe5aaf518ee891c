"""Token sampling: greedy, temperature, top-p, min-p, top-k, and the repetition penalty.

Why not mlx-lm's `sample_utils`: importing anything from `mlx_lm` runs its package `__init__`,
which imports `transformers` (~2.3 s on a laptop CPU, far more than a short reply takes). The
functions below are the same maths in the same order as mlx-lm 0.32's `make_sampler` and
`make_logits_processors` (top-p, then min-p, then top-k, then a categorical draw at the
temperature), and draw from the same `mx.random` state, so equal inputs and seeds give equal
tokens: tests/test_sampling.py checks that against mlx-lm itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import partial

import mlx.core as mx

from pocket_mlx.engine.params import DEFAULT_REPETITION_CONTEXT
from pocket_mlx.kernels import ops

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probabilities add up to `top_p`."""
    sorted_logprobs = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_logprobs.astype(mx.float32))
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_logprobs, num_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def apply_min_p(logprobs: mx.array, min_p: float) -> mx.array:
    """Drop tokens less likely than `min_p` times the most likely one (which always stays)."""
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs < top + math.log(min_p), -float("inf"), logprobs)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the `top_k` most likely tokens."""
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=-1)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def categorical(logprobs: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(logprobs * (1.0 / temp))


@mx.compile
def categorical_with_key(logprobs: mx.array, key: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(logprobs * (1.0 / temp), key=key)


def logit_filters(
    top_p: float, min_p: float, top_k: int
) -> list[Callable[[mx.array], mx.array]]:
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < top_p < 1:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p > 0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        # top-k of the whole vocabulary or more keeps everything (mlx-lm raises instead).
        filters.append(lambda x: apply_top_k(x, top_k) if top_k < x.shape[-1] else x)
    return filters


def make_sampler(temp: float = 0.0, top_p: float = 1.0, min_p: float = 0.0,
                 top_k: int = 0) -> Sampler:
    """A function from log-probabilities [B, V] to token ids [B]. `temp` 0 is greedy (the
    filters then change nothing); top_p 1, min_p 0 and top_k 0 are off."""
    if temp == 0:
        return greedy
    filters = logit_filters(top_p, min_p, top_k)

    def sampler(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        return categorical(logprobs, temp)

    return sampler


class KeyedSampler:
    """`make_sampler(temp > 0, ...)` drawing from its own key instead of MLX's global one, so
    several sequences sampled on one thread (the server's batch) each keep their own random
    stream. Seeded with `seed`, it draws exactly what `make_sampler` draws after
    `mx.random.seed(seed)`: MLX's global key sequence splits its key the same way per draw."""

    def __init__(self, seed: int, temp: float, top_p: float = 1.0, min_p: float = 0.0,
                 top_k: int = 0) -> None:
        if temp <= 0:
            raise ValueError("a keyed sampler draws: temp must be above 0 (greedy draws nothing)")
        self.key = mx.random.key(seed)
        self.temp = temp
        self.filters = logit_filters(top_p, min_p, top_k)

    def __call__(self, logprobs: mx.array) -> mx.array:
        for f in self.filters:
            logprobs = f(logprobs)
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return categorical_with_key(logprobs, keys[1], self.temp)


def sampler_for(p, own_key: bool = False) -> Sampler:
    """The one sampler of a request's `SamplingParams` (engine/generation.py) for `generate`,
    `chat` and `serve` alike: greedy at temperature 0; else top-p/min-p/top-k then a draw,
    from MLX's global key (`generate_step`, seeded by `mx.random.seed`) or, `own_key`, from a
    key of its own (a sequence of the server's batch, so each keeps its own random stream:
    `p.seed`, or a random one)."""
    if p.temperature <= 0:
        return greedy
    if not own_key:
        return make_sampler(temp=p.temperature, top_p=p.top_p, min_p=p.min_p, top_k=p.top_k)
    seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return KeyedSampler(seed, p.temperature, p.top_p, p.min_p, p.top_k)


def processors_for(p) -> list[LogitsProcessor]:
    """The logits processors of a request's `SamplingParams` (the repetition penalty)."""
    return make_logits_processors(repetition_penalty=p.repetition_penalty,
                                  repetition_context_size=p.repetition_context)


def sample(logits: mx.array, sampler: Sampler, processors: list | tuple = (),
           history: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(token [B], logprobs [B, vocab]) from logits [B, vocab] (lazy): the processors over
    `history` (the tokens so far), log-softmax, then the sampler. The one sampling step of
    `generate_step` and of the batched decode (engine/batch.py)."""
    for proc in processors:
        logits = proc(history, logits)
    logprobs = ops.log_softmax(logits)
    return sampler(logprobs), logprobs


def make_repetition_penalty(penalty: float,
                            context_size: int = DEFAULT_REPETITION_CONTEXT) -> LogitsProcessor:
    """Divide the logits of tokens among the last `context_size` ones by `penalty` (multiply
    the negative ones): CTRL's penalty (arXiv:1909.05858), sign-aware as in mlx-lm."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if len(tokens) > 0:
            tokens = tokens[-context_size:]
            picked = logits[:, tokens]
            logits[:, tokens] = mx.where(picked < 0, picked * penalty, picked / penalty)
        return logits

    return process


def make_logits_processors(repetition_penalty: float = 1.0,
                           repetition_context_size: int = DEFAULT_REPETITION_CONTEXT,
                           ) -> list[LogitsProcessor]:
    """Processors `(history tokens, logits) -> logits` run before the sampler; none for a
    penalty of 1 (no effect)."""
    if repetition_penalty in (0, 1):
        return []
    return [make_repetition_penalty(repetition_penalty, repetition_context_size)]
