"""Caches, chunked prefill, sampling and stops of the generation loop, on real models."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import ASSET
from mlx.utils import tree_flatten, tree_unflatten

from pocket_mlx.engine.generation import SamplingParams, generate, stream_generate
from pocket_mlx.engine.loader import _cast_dtype, load, load_model
from pocket_mlx.errors import PocketError

IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]


@pytest.fixture(scope="module")
def tiny():
    return load(ASSET, device="cpu")


def mlx_lm_model_as_ours():
    """Stock mlx-lm's model of the bundled checkpoint under our CPU dtype policy (float32
    activations, quantized matrices' scales as stored), so both compute the same thing."""
    from mlx_lm.utils import load_model as lm_load

    lm_model, _ = lm_load(ASSET)
    flat = dict(tree_flatten(lm_model.parameters()))
    stored = {k: v.dtype for k, v in flat.items()}
    lm_model.update(tree_unflatten([
        (k, v.astype(_cast_dtype(k, v.dtype, v.ndim, stored, mx.float32)))
        for k, v in flat.items()]))
    return lm_model


@pytest.mark.parametrize("layer_types", [
    ["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
    ["linear_attention"] * 3 + ["full_attention"],
])
def test_incremental_decode_equals_full_forward(make_ckpt, layer_types):
    model = load_model(make_ckpt(layer_types=layer_types))
    assert [l.is_linear for l in model.layers] == [t == "linear_attention" for t in layer_types]
    full = np.array(model(mx.array(IDS)[None]))
    cache = model.make_cache()
    # An uneven chunked prefill, then one token at a time.
    parts = [model(mx.array(IDS[:7])[None], cache=cache), model(mx.array(IDS[7:12])[None], cache=cache)]
    parts += [model(mx.array([t])[None], cache=cache) for t in IDS[12:]]
    inc = np.concatenate([np.array(p) for p in parts], axis=1)
    np.testing.assert_allclose(inc, full, rtol=1e-4, atol=1e-4)


def test_layer_types_are_honoured_not_every_fourth(make_ckpt):
    model = load_model(make_ckpt(layer_types=["full_attention", "linear_attention"]))
    assert hasattr(model.layers[0], "self_attn") and hasattr(model.layers[1], "linear_attn")


def test_chunked_prefill_gives_the_same_reply(tiny):
    model, tok = tiny
    a = generate(model, tok, "Tell me of the kings of old.", max_tokens=16, prefill_step=4)
    b = generate(model, tok, "Tell me of the kings of old.", max_tokens=16, prefill_step=512)
    assert a == b and a


def test_prefill_fills_the_same_cache_one_layer_at_a_time(tiny):
    """Issue 28: `Model.prefill` (what `serve`, `chat` and `generate` feed prompt chunks
    through) leaves the cache the model's own call leaves, and evaluating one layer at a time
    holds less at its peak than the chunk's graph evaluated whole (0.29 vs 0.9 GiB of RSS for a
    512-token chunk of the 35B shape; here the bundled model's 4 layers)."""
    model, _ = tiny
    ids = mx.random.randint(0, 1000, (1, 512), key=mx.random.key(1)).astype(mx.uint32)

    def peak(feed) -> tuple[list, int]:
        cache = model.make_cache()
        mx.eval(mx.zeros(1))
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        feed(cache)
        return cache, mx.get_peak_memory() - before

    # The logits are left unevaluated, as the engine's prefill did before: only the cache.
    whole, whole_peak = peak(lambda c: (model(ids, cache=c),
                                        mx.eval([a for x in c for a in x.arrays])))
    layered, layered_peak = peak(lambda c: model.prefill(ids, c))
    for a, b in zip(whole, layered):
        assert a.offset == b.offset
        for x, y in zip(a.arrays, b.arrays):
            assert mx.array_equal(x, y).item()
    assert layered_peak < whole_peak, (layered_peak, whole_peak)


def test_progress_callback_covers_the_prompt(tiny):
    model, tok = tiny
    seen = []
    for _ in stream_generate(model, tok, "In the beginning", max_tokens=2, prefill_step=3,
                             progress=lambda d, t: seen.append((d, t))):
        pass
    assert seen[-1][0] == seen[-1][1] and len(seen) > 2
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_seeded_sampling_is_reproducible_and_seed_matters(tiny):
    model, tok = tiny
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95)
    a = generate(model, tok, "Write a poem.", seed=7, **kw)
    b = generate(model, tok, "Write a poem.", seed=7, **kw)
    c = [generate(model, tok, "Write a poem.", seed=s, **kw) for s in (1, 2, 3)]
    assert a == b
    assert any(x != a for x in c)


