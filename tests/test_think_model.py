"""The thinking test model (tests/fixtures/think-model, trained by scripts/make_think_model.py
with Qwen3.5's real chat template): greedy decoding gives back what it learnt, reasoning and
answer apart, with thinking on and off, and a tool call after reasoning; and `pocket-mlx
generate` on it as users run it (a real subprocess): the reasoning on stderr, the answer on
stdout, `--json`, `--reasoning on|off`, `--reasoning-budget`, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_think_model as tm  # noqa: E402

from pocket_mlx.engine.generation import stream_generate  # noqa: E402
from pocket_mlx.engine.loader import load  # noqa: E402
from pocket_mlx.engine.reasoning import CLOSE_TAG, split_reasoning  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "think-model"


@pytest.fixture(scope="module")
def think():
    return load(FIXTURE, device="cpu")


def reply(think, messages, tools=None, enable_thinking=None) -> tuple[str, str, object]:
    model, tok = think
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompt = tok.encode(tok.apply_chat_template(messages, tools=tools, **kw),
                        add_special_tokens=False)
    thinking = enable_thinking is not False  # the prompt ends inside the block unless off
    r = t = ""
    for x in stream_generate(model, tok, prompt, max_tokens=80, temperature=0.0,
                             thinking=thinking):
        r, t, stats = r + x.reasoning, t + x.text, x.stats
    return r, t, stats


def test_the_fixture_uses_qwen35s_template(think):
    assert (FIXTURE / "chat_template.jinja").read_text() == tm.TEMPLATE.read_text()
    assert think[1].chat_template == tm.TEMPLATE.read_text()


@pytest.mark.parametrize("i", range(len(tm.CASES)))
def test_greedy_replies_as_trained(think, i):
    messages, tools, enable_thinking, learnt = tm.CASES[i]
    r, t, stats = reply(think, messages, tools, enable_thinking)
    inside = enable_thinking is not False
    assert (r, t) == split_reasoning(learnt, inside) and stats.finish_reason == "eos"
    assert CLOSE_TAG not in t and bool(r) == inside
    assert (stats.reasoning_tokens > 0) == inside


def test_batch_decoder_splits_the_tool_call_case(think):
    """The server's decoder on the conversation that thinks, then calls a tool: the call is
    the answer text (for the tool parser), the reasoning apart."""
    from pocket_mlx.engine import devices
    from pocket_mlx.engine.batch import BatchDecoder, Finished, Token
    from pocket_mlx.engine.generation import SamplingParams
    from pocket_mlx.engine.reasoning import thinking_for

    model, tok = think

    class Stored:
        def store(self, *a, **k) -> None:
            pass

    dec = BatchDecoder(model, tok, stream=devices.stream_for("cpu"), store=Stored())
    text = tok.apply_chat_template(tm.WEATHER_Q, tools=tm.TOOLS)
    thinking = thinking_for(tok.chat_template, text)
    assert thinking is True
    dec.insert(tok.encode(text, add_special_tokens=False), cache=model.make_cache(), n_cached=0,
               sampling=SamplingParams(), max_tokens=80, room=1000, thinking=thinking)
    r = t = ""
    while len(dec):
        for ev in dec.step():
            if isinstance(ev, (Token, Finished)):
                r, t = r + ev.reasoning, t + ev.text
            if isinstance(ev, Finished):
                assert ev.reason == "eos" and ev.reasoning_tokens > 0
    assert (r, t) == (tm.TOOL_REASONING, tm.CALL)


# ---- `pocket-mlx generate` ----------------------------------------------------------------
def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "generate", "--model",
                           str(FIXTURE), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_reasoning_to_stderr_answer_to_stdout():
    r = cli("--prompt", "What is 2 + 3?")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tm.ADD_ANSWER + "\n"
    assert r.stderr.startswith(tm.ADD_REASONING + "\n")
    assert "reasoning: " in r.stderr.splitlines()[-1]


def test_generate_json_gives_reasoning_beside_text():
    out = json.loads(cli("--prompt", "What is 2 + 3?", "--json").stdout)
    assert (out["reasoning"], out["text"]) == (tm.ADD_REASONING, tm.ADD_ANSWER)
    assert out["reasoning_tokens"] > 0 and out["finish_reason"] == "eos"
    on = json.loads(cli("--prompt", "What is 2 + 3?", "--json", "--reasoning", "on").stdout)
    assert on["text"] == out["text"] and on["reasoning"] == out["reasoning"]


def test_generate_reasoning_off():
    r = cli("--prompt", "What is 2 + 3?", "--reasoning", "off")
    assert r.returncode == 0, r.stderr
    assert r.stdout == tm.ADD_DIRECT + "\n" and tm.ADD_REASONING not in r.stderr
    out = json.loads(cli("--prompt", "Name a colour.", "--reasoning", "off", "--json").stdout)
    assert (out["reasoning"], out["text"], out["reasoning_tokens"]) == ("", tm.COLOUR_DIRECT, 0)


def test_generate_reasoning_budget():
    out = json.loads(cli("--prompt", "What is 2 + 3?", "--json", "--reasoning-budget", "3",
                         "-n", "12").stdout)
    assert out["reasoning_tokens"] == 3
    assert tm.ADD_REASONING.startswith(out["reasoning"]) and out["reasoning"]
    assert CLOSE_TAG not in out["text"] and "<think>" not in out["text"]


@pytest.mark.parametrize("args,needle", [
    (["--reasoning", "maybe"], "invalid choice: 'maybe'"),
    (["--reasoning-budget", "-1"], "must be 0 or more tokens"),
    (["--reasoning-budget", "many"], "expected an integer"),
    (["--raw", "--reasoning", "on"], "--raw renders no chat template"),
    (["--raw", "--reasoning-budget", "4"], "--raw renders no chat template"),
])
def test_generate_bad_reasoning_values_are_one_line_errors(args, needle):
    r = cli("--prompt", "hi", *args)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
