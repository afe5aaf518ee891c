"""`serve --speculative off` and `auto` side by side, through the openai client (pip install
openai), greedy `/v1/completions` on the prompts of scripts/bench_speculative.py: each reply's
decode time from its first streamed token, the median of interleaved runs, and whether the two
servers' texts match (docs/SPECULATIVE.md, "In the server").

    python scripts/bench_serve_speculative.py [--model PATH] [-n 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_speculative import ORDINARY, PROMPT  # noqa: E402
from openai import OpenAI  # noqa: E402

METHODS = ("off", "auto")


def start(spec: str, port: int, model: str | None) -> tuple[subprocess.Popen, OpenAI, str]:
    """A real `pocket-mlx serve` process, a client once it answers, and the model's id."""
    cmd = ["pocket-mlx", "serve", "--port", str(port), "--speculative", spec]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    for _ in range(240):
        try:
            return proc, client, client.models.list().data[0].id
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None:
                raise SystemExit(f"serve --speculative {spec} exited ({proc.returncode})") from None
            time.sleep(0.5)
    raise SystemExit("the server did not answer in 2 minutes")


def reply(client: OpenAI, name: str, prompt: str, n: int) -> tuple[str, float]:
    """The greedy reply's text and its decode time (first streamed token to the last)."""
    first, text = None, []
    stream = client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0,
                                       stream=True)
    for chunk in stream:
        if first is None:
            first = time.perf_counter()
        text.append(chunk.choices[0].text)
    return "".join(text), time.perf_counter() - (first or time.perf_counter())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: serve's (the bundled model)")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    prompts = {"code-edit": PROMPT, **ORDINARY}
    servers = {m: start(m, 8400 + i, args.model) for i, m in enumerate(METHODS)}
    times: dict[str, dict[str, list[float]]] = {m: {p: [] for p in prompts} for m in METHODS}
    texts: dict[str, dict[str, set[str]]] = {p: {m: set() for m in METHODS} for p in prompts}
    try:
        for _, client, name in servers.values():
            reply(client, name, "Hello", 16)  # warm up
        for _ in range(args.reps):
            for m, (_, client, name) in servers.items():
                for p, prompt in prompts.items():
                    text, seconds = reply(client, name, prompt, args.n)
                    times[m][p].append(seconds)
                    texts[p][m].add(text)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
    print("| prompt | off ms | auto ms | auto vs off | same text |")
    print("|---|---:|---:|---:|---|")
    for p in prompts:
        off, auto = (statistics.median(times[m][p]) for m in METHODS)
        same = len(texts[p]["off"] | texts[p]["auto"]) == 1
        print(f"| {p} | {off * 1e3:.1f} | {auto * 1e3:.1f} | {off / auto:.2f}x | {same} |")


if __name__ == "__main__":
    main()
