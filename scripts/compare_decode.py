"""Decode and prefill tok/s of `pocket_mlx.stream_generate` next to stock mlx-lm, same checkpoint,
same prompt, same run, interleaved (ours, theirs, ours, theirs ...).

    python scripts/compare_decode.py [--model assets/pocket-tiny] [-n 128] [-r 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

mx.set_default_device(mx.cpu)  # before mlx_lm.generate is imported: its stream is fixed then

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from pocket_mlx.engine.generation import stream_generate  # noqa: E402
from pocket_mlx.engine.loader import load  # noqa: E402

PROMPT = "Write a long story about the kings of old, their wars and their wisdom."


def ours(model, tok, ids, n):
    last = None
    for r in stream_generate(model, tok, ids, max_tokens=n, device="cpu"):
        last = r.stats
    return last.prompt_tps, last.generation_tps, last.generation_tokens


def theirs(model, tok, ids, n):
    """mlx-lm's own decode loop (`generate_step`), timed like ours: prefill until the first
    token, then tokens after the first over the time since it."""
    t0 = time.perf_counter()
    count, t_first = 0, None
    for _token, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(0.0)):
        count += 1
        if count == 1:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return len(ids) / (t_first - t0), (count - 1) / (t_end - t_first), count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assets/pocket-tiny")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    a = ap.parse_args()
    model, tok = load(a.model, device="cpu", fuse=True)
    lm_model, _ = load_model(Path(a.model))
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]),
                     add_special_tokens=False)
    lm_tok = None
    # EOS ignored (generate_step never stops on it) so every run decodes exactly n tokens.
    tok.eos_token_ids = []
    ours(model, tok, ids, 8)
    theirs(lm_model, lm_tok, ids, 8)
    res = {"ours": [], "mlx-lm": []}
    for _ in range(a.r):
        res["ours"].append(ours(model, tok, ids, a.n))
        res["mlx-lm"].append(theirs(lm_model, lm_tok, ids, a.n))
    print(f"model {a.model}, prompt {len(ids)} tokens, {a.n} decoded tokens, {a.r} runs, cpu")
    print("| impl | prefill tok/s | decode tok/s |")
    print("|---|---|---|")
    means = {}
    for k, v in res.items():
        pp = [x[0] for x in v]
        tg = [x[1] for x in v]
        means[k] = statistics.mean(tg)
        print(f"| {k} | {statistics.mean(pp):.1f} | {statistics.mean(tg):.1f} ± "
              f"{statistics.stdev(tg) if len(tg) > 1 else 0:.1f} |")
    print(f"decode ratio ours / mlx-lm: {means['ours'] / means['mlx-lm']:.2f}")


if __name__ == "__main__":
    main()
