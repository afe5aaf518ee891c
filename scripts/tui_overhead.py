"""Decode tok/s shown by the chat TUI vs `pocket-mlx generate --json`, same model/prompt/tokens.

Why: the UI shares the process (and the GIL) with the decode loop; it may cost at most 10%.
Runs `generate --json` in a subprocess and the TUI headless (Textual Pilot) in this process,
alternating, and prints the medians and their ratio.

    python scripts/tui_overhead.py [--prompt "def main():"] [--max-tokens 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def generate_tps(prompt: str, max_tokens: int, model: str | None) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "pocket_mlx", "generate", "--json", "--device", "cpu",
           "-p", prompt, "-n", str(max_tokens)] + (["--model", model] if model else [])
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return out["generation_tps"], out["generation_tokens"]


async def tui_tps(prompt: str, max_tokens: int, model: str | None, runs: int,
                  size: tuple[int, int]) -> list[tuple[float, int]]:
    from pocket_mlx.tui.app import ChatApp
    from pocket_mlx.tui.session import Settings

    app = ChatApp(model, device="cpu", settings=Settings(max_tokens=max_tokens))
    results = []
    async with app.run_test(size=size) as pilot:
        while not app.ready:
            await pilot.pause(0.05)
        for _ in range(runs):
            await app.action_new_chat()
            done = app.replies_done
            app.prompt.text = prompt
            await pilot.press("enter")
            while app.replies_done == done:
                await pilot.pause(0.05)
            # What the panel shows: the stats of the finished reply.
            results.append((app.stats_panel.stats.generation_tps,
                            app.stats_panel.stats.generation_tokens))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="def main():")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--size", default="120x40", help="terminal size for the TUI, WxH")
    args = ap.parse_args()
    os.environ.setdefault("POCKET_MLX_HOME", tempfile.mkdtemp(prefix="pocket-mlx-overhead-"))
    w, h = (int(x) for x in args.size.split("x"))

    gen = []
    for _ in range(args.runs):
        gen.append(generate_tps(args.prompt, args.max_tokens, args.model))
    t0 = time.perf_counter()
    tui = asyncio.run(tui_tps(args.prompt, args.max_tokens, args.model, args.runs, (w, h)))
    t_tui = time.perf_counter() - t0
    g = statistics.median(t for t, _ in gen)
    u = statistics.median(t for t, _ in tui)
    print(f"generate --json : {g:.1f} tok/s  (runs: {', '.join(f'{t:.1f}' for t, _ in gen)}; "
          f"tokens {gen[0][1]})")
    print(f"chat TUI        : {u:.1f} tok/s  (runs: {', '.join(f'{t:.1f}' for t, _ in tui)}; "
          f"tokens {tui[0][1]}; {t_tui:.1f} s incl. load)")
    ratio = u / g
    print(f"TUI / generate  : {ratio:.3f}  (UI overhead {100 * (1 - ratio):.1f}%, budget 10%)")
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
