"""Speculative decoding, measured (docs/SPECULATIVE.md).

Two measurements:

  tok/s (default): `generate`'s decode tok/s with --speculative off against lookup (K in
  --k) and auto (K = 3), runs interleaved, on a copy-heavy prompt (code to repeat with an edit), greedy; also
  checks each speculative reply is token-identical to off and reports drafted / accepted.

    python scripts/bench_speculative.py [--model PATH] [--k 2,3,4] [--reps 3] [-n 256]

  --ordinary: the same over three ordinary raw prompts (English verse, Chinese poem, Python),
  for the methods in --methods (default off, mtp K = 1, 2, 3, auto), summed over the three;
  adds the MTP drafter's acceptance per depth (draft d kept, of the passes that drafted d)
  and the share of decode time spent in its head (drafting) against the rest (verify passes).

    python scripts/bench_speculative.py --ordinary [--methods off,mtp:1,mtp:2,mtp:3,auto:3]

  --verify-cost: the time of one verify pass of L = k + 1 rows against one one-token decode
  step (k = 1..--max-k), on any model (the 35B shape: --model synthetic:pocket-35b-e128, run
  under `flock /work/wt/heavy.lock`), with the experts the L tokens route to (distinct per
  layer) and the weight bytes that implies against one step's.

    python scripts/bench_speculative.py --verify-cost --model synthetic:pocket-35b-e128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pocket_mlx import kernels  # noqa: E402
from pocket_mlx.analysis.bench import cpu_model  # noqa: E402
from pocket_mlx.engine.generation import stream_generate  # noqa: E402
from pocket_mlx.engine.loader import load, model_weight_stats  # noqa: E402
from pocket_mlx.models.verify import commit, verify_forward  # noqa: E402

CODE = """def load_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            name, value = line.strip().split(",")
            rows.append((name, float(value)))
    return rows


def total(rows):
    return sum(value for _, value in rows)


def largest(rows, n=3):
    return sorted(rows, key=lambda r: r[1], reverse=True)[:n]
