"""Train the tiny thinking model of tests/fixtures/think-model: with Qwen3.5's real chat template
(tests/fixtures/templates/qwen3.5.jinja), it has learnt by heart to answer a few conversations
the way Qwen3.5 does: from the generation prompt `<think>\\n`, a brief reasoning, `</think>\\n\\n`,
then the answer; with thinking off (the prompt ends `<think>\\n\\n</think>\\n\\n`) the answer at
once; and, in one conversation, reasoning and then a tool call in Qwen3.5's format.

Why a trained model: the bundled pocket-tiny never closes a reasoning block, and the chat, the
generate command and the server's reasoning fields need a model that does, end to end. The
prompts are rendered by pocket-mlx's own template code (`Tokenizer.apply_chat_template`, the
sandboxed renderer every command uses), so the model learns the token sequences it will be fed.

    python scripts/make_think_model.py tests/fixtures/think-model
    # 150 full-batch Adam steps: ~17 min on 2 shared cores; the loss is ~3e-4 by then

The architecture is ours (Qwen3.5-MoE at toy size, as scripts/make_tool_model.py) with the
bundled model's tokenizer, which the fixture carries so `pocket-mlx chat --model
tests/fixtures/think-model` runs as is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_tool_model import CONFIG, WEATHER, fit  # noqa: E402

from pocket_mlx.convert.writer import save_model  # noqa: E402
from pocket_mlx.engine.reasoning import CLOSE_TAG  # noqa: E402
from pocket_mlx.engine.tokenizer import Tokenizer  # noqa: E402

ASSET = ROOT / "assets" / "pocket-tiny"
TEMPLATE = ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja"
EOS = "<|im_end|>"

ADD = [{"role": "user", "content": "What is 2 + 3?"}]
ADD_REASONING = "The user asks for 2 + 3. Two plus three is five."
ADD_ANSWER = "2 + 3 = 5."
ADD_DIRECT = "5."
COLOUR = [{"role": "user", "content": "Name a colour."}]
COLOUR_REASONING = "Any colour will do. I pick blue."
COLOUR_ANSWER = "Blue."
COLOUR_DIRECT = "Red."
# A second turn after the first (its reasoning dropped by the template, as Qwen3.5 renders it).
MORE = ADD + [{"role": "assistant", "content": ADD_ANSWER},
              {"role": "user", "content": "And 4 + 4?"}]
MORE_REASONING = "Now 4 + 4. Four plus four is eight."
MORE_ANSWER = "4 + 4 = 8."
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_REASONING = "The user wants the weather in Paris. I call get_weather."
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>")
RESULT = "22 C, sunny"
AFTER_CALL = WEATHER_Q + [
    {"role": "assistant", "content": "", "reasoning_content": TOOL_REASONING,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
RESULT_REASONING = "The tool says 22 C and sunny."
RESULT_ANSWER = "It is 22 C and sunny in Paris."
TOOLS = [WEATHER]


def thought(reasoning: str, answer: str) -> str:
    """A reply after the prompt's `<think>\\n`, as Qwen3.5 writes (and its template renders) it."""
    return f"{reasoning}\n{CLOSE_TAG}\n\n{answer}"


# (messages, tools, enable_thinking (None: the template's default, on), the reply learnt).
CASES: list[tuple[list[dict], list[dict] | None, bool | None, str]] = [
    (ADD, None, None, thought(ADD_REASONING, ADD_ANSWER)),
    (ADD, None, False, ADD_DIRECT),
    (COLOUR, None, None, thought(COLOUR_REASONING, COLOUR_ANSWER)),
    (COLOUR, None, False, COLOUR_DIRECT),
    (MORE, None, None, thought(MORE_REASONING, MORE_ANSWER)),
    (WEATHER_Q, TOOLS, None, thought(TOOL_REASONING, CALL)),
    (AFTER_CALL, TOOLS, None, thought(RESULT_REASONING, RESULT_ANSWER)),
]


def render(tok: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
           enable_thinking: bool | None = None) -> str:
    """The prompt as pocket-mlx renders it (the template's sandbox, its keywords)."""
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tok.apply_chat_template(messages, tools=tools, **extra)


def sequences(tok: Tokenizer) -> list[tuple[list[int], int]]:
    """(prompt + reply tokens, prompt length) per case."""
    out = []
    eos = tok.token_to_id(EOS)
    for messages, tools, thinking, reply in CASES:
        prompt = tok.encode(render(tok, messages, tools, thinking), add_special_tokens=False)
        out.append((prompt + tok.encode(reply, add_special_tokens=False) + [eos], len(prompt)))
    return out


def tokenizer() -> Tokenizer:
    tok = Tokenizer(ASSET)
    tok.chat_template = TEMPLATE.read_text()
    return tok


def check(model, tok: Tokenizer) -> None:
    """Greedy decoding reproduces every reply (else: train longer)."""
    for (seq, n), case in zip(sequences(tok), CASES):
        ids = list(seq[:n])
        for _ in range(len(seq) - n):
            ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
        if ids != seq:
            raise SystemExit(f"not learnt: {case[-1]!r} -> {tok.decode(ids[n:])!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write (tests/fixtures/think-model)")
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    tok = tokenizer()
    model = fit(sequences(tok), args.steps)
    # Stored in bfloat16 (half the bytes in git); checked on the rounded weights in float32,
    # as the CPU runs them.
    model.set_dtype(mx.bfloat16)
    model.set_dtype(mx.float32)
    check(model, tok)
    model.set_dtype(mx.bfloat16)
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    files = {"chat_template.jinja": TEMPLATE.read_text()}
    for f in ("tokenizer.json", "tokenizer_config.json"):
        files[f] = (ASSET / f).read_text()
    save_model(model, CONFIG, args.out, force=True, extra_files=files)
    print(f"{n:,} parameters -> {args.out}")


if __name__ == "__main__":
    main()
