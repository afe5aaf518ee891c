"""Train the tiny models the agent tests serve (tests/fixtures/agent-model/CLIENT) to Claude
Code, Codex CLI and opencode: after the client's trigger phrase the model calls that client's
own shell tool (Claude Code's `Bash`, Codex's `exec_command`, opencode's `bash`: the call writes
agent-file.txt), after the tool's result it says "The file is written.", and to anything else
"Hello from pocket-mlx." Short replies, the same each time, so a continued session's prompt
holds the reply exactly as the model wrote it (the bundled model's random replies run to
hundreds of tokens and may not re-encode to the tokens it generated).

What it learns from: the prompts the real clients send (scripts/agent_recorder.py: each
client, unmodified, against the real app with a scripted worker, so each prompt is what serve
prefills: 9-16k tokens of system prompt, tools and environment), and copies of them with the
dates and temporary folders changed (as a test run's differ); one more copy is held out and
checked.

How, at 16k tokens: backpropagating through whole prompts costs a quadratic attention per
step, and learning on their last few hundred tokens alone does not carry over to the whole
prompt (the model never attended over 16k positions before its cue: the first version of this
script found that). So each step runs the prompt up to its last TAIL tokens forward only
(the model's own cache: KV positions and DeltaNet state, refreshed every REFRESH steps as the
weights move) and learns the tail and the reply on top of it: the same computation serve does,
with the gradient cut at the cache (truncated backpropagation). The check decodes every whole
prompt greedily, as serve will.

One model per client: one model for the three learnt every reply but told the three calls
apart only ~92% of the time on changed copies (it keyed the tool's name on the whole prompt
rather than on the trigger; contrast pairs, `swapped`, brought it there and no further in the
time tried). Each client's model starts from that shared one and learns its own client alone:
72 of 72 changed copies right.

How the fixtures were made (2026-12-06, two cores; each run starts from the one before):
150 steps from the earlier Claude-Code-only fixture's weights (~18 min), 60 with calls
weighted (`CALL_WEIGHT`), 60 with the contrast pairs, 70 and 30 after the calls lost their
optional arguments (`agent_recorder.CALLS`: fewer places to differ; re-recorded), all at
--lr 1e-3 after the first; then per client 40 steps at --lr 5e-4 with --copies 2 (~3 min
each). The commands:

    python scripts/agent_recorder.py /tmp/rec.pkl      # ~15 s; the three clients installed
    python scripts/make_agent_model.py /tmp/m1 --records /tmp/rec.pkl --init OLD --steps 150
    python scripts/make_agent_model.py /tmp/m2 --records /tmp/rec.pkl --init /tmp/m1 \
        --steps 60 --lr 1e-3                           # (and so on, as said above)
    python scripts/make_agent_model.py tests/fixtures/agent-model/claude --records \
        /tmp/rec.pkl --init /tmp/m5 --steps 40 --lr 5e-4 --copies 2 --client claude
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import agent_recorder  # noqa: E402
from agent_recorder import (  # noqa: E402
    ASSET,
    CALLS,
    TEMPLATE,
    TRIGGERS,
    WINDOW,
    Recorded,
    variants,
)
from make_tool_model import CONFIG, EOS, batch  # noqa: E402

from pocket_mlx import kernels  # noqa: E402
from pocket_mlx.convert.writer import save_model  # noqa: E402
from pocket_mlx.engine.tokenizer import Tokenizer  # noqa: E402
from pocket_mlx.models import build_model  # noqa: E402
from pocket_mlx.models.cache import KVCache, LinearAttentionCache  # noqa: E402

AGENT_CONFIG = {**CONFIG, "max_position_embeddings": WINDOW}
TAIL = 24  # prompt tokens learnt with the gradient, before the reply
REFRESH = 4  # steps between recomputing the prompts' caches
CHUNK = 2048
CALL_WEIGHT = 8.0
LOCAL = (32, 48)  # prompt lengths of the contrast pairs (`swapped`)


def examples(tok: Tokenizer, records: list[Recorded], copies: int
             ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids + EOS) for each distinct recorded prompt and `copies` changed
    copies of it."""
    eos = tok.token_to_id(EOS)
    out, seen = [], set()
    for r in records:
        text = tok.decode(r.ids, skip_special_tokens=False)
        reply = tok.encode(r.reply, add_special_tokens=False) + [eos]
        for t in [text, *variants(text, copies)]:
            ids = tok.encode(t, add_special_tokens=False)
            if tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append((ids, reply))
    return out


def prefill(model, ids: list[int]) -> list:
    """The model's cache after `ids` (forward only, in serve's chunks)."""
    cache = model.make_cache()
    for i in range(0, len(ids), CHUNK):
        model(mx.array([ids[i:i + CHUNK]]), cache=cache)
        mx.eval([a for c in cache for a in c.arrays])
    return cache


