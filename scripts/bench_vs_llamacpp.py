#!/usr/bin/env python
"""pocket-mlx against llama.cpp on the same model shape and machine, in one run (issue 15).

Interleaved ROUNDS times (default 2), best of the rounds, as separate processes one after the
other (never both models in memory at once):
    llama-bench -m GGUF -p P -n 0 -t THREADS -r 1 -o json          for each P in --prompts
    llama-bench -m GGUF -p 0 -n N -t THREADS -r 1 -o json
    pocket-mlx bench --synthetic NAME --device cpu -p P -n 0 -r 1 -t THREADS -o json -q
    pocket-mlx bench --synthetic NAME --device cpu -p 0 -n N -r 1 -t THREADS -o json -q
and prints one table (markdown, or --json): ppP and tgN tok/s of each and the ratio.

With --ttft T (e.g. 4000): also the time to first token of a T-token prompt through the user's
path (`pocket-mlx generate --model synthetic:NAME --device cpu --json --raw --max-tokens 1`, a
cold process as a user's is, chunked prefill and all) next to llama-bench's prefill time for
the same number of tokens (T / its ppT tok/s; llama-bench does not include loading either).

llama.cpp is whatever build --llama-bench points at (the anchor build script compiles it for the
machine's native ISA); ours runs the extension's best ISA unless POCKET_MLX_ISA says otherwise
(e.g. POCKET_MLX_ISA=avx2 runs our AVX2 kernels; llama.cpp is not rebuilt for that).

    flock /tmp/big.lock python scripts/bench_vs_llamacpp.py --gguf ~/.cache/llamacpp-anchor/models/qwen35moe-35B-shape-E128-Q2K.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from check_user_path import WORDS  # noqa: E402

from pocket_mlx.engine.tokenizer import load_tokenizer  # noqa: E402

DEFAULT_LLAMA_BENCH = Path.home() / ".cache" / "llamacpp-anchor" / "build" / "bin" / "llama-bench"


def log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _run(cmd: list[str], env: dict | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])}... failed ({r.returncode}): "
                         f"{tail}")
    return r.stdout


def llama(bench: Path, gguf: Path, p: int, n: int, threads: int) -> tuple[float, dict]:
    out = json.loads(_run([str(bench), "-m", str(gguf), "-p", str(p), "-n", str(n), "-t",
                           str(threads), "-r", "1", "-o", "json"]))
    row = out[0]
    return float(row["avg_ts"]), row


def ours(name: str, p: int, n: int, threads: int) -> tuple[float, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = json.loads(_run([sys.executable, "-m", "pocket_mlx", "bench", "--synthetic", name,
                           "--device", "cpu", "-p", str(p), "-n", str(n), "-r", "1", "-t",
                           str(threads), "-o", "json", "-q"], env))
    row = out["rows"][0]
    return float(row["tps_mean"]), {"machine": out["machine"], "kernels": row.get("kernels")}


def long_prompt(n_tokens: int) -> str:
    """Plain text of about `n_tokens` tokens (the synthetic models share the bundled
    tokenizer), grown 64 words at a time (check_user_path.prompt_of re-encodes per word)."""
    tok = load_tokenizer(ROOT / "assets" / "pocket-tiny")
    words: list[str] = []
    i = 0
    while len(tok.encode(" ".join(words))) < n_tokens:
        for _ in range(64):
            words.append(WORDS[i % len(WORDS)])
            i += 7
    while len(words) > 1 and len(tok.encode(" ".join(words[:-1]))) >= n_tokens:
        words.pop()
    return " ".join(words)


def ttft(name: str, tokens: int) -> dict:
    """Seconds from the start of prefill to the first token, as `generate --json` reports."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    out = json.loads(_run([sys.executable, "-m", "pocket_mlx", "generate", "--model",
                           f"synthetic:{name}", "--device", "cpu", "--json", "--raw",
                           "--prompt", long_prompt(tokens), "--max-tokens", "1"], env))
    wall = time.perf_counter() - t0
    return {"prompt_tokens": out["prompt_tokens"], "prompt_tps": out["prompt_tps"],
            "ttft_s": out["prompt_tokens"] / out["prompt_tps"], "process_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path, help="the matching GGUF file")
    ap.add_argument("--llama-bench", type=Path, default=DEFAULT_LLAMA_BENCH)
    ap.add_argument("--synthetic", default="pocket-35b-e128", metavar="NAME")
    ap.add_argument("--prompts", default="64,512,2048", help="pp sizes (default 64,512,2048)")
    ap.add_argument("-n", type=int, default=128, help="tg size (default 128; 0 = skip)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ttft", type=int, default=0, metavar="T",
                    help="also TTFT of a T-token prompt through `pocket-mlx generate`")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for path, what in ((args.gguf, "--gguf"), (args.llama_bench, "--llama-bench")):
        if not path.exists():
            print(f"error: {what} {path} does not exist", file=sys.stderr)
            return 2

    tests = [(int(p), 0) for p in args.prompts.split(",") if p.strip()]
    if args.n:
        tests.append((0, args.n))
    best: dict[str, dict[str, float]] = {}
    meta: dict = {}
    # Other jobs on the machine: llama.cpp's threads wait for each other at barriers, so it
    # suffers more than our pool when a core is taken away; the load average goes on record.
    loads = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for p, n in tests:
            name = f"pp{p}" if p else f"tg{n}"
            lt, lrow = llama(args.llama_bench, args.gguf, p, n, args.threads)
            ot, ometa = ours(args.synthetic, p, n, args.threads)
            meta.setdefault("llama_cpp", {k: lrow.get(k) for k in (
                "build_commit", "cpu_info", "backends", "model_type", "model_size", "n_threads")})
            meta.setdefault("ours", ometa)
            b = best.setdefault(name, {"llama": 0.0, "ours": 0.0})
            b["llama"], b["ours"] = max(b["llama"], lt), max(b["ours"], ot)
            load = os.getloadavg()[0]
            loads.append(load)
            log(f"round {r + 1}/{args.rounds} {name}: llama.cpp {lt:.2f} | pocket-mlx {ot:.2f} "
                f"tok/s ({time.perf_counter() - t0:.0f} s, load average {load:.1f})")
    tt = None
    if args.ttft:
        runs = []
        for r in range(args.rounds):
            lt, _ = llama(args.llama_bench, args.gguf, args.ttft, 0, args.threads)
            o = ttft(args.synthetic, args.ttft)
            runs.append((args.ttft / lt, o))
            log(f"round {r + 1}/{args.rounds} TTFT {args.ttft}: llama.cpp {args.ttft / lt:.1f} s "
                f"| pocket-mlx generate {o['ttft_s']:.1f} s ({o['prompt_tokens']} tokens)")
        tt = {"tokens": args.ttft, "llama_s": min(x[0] for x in runs),
              "ours": min((x[1] for x in runs), key=lambda o: o["ttft_s"])}
    result = {"gguf": str(args.gguf), "synthetic": args.synthetic, "threads": args.threads,
              "rounds": args.rounds, "host": platform.node(), "meta": meta, "best": best,
              "ttft": tt, "load_average": loads, "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"load average (1 min) during the run: {min(loads):.1f}-{max(loads):.1f}\n")
    print("| test | llama.cpp t/s | pocket-mlx t/s | ratio |\n| --- | ---: | ---: | ---: |")
    for name, b in best.items():
        print(f"| {name} | {b['llama']:.2f} | {b['ours']:.2f} | {b['ours'] / b['llama']:.2f}x |")
    if tt:
        o = tt["ours"]
        print(f"\nTTFT, {tt['tokens']}-token prompt: llama.cpp {tt['llama_s']:.1f} s (llama-bench "
              f"pp{tt['tokens']}), pocket-mlx generate {o['ttft_s']:.1f} s "
              f"({o['prompt_tokens']} tokens; whole process {o['process_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
