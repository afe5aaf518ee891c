#!/usr/bin/env python
"""Does a user's `pocket-mlx generate` run at `pocket-mlx bench` speed? (issue 16)

Runs, as separate processes and interleaved ROUNDS times (default 2):
    pocket-mlx bench --synthetic NAME -p P -n N -r 1 --device cpu -o json
    pocket-mlx generate --model synthetic:NAME --device cpu --json --raw --prompt <P tokens> -n N
and compares generate's prefill and decode tok/s (its own stats: prompt_tps, generation_tps)
with bench's ppP and tgN (medians over the rounds). Exit 1 when either is off by more than
--tolerance (default 10%). bench warms up before it measures; generate is a cold process, as a
user's is, so its prefill includes first-call costs: that is part of what this checks. Those
are a one-time ~0.3-0.5 s on pocket-35b-e128 here (the first prefill of a process first-touches
~200 MB of working memory: ~50k page faults against ~12k for the next one), which is 13% of a
32-token prompt's prefill and within the noise for the default 128 tokens.

The synthetic folder is written once into the cache (~6 GB for pocket-35b-e128, see
convert/synthetic.py) by the first command and reused. For a quick check: --model tiny.

    python scripts/check_user_path.py [--model pocket-35b-e128] [-p 128] [-n 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocket_mlx.engine.tokenizer import load_tokenizer  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog while seven wise old kings count "
         "their golden rings beside a quiet river under the pale northern sky").split()


def prompt_of(n_tokens: int, variant: int) -> str:
    """Plain text of about `n_tokens` tokens (the synthetic models share the bundled tokenizer)."""
    tok = load_tokenizer(ROOT / "assets" / "pocket-tiny")
    words, i = [], variant
    while len(tok.encode(" ".join(words))) < n_tokens:
        words.append(WORDS[i % len(WORDS)])
        i += 7
    return " ".join(words)


def run(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pocket_mlx", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"pocket-mlx {args[0]} failed ({r.returncode}): {tail}")
    return json.loads(r.stdout)


def bench(name: str, p: int, n: int) -> dict[str, float]:
    out = run(["bench", "--synthetic", name, "-p", str(p), "-n", str(n), "-r", "1",
               "--device", "cpu", "-o", "json", "-q"])
    rows = {row["test"]: row["tps_mean"] for row in out["rows"]}
    return {"pp": rows[f"pp{p}"], "tg": rows[f"tg{n}"]}


def generate(name: str, p: int, n: int, log) -> dict:
    """One generate run that decodes all N tokens (a random model may sample EOS early: then
    another prompt)."""
    for variant in range(5):
        out = run(["generate", "--model", f"synthetic:{name}", "--device", "cpu", "--json",
                   "--raw", "--prompt", prompt_of(p, variant), "--max-tokens", str(n)])
        if out["generation_tokens"] >= n:
            return out
        log(f"  generate stopped after {out['generation_tokens']} tokens "
            f"({out['finish_reason']}); another prompt")
    raise SystemExit(f"generate never decoded {n} tokens (EOS each time)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="pocket-35b-e128", metavar="NAME",
                    help="synthetic model (pocket-35b-e128, pocket-35b, tiny)")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("-n", type=int, default=64, help="tokens to decode (default 64)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    got: dict[str, list[float]] = {"pp": [], "tg": [], "prefill": [], "decode": []}
    prompt_tokens = None
    for i in range(args.rounds):
        b = bench(args.model, args.p, args.n)
        g = generate(args.model, args.p, args.n, log)
        prompt_tokens = g["prompt_tokens"]
        got["pp"].append(b["pp"])
        got["tg"].append(b["tg"])
        got["prefill"].append(g["prompt_tps"])
        got["decode"].append(g["generation_tps"])
        log(f"round {i + 1}/{args.rounds}: bench pp{args.p} {b['pp']:.2f} tg{args.n} "
            f"{b['tg']:.2f} | generate prefill {g['prompt_tps']:.2f} ({g['prompt_tokens']} "
            f"tokens) decode {g['generation_tps']:.2f} tok/s")
    med = {k: statistics.median(v) for k, v in got.items()}
    checks = {}
    for mine, theirs in (("prefill", "pp"), ("decode", "tg")):
        ratio = med[mine] / med[theirs]
        checks[mine] = {"generate_tps": med[mine], "bench_tps": med[theirs],
                        "ratio": ratio, "ok": abs(ratio - 1) <= args.tolerance}
    ok = all(c["ok"] for c in checks.values())
    if args.json:
        print(json.dumps({"model": args.model, "p": args.p, "n": args.n,
                          "generate_prompt_tokens": prompt_tokens, "rounds": args.rounds,
                          "tolerance": args.tolerance, "runs": got, "checks": checks, "ok": ok,
                          "seconds": round(time.perf_counter() - t0, 1)}))
    else:
        for mine, c in checks.items():
            test = f"pp{args.p}" if mine == "prefill" else f"tg{args.n}"
            print(f"{mine:8s} generate {c['generate_tps']:9.2f} tok/s | bench {test:6s} "
                  f"{c['bench_tps']:9.2f} tok/s | ratio {c['ratio']:.3f} "
                  f"{'ok' if c['ok'] else 'OFF BY MORE THAN'} "
                  f"{'' if c['ok'] else f'{args.tolerance:.0%}'}".rstrip())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
