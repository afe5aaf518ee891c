"""Decode tok/s shown by the chat TUI vs `pocket-mlx generate --json`, same model/prompt/tokens.

Why: the UI shares the process (and the GIL) with the decode loop; it may cost at most 10%.
Runs `generate --json` in a subprocess and the TUI headless (Textual Pilot) in this process,
alternating run by run (so load from other processes hits both alike), and prints medians, bests
and their ratio. Exit code 1 when the TUI's median is more than 10% slower.

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


async def measure(prompt: str, max_tokens: int, model: str | None, runs: int,
                  size: tuple[int, int]) -> tuple[list, list]:
    """Alternate: one `generate --json` subprocess (the app idle), then one TUI reply."""
    from textual import events

    from pocket_mlx.engine.session import Settings
    from pocket_mlx.tui.app import ChatApp

    app = ChatApp(model, device="cpu", settings=Settings(max_tokens=max_tokens))
    gen, tui, ui_cpu = [], [], []
    async with app.run_test(size=size) as pilot:
        while not app.ready:
            await pilot.pause(0.05)
        for _ in range(runs):
            gen.append(await asyncio.to_thread(generate_tps, prompt, max_tokens, model))
            await app.action_new_chat()
            done = app.replies_done
            app.prompt.text = prompt
            c0, t0 = time.thread_time(), time.perf_counter()  # this coroutine runs on the UI thread
            # Enter as a terminal would send it, not `pilot.press`: that then polls the process
            # at 50 Hz for up to 2 s, waiting for an idle CPU that never comes while decoding, and
            # its polling would be counted as the app's UI work.
            app.post_message(events.Key("enter", "\r"))
            while app.replies_done == done:
                await asyncio.sleep(0.25)  # not pilot.pause: keep the harness off the UI thread
            ui_cpu.append((time.thread_time() - c0) / (time.perf_counter() - t0))
            shown = app.stats_panel.stats  # what the panel shows for the finished reply
            tui.append((shown.generation_tps, shown.generation_tokens))
    print(f"UI thread CPU   : median {100 * statistics.median(ui_cpu):.1f}% of each reply's wall "
          f"time (runs: {', '.join(f'{100 * c:.1f}' for c in ui_cpu)})")
    return gen, tui


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

    gen, tui = asyncio.run(measure(args.prompt, args.max_tokens, args.model, args.runs, (w, h)))
    for name, res in (("generate --json", gen), ("chat TUI", tui)):
        print(f"{name:<16}: median {statistics.median(t for t, _ in res):.1f} tok/s, "
              f"best {max(t for t, _ in res):.1f}  (runs: {', '.join(f'{t:.1f}' for t, _ in res)};"
              f" tokens {res[0][1]})")
    ratio = statistics.median(t for t, _ in tui) / statistics.median(t for t, _ in gen)
    best = max(t for t, _ in tui) / max(t for t, _ in gen)
    print(f"TUI / generate  : {ratio:.3f} median, {best:.3f} best "
          f"(UI overhead {100 * (1 - ratio):.1f}%, budget 10%)")
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    from pocket_mlx.engine.devices import exit_now

    exit_now(main())  # skip MLX's native teardown after thread use (see exit_now)