"""
# Code editing: the module, then the start of its edited copy; the model continues the copy
# (raw text, no chat template: the bundled model is too small to follow an instruction).
PROMPT = "# original\n" + CODE + "\n# edited: total renamed to grand_total\n" + CODE[:120]


ORDINARY = {
    "en": "And it came to pass, when the king had heard these words,",
    "zh": "春眠不觉晓，",
    "code": "def parse_args(argv):\n    ",
}


class DraftLog:
    """Records the MTP drafter's passes: (drafted, accepted) and the seconds in its `draft`
    (the head's steps; `draft` ends reading the drafts, so its time is the head's)."""

    def __init__(self) -> None:
        from pocket_mlx.engine.mtp_drafter import MTPDrafter

        self.passes: list[tuple[int, int]] = []
        self.seconds = 0.0
        orig_draft, orig_acc = MTPDrafter.draft, MTPDrafter.accepted
        log = self

        def draft(self, tokens, k):
            t = time.perf_counter()
            out = orig_draft(self, tokens, k)
            log.seconds += time.perf_counter() - t
            return out

        def accepted(self, drafted, accepted, hidden=None):
            if drafted:
                log.passes.append((drafted, accepted))
            return orig_acc(self, drafted, accepted, hidden)

        MTPDrafter.draft, MTPDrafter.accepted = draft, accepted

    def take(self) -> tuple[list[tuple[int, int]], float]:
        out = self.passes, self.seconds
        self.passes, self.seconds = [], 0.0
        return out


def depth_rates(passes: list[tuple[int, int]], depth: int = 3) -> list[str]:
    """Per depth d: passes that kept draft d / passes that drafted d with drafts < d kept."""
    out = []
    for d in range(1, depth + 1):
        reached = sum(1 for n, a in passes if n >= d and a >= d - 1)
        kept = sum(1 for n, a in passes if n >= d and a >= d)
        out.append(f"{100 * kept / reached:.0f}% ({kept}/{reached})" if reached else "-")
    return out


def ordinary_table(args, model, tok) -> None:
    configs = []
    for m in args.methods.split(","):
        spec, _, k = m.partition(":")
        configs.append((spec, int(k or 0)))
    dlog = DraftLog()
    run(model, tok, ORDINARY["en"], "off", 1, 16)  # warm-up
    rows: dict[tuple[str, int], list] = {c: [] for c in configs}
    refs: dict[str, list[int]] = {}
    for _ in range(args.reps):
        acc = {c: [0, 0.0, 0, 0, 0, [], 0.0] for c in configs}  # per config, over the prompts
        for name, prompt in ORDINARY.items():
            for spec, k in configs:  # interleaved per prompt: a burst of load hits all alike
                toks, st = run(model, tok, prompt, spec, max(k, 1), args.n)
                if spec == "off":
                    refs[name] = toks
                elif toks != refs[name]:
                    raise SystemExit(f"{spec} k={k} {name}: reply differs from off")
                p, h = dlog.take()
                a = acc[(spec, k)]
                sp = st.speculative or {}
                a[0] += st.generation_tokens
                a[1] += st.generation_tokens / st.generation_tps
                a[2] += sp.get("drafted", 0)
                a[3] += sp.get("accepted", 0)
                a[4] += sp.get("passes", st.generation_tokens)
                a[5] += p
                a[6] += h
        for c, (tokens, secs, drafted, accepted, passes, plog, head_s) in acc.items():
            rows[c].append((tokens / secs, drafted, accepted, passes, tokens, plog,
                            head_s / secs))
    base = statistics.fmean(r[0] for r in rows[configs[0]])
    print(f"model {args.model}, CPU {cpu_model()}, kernels {kernels.label()}, "
          f"{args.n} tokens x {len(ORDINARY)} prompts ({', '.join(ORDINARY)}), "
          f"{args.reps} interleaved runs each, load {os.getloadavg()[0]:.1f}\n")
    print("| method | K | decode tok/s | vs off | drafted | accepted | accepted/drafted | "
          "tokens/pass | depth 1 | depth 2 | depth 3 | head time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (spec, k), rs in rows.items():
        tps = [r[0] for r in rs]
        m, sd = statistics.fmean(tps), statistics.stdev(tps) if len(tps) > 1 else 0.0
        _, dr, ac, ps, nt, plog, hs = rs[-1]
        rate = f"{100 * ac / dr:.0f}%" if dr else "-"
        d = depth_rates(plog) if plog else ["-"] * 3
        head = f"{100 * statistics.fmean(r[6] for r in rs):.0f}%" if plog else "-"
        print(f"| {spec} | {k or '-'} | {m:.1f} ± {sd:.1f} | {m / base:.2f}x | {dr or '-'} | "
              f"{ac if dr else '-'} | {rate} | {nt / ps:.2f} | {' | '.join(d)} | {head} |")


def run(model, tok, prompt: str, spec: str, k: int, n: int):
    toks, stats = [], None
    for r in stream_generate(
        model, tok, prompt, max_tokens=n, speculative=spec, num_draft_tokens=k, raw=True
    ):
        if r.token is not None:
            toks.append(r.token)
        stats = r.stats
    return toks, stats


def tps_table(args, model, tok) -> None:
    ks = [int(x) for x in args.k.split(",")]
    configs = [("off", 0)] + [("lookup", k) for k in ks] + [("auto", 3)]
    run(model, tok, PROMPT, "off", 1, 16)  # warm-up
    runs: dict[tuple[str, int], list] = {c: [] for c in configs}
    ref = None
    for _ in range(args.reps):
        for spec, k in configs:
            toks, stats = run(model, tok, PROMPT, spec, max(k, 1), args.n)
            if spec == "off":
                ref = toks
            elif toks != ref:
                raise SystemExit(f"{spec} k={k}: reply differs from off")
            runs[(spec, k)].append(stats)
    off = [s.generation_tps for s in runs[("off", 0)]]
    base, base_med, base_best = statistics.fmean(off), statistics.median(off), max(off)
    print(
        f"model {args.model}, CPU {cpu_model()}, kernels {kernels.label()}, "
        f"{len(ref)} tokens, {args.reps} interleaved runs each, load average "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    # On a shared machine the mean swings with other jobs; the median and the best run too.
    print(
        "| method | K | decode tok/s | vs off | median | vs off | best | vs off | drafted | "
        "accepted | accepted/drafted | tokens/pass |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (spec, k), stats in runs.items():
        tps = [s.generation_tps for s in stats]
        m, sd = statistics.fmean(tps), statistics.stdev(tps) if len(tps) > 1 else 0.0
        med, best = statistics.median(tps), max(tps)
        cols = (
            f"{m:.1f} ± {sd:.1f} | {m / base:.2f}x | {med:.1f} | {med / base_med:.2f}x | "
            f"{best:.1f} | {best / base_best:.2f}x"
        )
        sp = stats[-1].speculative
        if sp is None:
            print(f"| off | - | {cols} | - | - | - | 1.00 |")
            continue
        rate = sp["accepted"] / sp["drafted"] if sp["drafted"] else 0.0
        per = stats[-1].generation_tokens / sp["passes"]
        print(
            f"| {spec} | {k} | {cols} | {sp['drafted']} | "
            f"{sp['accepted']} | {100 * rate:.0f}% | {per:.2f} |"
        )


def _distinct_experts(model, cache, rows: mx.array) -> float:
    """Mean over MoE layers of the distinct experts `rows` route to (observer hook)."""
    seen: list[int] = []
    for layer in model.layers:
        layer.mlp.observer = lambda x, inds, *_: seen.append(len(set(inds.flatten().tolist())))
    try:
        logits, _, tape = verify_forward(model, rows, cache)
        mx.eval(logits)
        commit(cache, tape, 1)
    finally:
        for layer in model.layers:
            layer.mlp.observer = None
    return statistics.fmean(seen)


def verify_cost(args, model, tok) -> None:
    ids = tok.encode(CODE) if tok is not None else list(range(1, 200))
    ids = [i % model.args.vocab_size for i in ids][: args.context]
    cache = model.make_cache()
    model(mx.array(ids[:-1])[None], cache=cache)
    mx.eval([a for c in cache for a in c.arrays])
    ws = model_weight_stats(model)
    sw = model.layers[0].mlp.switch_mlp
    per_expert = (
        sum(
            v.nbytes
            for p in (sw.gate_proj, sw.up_proj, sw.down_proj)
            for v in p.parameters().values()
        )
        // model.args.num_experts
    )
    n_layers = len(model.layers)
    dense = ws.bytes_per_token - n_layers * model.args.num_experts_per_tok * per_expert

    def snapshot():
        return [
            (c.offset, getattr(c, "conv_state", None), c.state)
            if hasattr(c, "conv_state")
            else (c.offset,)
            for c in cache
        ]

    def restore(snap) -> None:
        for c, s in zip(cache, snap):
            if len(s) == 3:
                c.offset, c.conv_state, c.state = s
            else:
                c.trim(c.offset - s[0])

    def pass_time(L: int) -> float:
        rows = mx.array([ids[(i * 7) % len(ids)] for i in range(L)], mx.uint32)
        snap = snapshot()
        t = time.perf_counter()
        if L == 1:  # the plain decode step
            mx.eval(model(rows[None], cache=cache))
        else:
            logits, _, tape = verify_forward(model, rows, cache)
            mx.eval(logits)
            commit(cache, tape, 1)
        t = time.perf_counter() - t
        restore(snap)
        return t

    # Rounds over every L in turn (the step and each pass size), so that a burst of load on a
    # shared machine hits them alike; median and minimum over the rounds.
    Ls = list(range(1, args.max_k + 2))
    for L in Ls:
        pass_time(L)
    times: dict[int, list[float]] = {L: [] for L in Ls}
    for _ in range(args.reps):
        for L in Ls:
            times[L].append(pass_time(L))
    one, one_min = statistics.median(times[1]), min(times[1])
    print(
        f"model {args.model}, CPU {cpu_model()}, kernels {kernels.label()}, median and minimum "
        f"of {args.reps} interleaved rounds, load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        f"one-token decode step: {1e3 * one:.1f} ms (min {1e3 * one_min:.1f}); weights read per "
        f"token {ws.bytes_per_token / 1e9:.3f} GB\n"
    )
    print(
        "| k | rows | verify pass ms | vs one step | min ms | min vs min | "
        "distinct experts/layer | weight bytes vs one step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for L in Ls[1:]:
        t, t_min = statistics.median(times[L]), min(times[L])
        rows = mx.array([ids[(i * 7) % len(ids)] for i in range(L)], mx.uint32)
        snap = snapshot()
        e = _distinct_experts(model, cache, rows)
        restore(snap)
        bytes_ratio = (dense + n_layers * e * per_expert) / ws.bytes_per_token
        print(
            f"| {L - 1} | {L} | {1e3 * t:.1f} | {t / one:.2f}x | {1e3 * t_min:.1f} | "
            f"{t_min / one_min:.2f}x | {e:.1f} | {bytes_ratio:.2f}x |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/pocket-tiny")
    ap.add_argument("--k", default="2,3,4", help="draft lengths for lookup (tok/s mode)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", type=int, default=256, help="tokens per reply (tok/s mode)")
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--ordinary", action="store_true",
                    help="three ordinary prompts (en, zh, code), methods from --methods")
    ap.add_argument("--methods", default="off,mtp:1,mtp:2,mtp:3,auto:3",
                    help="METHOD[:K],... for --ordinary (the first is the baseline)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens (verify-cost)")
    args = ap.parse_args()
    model, tok = load(args.model, device="cpu", fuse=True)
    if args.verify_cost:
        verify_cost(args, model, tok)
    elif args.ordinary:
        ordinary_table(args, model, tok)
    else:
        tps_table(args, model, tok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
