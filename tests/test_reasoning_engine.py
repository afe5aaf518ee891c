"""Reasoning in the decoders (engine/generation.py's `stream_generate`, engine/batch.py's
`BatchDecoder`) on the bundled model with Qwen3.5's real chat template: the model never closes
the block by itself, so a reply is all reasoning until a budget closes it; with a budget the
engine feeds `</think>\\n\\n` after N reasoning tokens and the model goes on with an answer.
Both decoders give the same tokens; without `thinking` nothing changes."""

from __future__ import annotations

import pytest
from conftest import ROOT

from pocket_mlx import kernels
from pocket_mlx.engine import devices
from pocket_mlx.engine.batch import BatchDecoder, Finished, Token
from pocket_mlx.engine.generation import SamplingParams, generate, stream_generate
from pocket_mlx.engine.loader import default_model_path, load
from pocket_mlx.engine.reasoning import CLOSE_SEQUENCE, close_sequence_ids, split_reasoning
from pocket_mlx.errors import PocketError

QWEN35 = (ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja").read_text()
QUESTION = "Once upon a time"  # greedy: no EOS within 40 tokens


class Stored:
    def store(self, tokens, cache, kind="end") -> None:
        pass


@pytest.fixture(scope="module")
def tiny():
    kernels.keep_rows_independent(2)
    model, tok = load(default_model_path(), device="cpu")
    tok.chat_template = QWEN35  # a model that never closes the block
    return model, tok


def run(tiny, prompt=QUESTION, **kw) -> tuple[str, str, list[int], object]:
    """(reasoning, answer, reply tokens, last stats) of a greedy `stream_generate`."""
    model, tok = tiny
    reasoning, text, tokens, stats = "", "", [], None
    for r in stream_generate(model, tok, prompt, temperature=0.0, device="cpu", **kw):
        reasoning, text, stats = reasoning + r.reasoning, text + r.text, r.stats
        if r.token is not None:
            tokens.append(r.token)
    return reasoning, text, tokens, stats


def test_without_thinking_nothing_changes(tiny, exact_kernels):
    model, tok = tiny
    plain = generate(model, tok, QUESTION, max_tokens=12, temperature=0.0, device="cpu")
    r, t, _, stats = run(tiny, max_tokens=12, thinking=None)
    assert (r, t) == ("", plain) and stats.reasoning_tokens == 0
    assert plain.strip() and "</think>" not in plain


def test_never_closed_block_is_all_reasoning(tiny, exact_kernels):
    _, _, raw_tokens, _ = run(tiny, max_tokens=20)
    raw = tiny[1].decode(raw_tokens)
    r, t, tokens, stats = run(tiny, max_tokens=20, thinking="auto")
    assert tokens == raw_tokens
    assert (r, t) == split_reasoning(raw, inside=True) and t == "" and r
    assert stats.finish_reason == "length" and stats.reasoning_tokens == 20


@pytest.mark.parametrize("budget", [0, 1, 16])
def test_budget_closes_the_block(tiny, exact_kernels, budget):
    _, tok = tiny
    close = close_sequence_ids(tok)
    assert tok.decode(close) == CLOSE_SEQUENCE
    raw_tokens = run(tiny, max_tokens=budget)[2] if budget else []
    r, t, tokens, stats = run(tiny, max_tokens=budget + len(close) + 8, thinking=True,
                              reasoning_budget=budget)
    # The first `budget` tokens are the model's, then the close is fed, then the answer.
    assert tokens[:budget] == raw_tokens
    assert tokens[budget:budget + len(close)] == close
    assert stats.reasoning_tokens == budget and stats.finish_reason == "length"
    assert stats.generation_tokens == len(tokens)
    assert t.strip() and "</think>" not in t + r
    assert r == tok.decode(raw_tokens).strip()


def test_budget_turns_speculation_off(tiny, exact_kernels):
    spec = run(tiny, max_tokens=14, thinking=True, reasoning_budget=4, speculative="lookup")
    plain = run(tiny, max_tokens=14, thinking=True, reasoning_budget=4)
    assert spec[2] == plain[2] and spec[3].speculative is None


def test_bad_thinking_values(tiny):
    with pytest.raises(PocketError, match="reasoning budget must be an integer >= 0"):
        run(tiny, max_tokens=2, thinking=True, reasoning_budget=-1)
    with pytest.raises(PocketError, match="thinking must be"):
        run(tiny, max_tokens=2, thinking="yes")


# ---- the batched decoder ------------------------------------------------------------------
def batch(tiny, requests: list[dict]) -> list[tuple[str, str, Finished, list[Token]]]:
    """Insert every request (keywords of `insert`) at once; (reasoning, text, finished,
    tokens) of each."""
    model, tok = tiny
    dec = BatchDecoder(model, tok, stream=devices.stream_for("cpu"), store=Stored())
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]),
                     add_special_tokens=False)
    uids = [dec.insert(ids, cache=model.make_cache(), n_cached=0, sampling=SamplingParams(),
                       room=10_000, **kw) for kw in requests]
    out = {u: ["", "", None, []] for u in uids}
    while len(dec):
        for ev in dec.step():
            if isinstance(ev, Token):
                out[ev.uid][3].append(ev)
            if isinstance(ev, (Token, Finished)):
                out[ev.uid][0] += ev.reasoning
                out[ev.uid][1] += ev.text
            if isinstance(ev, Finished):
                out[ev.uid][2] = ev
    return [tuple(out[u]) for u in uids]