def test_stats_and_finish_reasons(tiny):
    model, tok = tiny
    rs = list(stream_generate(model, tok, "In the beginning", max_tokens=5, raw=True))
    st = rs[-1].stats
    assert st.finish_reason in ("length", "eos") and st.generation_tokens <= 5
    assert st.prompt_tokens == len(tok.encode("In the beginning"))
    assert st.prompt_tps > 0 and st.ttft_s > 0 and st.peak_memory_gb > 0
    assert st.bytes_per_token > 0 and st.device == "cpu"
    assert rs[-1].fed_tokens[: st.prompt_tokens] == tok.encode("In the beginning")


def test_max_tokens_counts_tokens(tiny):
    model, tok = tiny
    tok_eos = tok.eos_token_ids
    tok.eos_token_ids = []
    try:
        last = list(stream_generate(model, tok, "And God said", max_tokens=7, raw=True))[-1]
    finally:
        tok.eos_token_ids = tok_eos
    assert last.stats.generation_tokens == 7 and last.stats.finish_reason == "length"


def test_stop_string_cuts_the_reply(tiny):
    model, tok = tiny
    full = generate(model, tok, "And God said", max_tokens=30, raw=True)
    word = full.split()[2]
    cut = generate(model, tok, "And God said", max_tokens=30, raw=True, stop=[word])
    assert word not in cut and full.startswith(cut)


def test_context_limit_stops_generation(tiny):
    model, tok = tiny
    ids = tok.encode("In the beginning God created the heaven and the earth.")
    old = model.args.max_position_embeddings
    model.args.max_position_embeddings = len(ids) + 3
    try:
        last = list(stream_generate(model, tok, ids, max_tokens=50))[-1]
        with pytest.raises(PocketError, match="does not fit"):
            list(stream_generate(model, tok, ids * 2, max_tokens=5))
    finally:
        model.args.max_position_embeddings = old
    assert last.stats.finish_reason in ("context", "eos")
    assert last.stats.generation_tokens <= 3


def test_cache_reuse_prefills_only_the_new_turn(tiny, exact_kernels):
    model, tok = tiny
    cache = model.make_cache()
    first = list(stream_generate(model, tok, "Hello", max_tokens=8, cache=cache))[-1]
    fed = first.fed_tokens
    follow = tok.encode("\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    second = list(stream_generate(model, tok, follow, max_tokens=8, cache=cache))[-1]
    assert second.stats.prompt_tokens == len(follow)
    # Same continuation as a fresh cache fed with everything.
    again = list(stream_generate(model, tok, fed + follow, max_tokens=8))[-1]
    assert again.fed_tokens[len(fed):] == second.fed_tokens


@pytest.mark.parametrize("bad,msg", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top-p"), (dict(top_p=1.5), "top-p"),
    (dict(repetition_context=0), "repetition context must be an integer >= 1"),
])
def test_bad_sampling_is_refused(bad, msg):
    with pytest.raises(PocketError, match=msg):
        SamplingParams(**bad).validate()


