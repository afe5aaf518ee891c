"""engine/sampling.py against mlx-lm's samplers: equal inputs and seeds give equal tokens."""

from __future__ import annotations

import inspect

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors as lm_processors
from mlx_lm.sample_utils import make_sampler as lm_sampler

from pocket_mlx.engine import sampling
from pocket_mlx.engine.generation import SamplingParams, make_sampler
from pocket_mlx.errors import PocketError


def _logprobs(seed: int, vocab: int = 512, batch: int = 1, peaked: bool = False) -> mx.array:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32) * (4.0 if peaked else 1.5)
    x = mx.array(logits)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _draws(sampler, seed: int, n: int = 40, **kw) -> list[list[int]]:
    mx.random.seed(seed)
    return [sampler(_logprobs(i, **kw)).tolist() for i in range(n)]


@pytest.mark.parametrize("params", [
    dict(temp=0.0),
    dict(temp=0.0, top_p=0.5, top_k=3),  # greedy ignores the filters, as in mlx-lm
    dict(temp=1.0),
    dict(temp=0.7),
    dict(temp=1.0, top_p=0.9),
    dict(temp=1.3, top_p=0.5),
    dict(temp=1.0, min_p=0.05),
    dict(temp=1.0, top_k=5),
    dict(temp=0.8, top_p=0.95, min_p=0.02, top_k=40),
])
@pytest.mark.parametrize("batch", [1, 2])
def test_samplers_draw_what_mlx_lm_draws(params, batch):
    ours = sampling.make_sampler(**params)
    theirs = lm_sampler(**params)
    for seed in (0, 11):
        a = _draws(ours, seed, batch=batch, peaked=seed == 11)
        b = _draws(theirs, seed, batch=batch, peaked=seed == 11)
        assert a == b


def test_filters_really_filter():
    """Not just equal to mlx-lm: top-k 1 is greedy and min-p near 1 keeps the top token."""
    lp = _logprobs(3)
    best = mx.argmax(lp, axis=-1).item()
    mx.random.seed(0)
    assert {sampling.make_sampler(temp=5.0, top_k=1)(lp).item() for _ in range(20)} == {best}
    assert {sampling.make_sampler(temp=5.0, min_p=0.999)(lp).item() for _ in range(20)} == {best}
    assert len({sampling.make_sampler(temp=5.0)(lp).item() for _ in range(50)}) > 5


def test_top_k_of_the_whole_vocabulary_keeps_everything():
    lp = _logprobs(4, vocab=16)
    mx.random.seed(2)
    a = [sampling.make_sampler(temp=1.0, top_k=16)(lp).item() for _ in range(20)]
    mx.random.seed(2)
    b = [sampling.make_sampler(temp=1.0)(lp).item() for _ in range(20)]
    assert a == b


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_equals_mlx_lm(penalty):
    tokens = mx.array([3, 7, 7, 100, 3, 250, 5], mx.uint32)
    ours = sampling.make_logits_processors(repetition_penalty=penalty, repetition_context_size=4)
    theirs = lm_processors(repetition_penalty=penalty, repetition_context_size=4)
    assert len(ours) == len(theirs) == 1
    logits = _logprobs(5) * 3
    a = ours[0](tokens, mx.array(logits))
    b = theirs[0](tokens, mx.array(logits))
    assert mx.array_equal(a, b).item()
    assert not mx.array_equal(a, logits).item()  # the last 4 tokens' logits did change
    assert mx.array_equal(a[:, 7], logits[:, 7]).item()  # 7 is older than the context


def test_one_default_repetition_context_which_is_mlx_lm_s():
    def default(f, name):
        return inspect.signature(f).parameters[name].default

    ours = {SamplingParams().repetition_context,
            default(sampling.make_logits_processors, "repetition_context_size"),
            default(sampling.make_repetition_penalty, "context_size")}
    assert ours == {default(lm_processors, "repetition_context_size")} == {20}


def test_penalty_one_is_no_processor():
    assert sampling.make_logits_processors(repetition_penalty=1.0) == []


def test_generation_params_reach_the_sampler():
    p = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, top_k=7)
    a = _draws(make_sampler(p), 1)
    b = _draws(lm_sampler(temp=1.0, top_p=0.9, min_p=0.05, top_k=7), 1)
    assert a == b


def test_temp_is_accepted_as_mlx_lm_spells_it():
    assert SamplingParams.from_kwargs({"temp": 0.5, "top_p": 0.9}).temperature == 0.5
    assert SamplingParams.from_kwargs({"temp": 0.5, "temperature": 0.5}).temperature == 0.5
    with pytest.raises(PocketError, match="temp=0.5 and temperature=0.7"):
        SamplingParams.from_kwargs({"temp": 0.5, "temperature": 0.7})
    with pytest.raises(TypeError, match="temp"):  # one way in: from_kwargs (the keywords)
        SamplingParams(temp=0.7)
    with pytest.raises(TypeError, match="tempreature"):
        SamplingParams.from_kwargs({"tempreature": 0.5})