def test_batch_equals_stream_generate(tiny, exact_kernels):
    """A budgeted sequence, an unbudgeted one and one not parsed, decoded together: each
    gives what `stream_generate` gives it alone."""
    n_close = len(close_sequence_ids(tiny[1]))
    budgeted, open_, plain = batch(tiny, [
        {"max_tokens": 24, "thinking": True, "reasoning_budget": 6},
        {"max_tokens": 10, "thinking": True},
        {"max_tokens": 10}])
    r, t, _, stats = run(tiny, max_tokens=24, thinking=True, reasoning_budget=6)
    assert budgeted[:2] == (r, t) and t.strip()
    fin, tokens = budgeted[2], budgeted[3]
    assert fin.reasoning_tokens == stats.reasoning_tokens == 6 and fin.reason == "length"
    assert [e.forced for e in tokens] == [False] * 6 + [True] * n_close + [False] * (18 - n_close)
    r, t, _, stats = run(tiny, max_tokens=10, thinking=True)
    assert open_[:2] == (r, t) and t == "" and open_[2].reasoning_tokens == 10
    assert plain[:2] == ("", run(tiny, max_tokens=10)[1]) and plain[2].reasoning_tokens == 0


def test_batch_budget_zero_and_bad_budget(tiny, exact_kernels):
    (zero,) = batch(tiny, [{"max_tokens": 12, "thinking": True, "reasoning_budget": 0}])
    assert zero[0] == "" and zero[1].strip() and zero[2].reasoning_tokens == 0
    assert zero[:2] == run(tiny, max_tokens=12, thinking=True, reasoning_budget=0)[:2]
    with pytest.raises(ValueError, match=">= 0"):
        batch(tiny, [{"max_tokens": 4, "thinking": True, "reasoning_budget": -3}])


def test_batch_budget_does_not_speculate(tiny, exact_kernels):
    """`serve --speculative`: a budgeted sequence gets no drafter (the forced tokens would
    come between a verify pass's drafts); an unbudgeted thinking one still drafts."""
    model, tok = tiny
    dec = BatchDecoder(model, tok, stream=devices.stream_for("cpu"), store=Stored(),
                       speculative="lookup")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]),
                     add_special_tokens=False)
    kw = dict(cache=model.make_cache(), n_cached=0, sampling=SamplingParams(), room=10_000,
              max_tokens=8, thinking=True)
    dec.insert(ids, reasoning_budget=2, **kw)
    dec.insert(ids, **{**kw, "cache": model.make_cache()})
    budgeted, open_ = dec.prefilling
    assert budgeted.drafter is None and open_.drafter is not None


def test_chat_turn_two_reuses_turn_one_up_to_its_generation_prompt(tiny, exact_kernels):
    """Qwen3.5's template renders turn 1 without its reasoning in turn 2's prompt, so the
    chat's own cache (prompt + reply) cannot serve turn 2; the snapshot turn 1 stored at the
    end of its user message does, and the reply is the one a session without a store gives."""
    from pocket_mlx.engine.prompt_cache import PromptCache
    from pocket_mlx.engine.session import ChatSession, Settings

    model, tok = tiny
    settings = Settings(max_tokens=8, system="")

    def reply(session, messages):
        text, reasoning, last = "", "", None
        for r, _ in session.generate(messages, settings, "cpu"):
            text, reasoning, last = text + r.text, reasoning + r.reasoning, r
        return text, reasoning, last.stats

    session = ChatSession(model, tok, PromptCache(model, 1 << 30))
    turn1 = [{"role": "user", "content": "Tell me about the sea and its ships. " * 6}]
    a, thought, s1 = reply(session, turn1)
    assert thought and not a  # the block never closes within 8 tokens
    turn2 = turn1 + [{"role": "assistant", "content": a, "reasoning_content": thought},
                     {"role": "user", "content": "And then?"}]
    b, _, s2 = reply(session, turn2)
    served = session.prompt_cache.stats()["tokens_served"]
    gen_prompt = 7  # "<|im_start|>assistant\n<think>\n" in the bundled tokenizer
    assert session.plan_kind == "stored" and served >= s1.prompt_tokens - gen_prompt
    cold, _, s_cold = reply(ChatSession(model, tok), turn2)
    assert b == cold and s2.prompt_tokens == s_cold.prompt_tokens - served
