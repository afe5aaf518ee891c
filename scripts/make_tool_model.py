"""Train the tiny model that tests/test_server_tools.py serves: it has learnt, by heart, to
answer a few conversations with tools the way a tool-using model does (a `<tool_call>` in
Qwen3.5's format, then a sentence once the tool's result comes back).

Why a trained model: the bundled pocket-tiny never emits a tool call, and a round trip through
the real server, the real chat template and mlx-lm's real parser needs a model that does.
The prompts are rendered by the server's own code (`parse_chat` + `render_chat`), so the model
learns exactly the token sequences the server will feed it.

    python scripts/make_tool_model.py tests/fixtures/tool-model
    # 100 full-batch Adam steps: ~3 min of CPU (2 cores); the loss is ~1e-4 by then

The architecture is ours (Qwen3.5-MoE: Gated DeltaNet + full attention, sparse MoE) at toy
size, with the bundled model's tokenizer and scripts/tool_template.jinja as its chat template.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocket_mlx import kernels  # noqa: E402
from pocket_mlx.convert.writer import save_model  # noqa: E402
from pocket_mlx.engine.tokenizer import Tokenizer  # noqa: E402
from pocket_mlx.models import build_model  # noqa: E402
from pocket_mlx.server.openai import parse_chat  # noqa: E402
from pocket_mlx.server.prompts import render_chat  # noqa: E402

ASSET = ROOT / "assets" / "pocket-tiny"
TEMPLATE = ROOT / "scripts" / "tool_template.jinja"
EOS = "<|im_end|>"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "</function>\n</tool_call>")
CALL_TIME = ("<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n"
             "</function>\n</tool_call>")
RESULT = "22 C, sunny"
ANSWER = "It is 22 C and sunny in Paris."
NO_TOOLS = "I cannot look that up."


def after_call(call_id: str = "call_1") -> list[dict]:
    """The conversation once get_weather was called and answered (OpenAI's shape)."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


# (OpenAI request body, the reply the model learns after the rendered prompt). The forced
# starts of tool_choice "required" / a named function are part of the prompt, so the model
# learns only what follows them.
CASES: list[tuple[dict, str]] = [
    ({"messages": QUESTION, "tools": TOOLS}, CALL_WEATHER),
    ({"messages": QUESTION, "tools": TOOLS, "tool_choice": "required"},
     CALL_WEATHER[len("<tool_call>"):]),
    ({"messages": QUESTION, "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     CALL_TIME[len("<tool_call>\n<function=get_time>\n"):]),
    ({"messages": after_call(), "tools": TOOLS}, ANSWER),
    ({"messages": QUESTION}, NO_TOOLS),
    ({"messages": QUESTION, "tools": TOOLS, "tool_choice": "none"}, NO_TOOLS),
]

CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 8192, "hidden_size": 64,
    "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048, "eos_token_id": 8191, "pad_token_id": 8189,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
}


def sequences(tok: Tokenizer) -> list[tuple[list[int], int]]:
    """(prompt + reply tokens, prompt length) per case, the prompt rendered by the server."""
    out = []
    eos = tok.token_to_id(EOS)
    for body, reply in CASES:
        req = parse_chat({**body, "temperature": 0})
        prompt = tok.encode(render_chat(tok, req), add_special_tokens=False)
        out.append((prompt + tok.encode(reply, add_special_tokens=False) + [eos], len(prompt)))
    return out


def train(steps: int = 300, seed: int = 0, log=print) -> tuple[nn.Module, Tokenizer]:
    tok = Tokenizer(ASSET)
    tok.chat_template = TEMPLATE.read_text()
    return fit(sequences(tok), steps, seed, log), tok


def batch(data: list[tuple[list[int], int]]) -> tuple[mx.array, mx.array, mx.array]:
    """One batch of every (tokens, prompt length) sequence, right-padded: inputs, targets and
    a mask that counts the reply's tokens only."""
    T = max(len(s) for s, _ in data) - 1
    xs, ys, ms = [], [], []
    for s, n in data:
        ids = s + [0] * (T + 1 - len(s))
        xs.append(ids[:-1])
        ys.append(ids[1:])
        ms.append([1.0 if n - 1 <= i < len(s) - 1 else 0.0 for i in range(T)])
    return mx.array(xs), mx.array(ys), mx.array(ms)


def fit(data: list[tuple[list[int], int]], steps: int, seed: int = 0, log=print,
        config: dict | None = None) -> nn.Module:
    """A model of `config` (CONFIG) trained on (tokens, prompt length) sequences: full-batch
    Adam, the loss on the reply tokens only (scripts/make_think_model.py and
    make_agent_model.py train with it too)."""
    mx.random.seed(seed)
    kernels.set_enabled(False)  # the extension's ops have no gradients; MLX's own do
    model = build_model(config or CONFIG)
    mx.eval(model.parameters())
    opt = optim.Adam(learning_rate=3e-3)

    def loss_fn(model, x, y, mask):
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="none")
        return (ce * mask).sum() / mask.sum()

    x, y, mask = batch(data)
    step = nn.value_and_grad(model, loss_fn)
    t0 = time.perf_counter()
    for i in range(steps):
        loss, grads = step(model, x, y, mask)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if i % 50 == 0 or i == steps - 1:
            log(f"step {i}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")
    kernels.set_enabled(True)
    return model


def check(model: nn.Module, tok: Tokenizer) -> None:
    """Greedy decoding reproduces every reply (else: train longer)."""
    for (seq, n), (_, reply) in zip(sequences(tok), CASES):
        ids = list(seq[:n])
        for _ in range(len(seq) - n):
            ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
        if ids != seq:
            raise SystemExit(f"not learnt: {reply!r} -> {tok.decode(ids[n:])!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write (tests/fixtures/tool-model)")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    model, tok = train(args.steps)
    # Stored in bfloat16 (half the bytes in git); the server computes in float32 on the CPU,
    # so the check runs on the rounded weights in float32, as the server will.
    model.set_dtype(mx.bfloat16)
    model.set_dtype(mx.float32)
    check(model, tok)
    model.set_dtype(mx.bfloat16)
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    # No tokenizer files: the test copies the bundled model's next to these.
    save_model(model, CONFIG, args.out, force=True,
               extra_files={"chat_template.jinja": TEMPLATE.read_text()})
    print(f"{n:,} parameters -> {args.out}")


if __name__ == "__main__":
    main()