@pytest.mark.parametrize("bad,msg", [
    (dict(max_tokens="5"), "max tokens must be an integer >= 1, got '5'"),
    (dict(max_tokens=0), "max tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=2.0), "max tokens must be an integer >= 1"),
    (dict(prefill_step=0), r"prefill step must be an integer >= 1 \(prompt tokens per chunk\), got 0"),
    (dict(prefill_step="64"), "prefill step must be an integer >= 1"),
    (dict(repetition_context=0, repetition_penalty=1.2), "repetition context must be"),
    (dict(repetition_context="20"), "repetition context must be"),
])
def test_bad_api_values_are_one_line_errors(tiny, bad, msg):
    """The Python API refuses a bad value with the sentence the CLI would show, before any
    work (not a TypeError from deep in the loop, nor a 0 taken to mean something)."""
    model, tok = tiny
    with pytest.raises(PocketError, match=msg) as e:
        generate(model, tok, "hi", **bad)
    assert "\n" not in str(e.value)


def test_processors_see_only_the_history_they_read(tiny):
    """generate_step keeps the last `history_size` tokens (the repetition context), not the
    whole prompt and reply: bounded work per token on a long conversation."""
    from pocket_mlx.engine import devices, sampling
    from pocket_mlx.engine.generation import generate_step

    model, tok = tiny
    ids = tok.encode("Tell me of the kings of old, and of the sea.")
    seen: list[list[int]] = []

    def record(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    steps = [t for t, _ in generate_step(model, ids, model.make_cache(), sampler=sampling.greedy,
                                         processors=[record], max_tokens=6, history_size=4,
                                         stream=devices.stream_for("cpu"))]
    everything = ids + steps
    assert seen == [everything[: len(ids) + i][-4:] for i in range(6)]


def test_repetition_penalty_replies_as_mlx_lm(tiny, exact_kernels):
    """With a penalty strong enough to change the reply and a short context, the reply is mlx-lm's (which keeps the whole history
    and reads its tail): keeping only the tail changes nothing."""
    from mlx_lm.generate import generate_step as lm_generate_step
    from mlx_lm.sample_utils import make_logits_processors as lm_processors

    model, tok = tiny
    ids = tok.encode("Tell me a fortune.")
    eos, tok.eos_token_ids = tok.eos_token_ids, []
    try:
        ours = [r.token for r in stream_generate(model, tok, ids, max_tokens=24,
                                                 repetition_penalty=4.0, repetition_context=4)
                if r.token is not None]
        plain = [r.token for r in stream_generate(model, tok, ids, max_tokens=24)
                 if r.token is not None]
    finally:
        tok.eos_token_ids = eos
    lm_model = mlx_lm_model_as_ours()
    theirs = [int(t) for t, _ in lm_generate_step(
        mx.array(ids), lm_model, max_tokens=24,
        logits_processors=lm_processors(repetition_penalty=4.0, repetition_context_size=4))]
    assert ours == theirs and ours != plain


def test_gpu_request_without_gpu_names_cpu_flag(tiny):
    from pocket_mlx.engine.devices import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    model, tok = tiny
    with pytest.raises(PocketError, match="--device cpu"):
        list(stream_generate(model, tok, "hi", device="gpu"))


def test_greedy_32_tokens_identical_to_mlx_lm(tiny, exact_kernels):
    from mlx_lm.generate import generate_step

    model, tok = tiny
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a fortune."}]),
                     add_special_tokens=False)
    eos = tok.eos_token_ids
    tok.eos_token_ids = []
    try:
        ours = [r.token for r in stream_generate(model, tok, ids, max_tokens=32) if r.token is not None]
    finally:
        tok.eos_token_ids = eos
    lm_model = mlx_lm_model_as_ours()
    assert model.run_dtype == "float32"
    theirs = [int(t) for t, _ in generate_step(mx.array(ids), lm_model, max_tokens=32)]
    assert len(ours) == 32 and ours == theirs


def test_greedy_in_the_checkpoint_dtype_identical_to_mlx_lm(exact_kernels):
    """dtype= overrides the policy: bf16 as stored, which is what stock mlx-lm runs."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as lm_load

    model, tok = load(ASSET, device="cpu", dtype="bfloat16")
    ids = tok.encode("Tell me a fortune.")
    eos = tok.eos_token_ids
    tok.eos_token_ids = []
    try:
        ours = [r.token for r in stream_generate(model, tok, ids, max_tokens=16)
                if r.token is not None]
    finally:
        tok.eos_token_ids = eos
    lm_model, _ = lm_load(ASSET)
    theirs = [int(t) for t, _ in generate_step(mx.array(ids), lm_model, max_tokens=16)]
    assert len(ours) == 16 and ours == theirs


def test_generate_step_yields_tokens_with_their_logprobs(tiny):
    from pocket_mlx.engine import devices, sampling
    from pocket_mlx.engine.generation import generate_step

    model, tok = tiny
    ids = tok.encode("In the beginning")
    fed: list[int] = []
    steps = list(generate_step(model, ids, model.make_cache(), sampler=sampling.greedy,
                               max_tokens=6, stream=devices.stream_for("cpu"), fed=fed,
                               prefill_step=2))
    assert len(steps) == 6
    for token, logprobs in steps:
        assert logprobs.shape == (1, model.args.vocab_size)
        assert token == mx.argmax(logprobs, axis=-1).item()
        assert abs(mx.exp(logprobs).sum().item() - 1) < 1e-3
    # The last token was never fed back: nothing was queued after it.
    assert fed == ids + [t for t, _ in steps[:-1]]
    eos, tok.eos_token_ids = tok.eos_token_ids, []
    try:
        streamed = [r.token for r in stream_generate(model, tok, ids, max_tokens=6)
                    if r.token is not None]
    finally:
        tok.eos_token_ids = eos
    assert streamed == [t for t, _ in steps]
