"""engine/reasoning.py: the reasoning parser (whole, and fed piece by piece at every split
point), the tracker's counting and budget, and what a chat template says about thinking (on
Qwen3.5's real template, tests/fixtures/templates/qwen3.5.jinja)."""

from __future__ import annotations

import pytest
from conftest import ROOT

from pocket_mlx.engine.reasoning import (
    CLOSE_SEQUENCE,
    REASONING,
    TEXT,
    ReasoningParser,
    ReasoningTracker,
    check_reasoning_budget,
    parse_reasoning_mode,
    prompt_leaves_inside,
    split_pieces,
    split_reasoning,
    supports_thinking,
    thinking_for,
    thinking_kwargs,
)
from pocket_mlx.engine.templates import render_template

QWEN35 = (ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja").read_text()

# (reply, inside, expected reasoning, expected answer)
CASES = [
    ("Let me see.\n</think>\n\nHello!", True, "Let me see.", "Hello!"),
    ("a</think>b", True, "a", "b"),
    ("\n\nsteps\n\nmore\n</think>\n\n\nanswer\n", True, "steps\n\nmore", "answer\n"),
    ("never closed <thi", True, "never closed <thi", ""),
    ("never closed\n\n", True, "never closed", ""),
    ("</think>\n\nstraight", True, "", "straight"),
    ("r</think>x</think>y", True, "r", "x</think>y"),  # a stray close tag is text
    ("<think>\nagain</think>ok", True, "again", "ok"),  # a repeated open tag is dropped
    ("r</think>\n\n<think>no</think>", True, "r", "<think>no</think>"),
    ("<think>\nhmm\n</think>\n\nYes.", False, "hmm", "Yes."),  # the model opens it itself
    ("  <think>x</think>y", False, "x", "y"),
    ("Plain answer.", False, "", "Plain answer."),
    ("<b>bold</b> </think>", False, "", "<b>bold</b> </think>"),
    ("\nindented <think>", False, "", "\nindented <think>"),
    ("<thi", False, "", "<thi"),  # a partial open tag at the end of a direct answer
    ("<think>open forever", False, "open forever", ""),
    ("", True, "", ""),
    ("", False, "", ""),
    ("é🙂 <\n</think>\n\n🙂", True, "é🙂 <", "🙂"),
]


def run(parser: ReasoningParser, parts: list[str]) -> tuple[str, str, list]:
    pieces = [p for part in parts for p in parser.feed(part)] + parser.close()
    return (*split_pieces(pieces), pieces)


@pytest.mark.parametrize("reply,inside,reasoning,answer", CASES)
def test_whole(reply, inside, reasoning, answer):
    assert split_reasoning(reply, inside) == (reasoning, answer)
    p = ReasoningParser(inside)
    r, t, _ = run(p, [reply])
    assert (p.reasoning, p.text) == (r, t) == (reasoning, answer)


@pytest.mark.parametrize("reply,inside,reasoning,answer", CASES)
def test_every_split(reply, inside, reasoning, answer):
    """Two pieces at every split point, three at every pair, and one character at a time."""
    n = len(reply)
    splits = [[reply[:i], reply[i:]] for i in range(n + 1)]
    splits += [[reply[:i], reply[i:j], reply[j:]] for i in range(n + 1) for j in range(i, n + 1)]
    splits.append(list(reply))
    for parts in splits:
        r, t, pieces = run(ReasoningParser(inside), parts)
        assert (r, t) == (reasoning, answer), parts
        assert all(s for _, s in pieces), parts  # no empty pieces


def test_streams_as_it_goes():
    """Only a possible partial tag (or whitespace that may be stripped) is held back."""
    p = ReasoningParser(inside=True)
    assert p.feed("First") == [(REASONING, "First")]
    assert p.feed(" step</th") == [(REASONING, " step")]
    assert p.pending == "</th"
    assert p.feed("ink>") == []
    assert p.closed and not p.in_block
    assert p.feed("\n\n") == []  # the separator: not the answer's
    assert p.feed("Hi") == [(TEXT, "Hi")]
    assert p.feed(" </think>") == [(TEXT, " </think>")]


def test_reasoning_then_answer_order():
    p = ReasoningParser(inside=True)
    pieces = p.feed("a\n") + p.feed("b</think>\n\nc") + p.close()
    assert pieces == [(REASONING, "a"), (REASONING, "\nb"), (TEXT, "c")]


def test_direct_answer_holds_only_a_tag_prefix():
    p = ReasoningParser(inside=False)
    assert p.feed("<") == []
    assert p.feed("p>") == [(TEXT, "<p>")]
    assert not p.opened


def test_close_drop_partial():
    p = ReasoningParser(inside=True)
    p.feed("thinking </th")
    assert p.close(drop_partial=True) == []
    assert p.reasoning == "thinking"


# ---- the tracker: counts and the budget ---------------------------------------------------
CLOSE_IDS = [101, 102, 103]  # stand-ins for the tokens of "</think>", "\n\n"
CLOSE_TEXT = ["</th", "ink>", "\n\n"]


def drive(tracker: ReasoningTracker, sampled: list[str]) -> tuple[list, str, str]:
    """A decoder's loop: the model 'samples' `sampled`, except where the tracker forces."""
    out, fed, it = [], [], iter(sampled)
    f = tracker.next_forced()
    while True:
        if f is not None:
            piece = CLOSE_TEXT[CLOSE_IDS.index(f)]
            fed.append(f)
        else:
            piece = next(it, None)
            if piece is None:
                break
            fed.append(piece)
        out.append(tracker.add(piece))
        f = tracker.next_forced()
    r, t = tracker.finish()
    return fed, "".join(x for x, _ in out) + r, "".join(y for _, y in out) + t


def test_tracker_counts_its_own_close():
    t = ReasoningTracker(inside=True)
    fed, r, a = drive(t, ["Think", "ing", "</think>", "\n\n", "Ans", "wer"])
    assert (r, a) == ("Thinking", "Answer")
    assert t.tokens == 3 and t.forced == 0


def test_budget_closes_the_block():
    t = ReasoningTracker(inside=True, budget=2, close_ids=CLOSE_IDS)
    fed, r, a = drive(t, ["one ", "two ", "three ", "Answer"])
    assert fed == ["one ", "two ", *CLOSE_IDS, "three ", "Answer"]
    assert (r, a) == ("one two", "three Answer")
    assert t.tokens == 2 and t.forced == 3


def test_budget_zero_closes_at_once():
    t = ReasoningTracker(inside=True, budget=0, close_ids=CLOSE_IDS)
    fed, r, a = drive(t, ["Answer"])
    assert fed == [*CLOSE_IDS, "Answer"] and (r, a) == ("", "Answer") and t.tokens == 0


def test_budget_not_spent():
    t = ReasoningTracker(inside=True, budget=5, close_ids=CLOSE_IDS)
    fed, r, a = drive(t, ["a", "</think>", "b", "c", "d", "e", "f"])
    assert CLOSE_IDS[0] not in fed and (r, a) == ("a", "bcdef") and t.tokens == 2


def test_budget_outside_a_block_does_nothing():
    t = ReasoningTracker(inside=False, budget=0, close_ids=CLOSE_IDS)
    fed, r, a = drive(t, ["Just", " text"])
    assert fed == ["Just", " text"] and (r, a) == ("", "Just text") and t.tokens == 0


def test_budget_on_a_block_the_model_opens():
    t = ReasoningTracker(inside=False, budget=2, close_ids=CLOSE_IDS)
    fed, r, a = drive(t, ["<think>", "x", "y", "z"])
    assert fed == ["<think>", "x", *CLOSE_IDS, "y", "z"] and (r, a) == ("x", "yz")


def test_close_cut_short_leaves_no_partial_tag():
    t = ReasoningTracker(inside=True, budget=1, close_ids=CLOSE_IDS)
    assert t.next_forced() is None
    t.add("idea")
    assert t.next_forced() == CLOSE_IDS[0]
    t.add("</th")  # max tokens reached here
    assert t.finish() == ("", "")
    assert t.reasoning == "idea"


def test_checks():
    assert parse_reasoning_mode("on") is True and parse_reasoning_mode("off") is False
    assert parse_reasoning_mode("auto") is None
    with pytest.raises(ValueError, match="on, off or auto"):
        parse_reasoning_mode("yes")
    assert check_reasoning_budget(None) is None and check_reasoning_budget(0) == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=">= 0"):
            check_reasoning_budget(bad)
    with pytest.raises(ValueError):
        ReasoningTracker(inside=True, budget=-2)


