"""Save an SVG screenshot of a real chat session: assets/chat-screenshot.svg.

Runs the chat app headless (Textual Pilot) on the bundled model, on the CPU, with a throwaway
POCKET_MLX_HOME; has two real exchanges, then saves the screen as it is.

    python scripts/screenshot_tui.py [--out assets/chat-screenshot.svg] [--size 110x34]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Tell me a fortune", "def main():"]


async def shoot(out: Path, size: tuple[int, int], max_tokens: int) -> None:
    from pocket_mlx.engine.session import Settings
    from pocket_mlx.tui.app import ChatApp

    app = ChatApp(device="cpu", settings=Settings(max_tokens=max_tokens))
    async with app.run_test(size=size) as pilot:
        while not app.ready:
            await pilot.pause(0.05)
        for prompt in PROMPTS:
            done = app.replies_done
            app.prompt.text = prompt
            await pilot.press("enter")
            while app.replies_done == done:
                await pilot.pause(0.05)
        app.prompt.text = "And now a Tang poem"
        await pilot.pause(0.6)  # let the throughput panel and sparkline refresh
        app.save_screenshot(filename=out.name, path=str(out.parent))
    print(f"wrote {out} ({app.last_stats.generation_tps:.1f} tok/s decode in the last reply)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "chat-screenshot.svg")
    ap.add_argument("--size", default="110x34", help="terminal size, WxH")
    ap.add_argument("--max-tokens", type=int, default=60)
    args = ap.parse_args()
    os.environ.setdefault("POCKET_MLX_HOME", tempfile.mkdtemp(prefix="pocket-mlx-shot-"))
    w, h = (int(x) for x in args.size.split("x"))
    asyncio.run(shoot(args.out.resolve(), (w, h), args.max_tokens))
    return 0


if __name__ == "__main__":
    from pocket_mlx.engine.devices import exit_now

    exit_now(main())  # skip MLX's native teardown after thread use (see exit_now)
