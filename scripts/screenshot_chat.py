"""Save a PNG screenshot of the browser chat page (`pocket-mlx serve`, GET /): docs/chat-page.png.

Starts a real server on the bundled model (CPU, throwaway POCKET_MLX_HOME) and opens the page in
headless Chromium (Playwright, the system browser: apt-get install chromium; pip install
playwright). The first exchange is stored in the page's localStorage beforehand, to show the
Markdown rendering (headings, lists, code blocks), which the bundled tiny model does not write
itself; the second is typed and streamed live from the model, its figures measured as it goes.

    python scripts/screenshot_chat.py [--out docs/chat-page.png] [--size 1100x800]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEEDED = {
    "id": "demo",
    "title": "Reverse a list in Python",
    "created": 0,
    "messages": [
        {"role": "user", "content": "How do I reverse a list in Python?"},
        {
            "role": "assistant",
            "model": "pocket-tiny",
            "content": (
                "### Two ways\n\n1. **In place** with `list.reverse()`\n"
                "2. A *new* list with slicing:\n\n```python\nitems = [1, 2, 3]\n"
                "backwards = items[::-1]  # [3, 2, 1]\nitems.reverse()           # items is now "
                "[3, 2, 1]\n```\n\nSlicing keeps the original; `reverse()` does not."
            ),
            "stats": {"ttft": 0.11, "prompt_tokens": 24, "tps": 231.4, "tokens": 58},
        },
    ],
}
ARGS = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-default-apps",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "chat-page.png")
    ap.add_argument("--size", default="1100x800", help="viewport WIDTHxHEIGHT")
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tempfile.mkdtemp(prefix="pocket-mlx-shot-")
    env = {**os.environ, "POCKET_MLX_HOME": home, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "pocket_mlx", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stderr=subprocess.DEVNULL,
    )
    origin = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(origin + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        exe = shutil.which("chromium") or "/usr/bin/chromium"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=ARGS)
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(origin + "/")
            page.evaluate(
                """chat => { localStorage.setItem('pocket-mlx.chats', JSON.stringify([chat]));
                localStorage.setItem('pocket-mlx.current', JSON.stringify(chat.id));
                localStorage.setItem('pocket-mlx.settings', JSON.stringify(
                    {system: '', temperature: '0', top_p: '', max_tokens: '60'})); }""",
                json.loads(json.dumps(SEEDED)),
            )
            page.reload()
            page.wait_for_function("() => document.getElementById('model').textContent !== '…'")
            page.locator("#input").press_sequentially("def main():")
            page.locator("#input").press("Enter")
            page.wait_for_selector("#send:not([hidden])", timeout=60_000)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=15)
        shutil.rmtree(home, ignore_errors=True)
    print(f"{args.out}: {args.out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