# ---- the template: Qwen3.5's real one ------------------------------------------------------
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def render(messages, **kw) -> str:
    return render_template(QWEN35, messages=messages, add_generation_prompt=True, **kw)


def test_qwen35_generation_prompt():
    on = render(HI)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    off = render(HI, **thinking_kwargs(QWEN35, False))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(HI, **thinking_kwargs(QWEN35, True)) == on == render(HI, **thinking_kwargs(QWEN35, None))
    assert supports_thinking(QWEN35)
    assert thinking_for(QWEN35, on) is True and thinking_for(QWEN35, off) is False
    assert prompt_leaves_inside(on) and not prompt_leaves_inside(off)
    assert off.endswith(CLOSE_SEQUENCE)  # what the budget forces is the template's own close


def test_qwen35_tools_and_history():
    """Tools, a reasoning turn and a tool call in the history: the history's reasoning is
    kept after the last user message, dropped before it."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = HI + [{"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
                  "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": "22 C"}]
    out = render(msgs, tools=[WEATHER])
    assert out.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in out
    assert ("<|im_start|>assistant\n<think>\nNeed the weather.\n</think>\n\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n") in out
    assert out.endswith("<tool_response>\n22 C\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n<think>\n")
    later = msgs + [{"role": "assistant", "content": "It is 22 C."},
                    {"role": "user", "content": "Thanks"}]
    out2 = render(later, tools=[WEATHER], enable_thinking=False)
    assert "Need the weather." not in out2  # before the last user message: dropped
    assert out2.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_other_templates():
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not supports_thinking(plain) and not supports_thinking(None)
    assert thinking_for(plain, "x<think>\n") is None
    assert thinking_kwargs(plain, False) == {}
    opens_itself = "{{ messages }}{# the model writes <think> itself #}"
    assert supports_thinking(opens_itself) and thinking_kwargs(opens_itself, False) == {}
    assert thinking_for(opens_itself, "<|im_start|>assistant\n") is False