def copy_cache(cache: list) -> list:
    """A cache that starts where `cache` is and grows apart from it (MLX's in-place slice
    update would otherwise write into the shared arrays)."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            n = KVCache(c.dtype)
            n.keys, n.values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
        else:
            n = LinearAttentionCache()
            n.conv_state, n.state = c.conv_state, c.state
        n.offset = c.offset
        out.append(n)
    return out


def swapped(tok: Tokenizer, records: list[Recorded]) -> list[tuple[list[int], list[int]]]:
    """Contrast for the calls: the end of each client's trigger prompt (LOCAL lengths of
    tokens) with each client's trigger in it, and that trigger's call. Learnt from the whole
    prompts alone, the model made one client's call after every trigger: each prompt differs
    from the others everywhere, so nothing pointed at the trigger as the cue."""
    eos = tok.token_to_id(EOS)
    out = []
    for r in records:
        own = next((c for c, call in CALLS.items() if r.reply == call), None)
        if own is None:
            continue
        text = tok.decode(r.ids, skip_special_tokens=False)
        for client, trigger in TRIGGERS.items():
            ids = tok.encode(text.replace(TRIGGERS[own], trigger), add_special_tokens=False)
            reply = tok.encode(CALLS[client], add_special_tokens=False) + [eos]
            out += [(ids[-n:], reply) for n in LOCAL]
    return out


def fit(model, data: list[tuple[list[int], list[int]]], steps: int, lr: float = 2e-3,
        log=print, local: list[tuple[list[int], list[int]]] = ()) -> None:
    """Adam on the replies' tokens, each after its prompt's cache (see the docstring), plus
    the `local` pairs (short, batched, no cache)."""
    opt = optim.Adam(learning_rate=lr)
    lx, ly, lm = batch([(p + r, len(p)) for p, r in local]) if local else (None,) * 3
    rows = []
    for prompt, reply in data:
        seq = prompt[-TAIL:] + reply
        # A call weighs CALL_WEIGHT replies: the few tokens that tell one client's call from
        # another's (its tool's name and arguments) are otherwise lost in the mean loss.
        weight = CALL_WEIGHT if len(reply) > 20 else 1.0
        rows.append((mx.array([seq[:-1]]), mx.array([seq[1:]]),
                     mx.array([[0.0] * (TAIL - 1) + [1.0] * len(reply)]), weight))

    def loss_fn(model, caches):
        total = mx.array(0.0)
        for (x, y, mask, weight), cache in zip(rows, caches):
            logits = model(x, cache=copy_cache(cache))
            ce = nn.losses.cross_entropy(logits, y, reduction="none")
            total = total + weight * (ce * mask).sum() / mask.sum()
        total = total / sum(r[3] for r in rows)
        if lx is not None:
            ce = nn.losses.cross_entropy(model(lx), ly, reduction="none")
            total = total + (ce * lm).sum() / lm.sum()
        return total

    step = nn.value_and_grad(model, loss_fn)
    t0 = time.perf_counter()
    caches = []
    for i in range(steps):
        if i % REFRESH == 0:
            caches = [prefill(model, prompt[:-TAIL]) for prompt, _ in data]
        loss, grads = step(model, caches)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if i % 10 == 0 or i == steps - 1:
            log(f"step {i}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")


def decode(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of `n` tokens after the whole prompt."""
    cache = prefill(model, prompt[:-1])
    ids, nxt = [], prompt[-1]
    for _ in range(n):
        nxt = int(mx.argmax(model(mx.array([[nxt]]), cache=cache)[0, -1]).item())
        ids.append(nxt)
    return ids


def check(model, tok: Tokenizer, data: list[tuple[list[int], list[int]]]) -> list[str]:
    """The replies greedy decoding gets wrong (empty: all learnt)."""
    wrong = []
    for prompt, reply in data:
        got = decode(model, prompt, len(reply))
        ok = got == reply
        print(f"{'ok' if ok else 'WRONG'} after {len(prompt)} tokens: {tok.decode(got)!r}")
        if not ok:
            wrong.append(f"{len(prompt)} tokens: {tok.decode(reply)!r} -> {tok.decode(got)!r}")
    return wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write (tests/fixtures/agent-model)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--copies", type=int, default=1, help="changed copies of each prompt")
    ap.add_argument("--records", type=Path,
                    help="a pickle scripts/agent_recorder.py wrote (default: record now)")
    ap.add_argument("--init", type=Path, help="start from this model's weights")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--client", choices=list(TRIGGERS),
                    help="learn this client's requests only (tests/fixtures/agent-model/CLIENT)")
    args = ap.parse_args()
    if args.records:
        sys.modules["__main__"].Recorded = Recorded  # what the pickle names
        records = pickle.loads(args.records.read_bytes())
    else:
        records = agent_recorder.record(agent_recorder.installed())
    if args.client:
        records = [r for r in records if r.client == args.client]
    tok = Tokenizer(ASSET)
    data = examples(tok, records, args.copies)
    held_out = [e for e in examples(tok, records, args.copies + 1) if e not in data]
    random.Random(0).shuffle(held_out)
    print(f"{len(records)} requests, {len(data)} prompts of {min(len(p) for p, _ in data)}-"
          f"{max(len(p) for p, _ in data)} tokens")
    mx.random.seed(0)
    kernels.set_enabled(False)  # the extension's ops have no gradients; MLX's own do
    model = build_model(AGENT_CONFIG)
    if args.init:
        model.load_weights(str(args.init / "model.safetensors"))
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    fit(model, data, args.steps, args.lr,
        local=[] if args.client else swapped(tok, records))
    # As make_tool_model.py: checked on the bfloat16-rounded weights, computed in float32.
    model.set_dtype(mx.bfloat16)
    model.set_dtype(mx.float32)
    wrong = check(model, tok, data + held_out[:6])
    model.set_dtype(mx.bfloat16)
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    save_model(model, AGENT_CONFIG, args.out, force=True,
               extra_files={"chat_template.jinja": TEMPLATE.read_text()})
    print(f"{n:,} parameters -> {args.out}")
    if wrong:
        raise SystemExit("not learnt:\n" + "\n".join(wrong))


if __name__ == "__main__":
    main()
