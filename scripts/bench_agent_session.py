"""Claude Code's first session and the next one on a big model on the CPU (issue 50): does
its first request (its real ~16k-token prompt) complete without the client giving up, and how
much sooner does the next session's first token come, from the prompt cache?

It serves MODEL (default: the 35B shape with 128 experts that `pocket-mlx bench` builds into
~/.cache/pocket-mlx/synthetic) with Qwen3.5's real chat template (tests/fixtures/templates)
and a 64k window, in a temporary folder of links to its files; runs `claude -p` twice in one
work folder (its replies capped at --max-output tokens with CLAUDE_CODE_MAX_OUTPUT_TOKENS:
a random-weight model never stops on its own); and prints one JSON row: per session the
client's wall time and exit code, per request serve's prompt / cached tokens, seconds and
first-token time (its log), and the ratio of the two sessions' first tokens.

    python scripts/bench_agent_session.py [--model DIR] [--max-output 16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from agent_recorder import client_command, installed, session_args  # noqa: E402

SYNTHETIC = Path.home() / ".cache" / "pocket-mlx" / "synthetic" / "pocket-35b-e128-pocket-2bit"
TEMPLATE = ROOT / "tests" / "fixtures" / "templates" / "qwen3.5.jinja"
WINDOW = 65536
LINE = re.compile(r"(\d{3}) POST /v1/messages(?: \(stream\))?: (\d+) prompt tokens \((\d+) "
                  r"cached\), (\d+) completion tokens, \w+, ([\d.]+) s"
                  r"(?: \(first token after ([\d.]+) s\))?")


def served_copy(model: Path, where: Path) -> Path:
    """`model`'s files as links, its config's window 64k, Qwen3.5's template."""
    folder = where / model.name
    folder.mkdir()
    for f in model.iterdir():
        if f.name not in ("config.json", "chat_template.jinja"):
            (folder / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = WINDOW
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(TEMPLATE, folder / "chat_template.jinja")
    return folder


def cpu() -> str:
    """The CPU and the kernels' ISA variant, as `pocket-mlx bench` names them."""
    from pocket_mlx import kernels
    from pocket_mlx.analysis.bench import cpu_model

    return f"{cpu_model()} ({kernels.info().get('variant')}, {os.cpu_count()} cores)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SYNTHETIC)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--serve", default="", metavar="ARGS",
                    help='more serve options, e.g. "--reasoning off --prompt-cache-mb 4096"')
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no model there (pocket-mlx bench builds the 35B shape)")
    claude = installed(["claude"])["claude"]
    from test_server import Server

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = served_copy(args.model, tmp)
        server = Server(tmp / "serve.log", "--model", str(folder), "--device", "cpu",
                        *args.serve.split())
        work, home = tmp / "work", tmp / "home"
        work.mkdir()
        home.mkdir()
        sessions = []
        try:
            for label in ("first", "second"):
                argv, env = client_command("claude", claude, f"http://127.0.0.1:{server.port}", home,
                                           session_args("claude", "Say hi"), folder.name)
                env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(args.max_output)
                env["PWD"] = str(work)
                start = len(server.log.read_text())
                t0 = time.monotonic()
                r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                                   timeout=args.timeout, stdin=subprocess.DEVNULL)
                wall = time.monotonic() - t0
                log = server.log.read_text()[start:]
                reqs = [{"status": int(m[0]), "prompt": int(m[1]), "cached": int(m[2]),
                         "completion": int(m[3]), "seconds": float(m[4]),
                         "first_token_s": float(m[5]) if m[5] else None}
                        for m in LINE.findall(log)]
                refused = re.findall(r" ([45]\d\d) [A-Z]+ /\S+", log)
                sessions.append({"session": label, "exit": r.returncode,
                                 "wall_s": round(wall, 1), "requests": reqs,
                                 "refused": refused, "stderr": r.stderr.strip()[-300:]})
                print(json.dumps(sessions[-1]), file=sys.stderr, flush=True)
        finally:
            server.stop()
    first, second = (max(s["requests"], key=lambda q: q["prompt"]) if s["requests"] else None
                     for s in sessions)
    ratio = None
    if first and second and first["first_token_s"] and second["first_token_s"]:
        ratio = round(first["first_token_s"] / second["first_token_s"], 1)
    print(json.dumps({"cpu": cpu(), "model": str(args.model), "serve": args.serve,
                      "sessions": sessions,
                      "first_token_ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
