"""Answers of a fixed set of requests, raw, for a before/after comparison of a server change.

Runs `python -m pocket_mlx serve` from the source tree given (`--root`, default this checkout;
a `git worktree` of an older commit works too) on the bundled model and on the tool-trained
fixture, sends the same requests (OpenAI chat and completions, Anthropic Messages, whole and
streamed, with tools, and bad input) and writes each reply's status and body, ids and
timestamps masked, to a JSON file. Two runs agree byte for byte when behaviour is unchanged:

    python scripts/check_answers.py --out /tmp/after.json
    git worktree add /tmp/before HEAD~1 && cp pocket_mlx/_qkernels*.so /tmp/before/pocket_mlx/
    python scripts/check_answers.py --root /tmp/before --out /tmp/before.json
    cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_tool_model import RESULT, TOOLS  # noqa: E402  (the tool model's own tools)

MASKS = [(re.compile(p), r) for p, r in [
    (r"(chatcmpl|cmpl|msg|call|toolu|resp|fc|rs|msg)[-_][0-9a-f]{24}", r"\1-ID"),
    (r'"created": ?\d+', '"created": 0'), (r'"created_at": ?\d+', '"created_at": 0'),
    (r'"(total|load|prompt_eval|eval)_duration": ?\d+', r'"\1_duration": 0')]]

PLAIN = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                      "temperature": 0, "max_tokens": 24}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Tell a story"}],
                                      "temperature": 0, "max_tokens": 24, "stream": True,
                                      "stream_options": {"include_usage": True}}),
    ("POST", "/v1/completions", {"prompt": "The capital of France is", "temperature": 0,
                                 "max_tokens": 16}),
    ("POST", "/v1/completions", {"prompt": "Once upon a time", "temperature": 0.7, "seed": 3,
                                 "max_tokens": 16, "stream": True, "stop": ["\n"]}),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 20, "temperature": 0}),
    ("POST", "/v1/messages", {"system": "Answer.", "messages": [
        {"role": "user", "content": "What is 2+2?"}], "max_tokens": 20, "temperature": 0,
        "stream": True}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "temperature": -1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "top_p": 2, "logit_bias": {"1": 2}}),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}),
    ("POST", "/v1/chat/completions", {"messages": []}),
    ("GET", "/v1/models", None),
]


def tool_requests(question: str) -> list:
    chat = {"messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 60}
    result = {"messages": [*chat["messages"], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]}
    msgs = {"messages": [{"role": "user", "content": question}], "max_tokens": 60,
            "temperature": 0, "tools": [{"name": t["function"]["name"],
                                         "description": t["function"].get("description"),
                                         "input_schema": t["function"]["parameters"]}
                                        for t in TOOLS]}
    return [("POST", "/v1/chat/completions", chat),
            ("POST", "/v1/chat/completions", {**chat, "stream": True}),
            ("POST", "/v1/chat/completions", {**chat, **result}),
            ("POST", "/v1/chat/completions", {**chat, **result, "stream": True}),
            ("POST", "/v1/chat/completions", {**chat, "tool_choice": "required"}),
            ("POST", "/v1/messages", msgs), ("POST", "/v1/messages", {**msgs, "stream": True})]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(port: int, method: str, path: str, body) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    for pattern, repl in MASKS:
        text = pattern.sub(repl, text)
    keep = {"x-pocket-fields-ignored", "x-pocket-tools-omitted", "content-type"}
    return {"request": [method, path, body], "status": r.status,
            "headers": {k.lower(): v for k, v in r.getheaders() if k.lower() in keep},
            "body": text}


def serve(root: Path, model: str, requests: list) -> list[dict]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root)}
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "pocket_mlx", "serve", "--port", str(port),
                             "--model", model, "--device", "cpu", "--prompt-cache-mb", "0"],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"serve did not start: {Path(log.name).read_text()[-2000:]}")
            try:
                if ask(port, "GET", "/health", None)["status"] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        return [ask(port, *r) for r in requests]
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=ROOT, help="the source tree to serve from")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    root = args.root.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tool_model = Path(tmp) / "tool-model"
        shutil.copytree(ROOT / "tests" / "fixtures" / "tool-model", tool_model)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(ROOT / "assets" / "pocket-tiny" / f, tool_model / f)
        out = serve(root, str(ROOT / "assets" / "pocket-tiny"), PLAIN)
        out += serve(root, str(tool_model), tool_requests("What is the weather in Paris?"))
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(out)} replies -> {args.out}")


if __name__ == "__main__":
    main()
