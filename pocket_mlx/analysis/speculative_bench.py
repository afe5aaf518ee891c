"""`pocket-mlx bench speculative`: decode speed with speculative decoding against without.

- default: `generate`'s decode tok/s with --speculative off, lookup (each K asked) and auto
  (K = 3), runs interleaved, on a copy-heavy raw prompt (code, then the start of its edited
  copy), greedy; every speculative reply must be token-identical to off's; drafted and
  accepted tokens, tokens per trunk pass.
- ordinary: the same over three ordinary raw prompts (English verse, a Chinese poem, Python)
  for the methods asked (default off, mtp K = 1, 2, 3, auto K = 3), summed over the three, with
  the MTP drafter's acceptance per depth (draft d kept, of the passes that drafted d) and the
  share of decode time spent in its head.
(docs/SPECULATIVE.md; scripts/bench_speculative.py keeps --verify-cost, a developer's tool.)
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from pocket_mlx import kernels
from pocket_mlx.analysis.bench import cpu_model
from pocket_mlx.engine.generation import stream_generate
from pocket_mlx.errors import PocketError

Say = Callable[[str], None]

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


def generate(model, tok, prompt: str, spec: str, k: int, n: int):
    """(token ids, final stats) of one greedy raw reply of up to `n` tokens."""
    toks, stats = [], None
    for r in stream_generate(model, tok, prompt, max_tokens=n, speculative=spec,
                             num_draft_tokens=k, raw=True):
        if r.token is not None:
            toks.append(r.token)
        stats = r.stats
    return toks, stats


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def tps_table(model, tok, *, name: str, ks: list[int], reps: int, n: int,
              say: Say = print) -> None:
    """The default mode's table (see the module's docstring)."""
    configs = [("off", 0)] + [("lookup", k) for k in ks] + [("auto", 3)]
    generate(model, tok, PROMPT, "off", 1, 16)  # warm-up
    runs: dict[tuple[str, int], list] = {c: [] for c in configs}
    ref = None
    for _ in range(reps):
        for spec, k in configs:
            toks, stats = generate(model, tok, PROMPT, spec, max(k, 1), n)
            if spec == "off":
                ref = toks
            elif toks != ref:
                raise PocketError(f"{spec} k={k}: the reply differs from --speculative off's")
            runs[(spec, k)].append(stats)
    off = [s.generation_tps for s in runs[("off", 0)]]
    base, base_med, base_best = statistics.fmean(off), statistics.median(off), max(off)
    say(f"model {name}, CPU {cpu_model()}, kernels {kernels.label()}, {len(ref)} tokens, "
        f"{reps} interleaved runs each, load average {os.getloadavg()[0]:.1f}\n")
    # On a shared machine the mean swings with other jobs; the median and the best run too.
    say("| method | K | decode tok/s | vs off | median | vs off | best | vs off | drafted | "
        "accepted | accepted/drafted | tokens/pass |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (spec, k), stats in runs.items():
        tps = [s.generation_tps for s in stats]
        m, sd = _mean_sd(tps)
        med, best = statistics.median(tps), max(tps)
        cols = (f"{m:.1f} ± {sd:.1f} | {m / base:.2f}x | {med:.1f} | {med / base_med:.2f}x | "
                f"{best:.1f} | {best / base_best:.2f}x")
        sp = stats[-1].speculative
        if sp is None:
            say(f"| off | - | {cols} | - | - | - | 1.00 |")
            continue
        rate = sp["accepted"] / sp["drafted"] if sp["drafted"] else 0.0
        per = stats[-1].generation_tokens / sp["passes"]
        say(f"| {spec} | {k} | {cols} | {sp['drafted']} | {sp['accepted']} | "
            f"{100 * rate:.0f}% | {per:.2f} |")


class DraftLog:
    """While entered, records the MTP drafter's passes, (drafted, accepted), and the seconds
    in its `draft` (the head's steps: `draft` ends reading the drafts, so its time is the
    head's); the drafter's methods are put back on exit."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, int]] = []
        self.seconds = 0.0

    def __enter__(self) -> DraftLog:
        from pocket_mlx.engine.mtp_drafter import MTPDrafter

        self._orig = orig_draft, orig_acc = MTPDrafter.draft, MTPDrafter.accepted
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
        return self

    def __exit__(self, *exc) -> None:
        from pocket_mlx.engine.mtp_drafter import MTPDrafter

        MTPDrafter.draft, MTPDrafter.accepted = self._orig

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


def parse_methods(text: str) -> list[tuple[str, int]]:
    """'off,mtp:1,auto:3' -> [("off", 0), ("mtp", 1), ("auto", 3)] (the first: the baseline)."""
    out = []
    for m in text.split(","):
        spec, _, k = m.partition(":")
        if spec not in ("off", "lookup", "mtp", "auto") or not (k == "" or k.isdigit()):
            raise PocketError(f"--methods takes METHOD[:K],... with METHOD off, lookup, mtp or "
                              f"auto, got {m!r}")
        out.append((spec, int(k or 0)))
    return out


def _ordinary_round(model, tok, configs, n: int, dlog: DraftLog, refs: dict) -> dict:
    """One interleaved round over the prompts: per config [tokens, seconds, drafted, accepted,
    passes, the drafter's passes, its seconds]."""
    acc = {c: [0, 0.0, 0, 0, 0, [], 0.0] for c in configs}
    for name, prompt in ORDINARY.items():
        for spec, k in configs:  # interleaved per prompt: a burst of load hits all alike
            toks, st = generate(model, tok, prompt, spec, max(k, 1), n)
            if spec == "off":
                refs[name] = toks
            elif name in refs and toks != refs[name]:
                raise PocketError(f"{spec} k={k} {name}: the reply differs from off's")
            p, h = dlog.take()
            a, sp = acc[(spec, k)], st.speculative or {}
            a[0] += st.generation_tokens
            a[1] += st.generation_tokens / st.generation_tps
            a[2] += sp.get("drafted", 0)
            a[3] += sp.get("accepted", 0)
            a[4] += sp.get("passes", st.generation_tokens)
            a[5] += p
            a[6] += h
    return acc


def ordinary_table(model, tok, *, name: str, methods: list[tuple[str, int]], reps: int, n: int,
                   say: Say = print) -> None:
    """The ordinary mode's table (see the module's docstring)."""
    rows: dict[tuple[str, int], list] = {c: [] for c in methods}
    refs: dict[str, list[int]] = {}
    with DraftLog() as dlog:
        generate(model, tok, ORDINARY["en"], "off", 1, 16)  # warm-up
        dlog.take()
        for _ in range(reps):
            acc = _ordinary_round(model, tok, methods, n, dlog, refs)
            for c, (tokens, secs, drafted, accepted, passes, plog, head_s) in acc.items():
                rows[c].append((tokens / secs, drafted, accepted, passes, tokens, plog,
                                head_s / secs))
    base = statistics.fmean(r[0] for r in rows[methods[0]])
    say(f"model {name}, CPU {cpu_model()}, kernels {kernels.label()}, {n} tokens x "
        f"{len(ORDINARY)} prompts ({', '.join(ORDINARY)}), {reps} interleaved runs each, load "
        f"{os.getloadavg()[0]:.1f}\n")
    say("| method | K | decode tok/s | vs off | drafted | accepted | accepted/drafted | "
        "tokens/pass | depth 1 | depth 2 | depth 3 | head time |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (spec, k), rs in rows.items():
        m, sd = _mean_sd([r[0] for r in rs])
        _, dr, ac, ps, nt, plog, _ = rs[-1]
        rate = f"{100 * ac / dr:.0f}%" if dr else "-"
        d = depth_rates(plog) if plog else ["-"] * 3
        head = f"{100 * statistics.fmean(r[6] for r in rs):.0f}%" if plog else "-"
        say(f"| {spec} | {k or '-'} | {m:.1f} ± {sd:.1f} | {m / base:.2f}x | {dr or '-'} | "
            f"{ac if dr else '-'} | {rate} | {nt / ps:.2f} | {' | '.join(d)} | {head} |")
