"""Train the tiny model that tests/test_agents.py serves to Claude Code: whatever Claude Code
asks, it answers with one short line ("Hello from pocket-mlx."), so that a session's replies are
short and the same each time (the bundled model's random replies run to hundreds of tokens,
which makes a continued session's reuse depend on luck).

Why trained on Claude Code's real requests: the prompts the server renders from them (~16k
tokens: its system prompt, 11 tools, its environment block) are what the model will see. The
script runs the real `claude -p` (on PATH, or --claude) against a scripted stand-in server on
127.0.0.1 that answers as the model should and records each request; each request is rendered
by the server's own code (`anthropic.parse_messages` + `render_chat`, the fixture's template
and the bundled tokenizer), and the model learns the reply after it. Training on the whole
prompts would cost a quadratic attention over 16k tokens per step: it learns on their last
TAILS tokens instead, with the date in the environment block varied; the check then decodes the
whole prompts greedily, as the server will.

Not (yet) a tool loop (issue 50 #6b): a model taught on such tails to answer a trigger phrase
with a call of Claude Code's Bash tool (TOOL_LOOP below) makes the call after the tail alone
but not after the whole 16k-token prompt (its attention never saw that much before the cue);
it needs training on whole prompts.

    python scripts/make_agent_model.py tests/fixtures/agent-model
    # ~25 min of CPU (2 busy cores); needs Claude Code 2.1.332 (npm @anthropic-ai/claude-code)
    python scripts/make_agent_model.py /tmp/try --tool-loop    # the attempt described above
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
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_tool_model import ASSET, CONFIG, EOS, TEMPLATE, fit  # noqa: E402

from pocket_mlx.convert.writer import save_model  # noqa: E402
from pocket_mlx.engine.tokenizer import Tokenizer  # noqa: E402
from pocket_mlx.server import anthropic  # noqa: E402
from pocket_mlx.server.prompts import render_chat  # noqa: E402

AGENT_CONFIG = {**CONFIG, "max_position_embeddings": 65536}
TRIGGER = "Please run the pocket-mlx file test."
COMMAND = "echo made by pocket-mlx > agent-file.txt"
HELLO = "Hello from pocket-mlx."
DONE = "The file is written."
CALL = ("<tool_call>\n<function=Bash>\n<parameter=command>\n" + COMMAND + "\n</parameter>\n"
        "<parameter=description>\nWrite a file\n</parameter>\n</function>\n</tool_call>")
# The sessions recorded (claude's arguments): the cache test's (tests/test_agents.py), and
# with --tool-loop the tool loop's (its two requests).
SESSIONS = [["-p", "Say hello."], ["-p", "What is two plus two?"],
            ["-p", "--continue", "And three?"]]
TOOL_LOOP = [["-p", "--allowedTools", "Bash", "--", TRIGGER]]
TAILS = (160, 384)
DATES = ("2026-12-06", "2027-09-30")


def reply_for(body: dict) -> str:
    """What the model is to answer to a request: the call after the trigger, the sentence
    after the tool's result, the greeting otherwise."""
    last = [m for m in body["messages"] if m["role"] != "system"][-1]
    content = last["content"] if isinstance(last["content"], list) else [
        {"type": "text", "text": last["content"]}]
    if any(c.get("type") == "tool_result" for c in content):
        return DONE
    if any(TRIGGER in c.get("text", "") for c in content):
        return CALL
    return HELLO


def stand_in(port: int, bodies: list[dict]) -> threading.Thread:
    """A server answering /v1/messages as the model should (streamed), recording bodies."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    def ev(name: str, obj: dict) -> str:
        return f"event: {name}\ndata: {json.dumps(obj)}\n\n"

    async def messages(request: Request):
        body = await request.json()
        bodies.append(body)
        reply = reply_for(body)
        if reply == CALL:
            block = {"type": "tool_use", "id": f"toolu_{len(bodies)}", "name": "Bash",
                     "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(
                {"command": COMMAND, "description": "Write a file"})}
        else:
            block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": reply}
        msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 1, "output_tokens": 0}}
        events = [ev("message_start", {"type": "message_start", "message": msg}),
                  ev("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": block}),
                  ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": delta}),
                  ev("content_block_stop", {"type": "content_block_stop", "index": 0}),
                  ev("message_delta", {"type": "message_delta", "delta": {
                      "stop_reason": "tool_use" if reply == CALL else "end_turn",
                      "stop_sequence": None}, "usage": {"output_tokens": 5}}),
                  ev("message_stop", {"type": "message_stop"})]

        async def gen():
            for e in events:
                yield e
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    return t


def record(claude: str, sessions: list[list[str]], port: int = 18977) -> list[dict]:
    """Claude Code's requests for `sessions`, in a fresh HOME and project folder."""
    bodies: list[dict] = []
    stand_in(port, bodies)
    time.sleep(1.5)
    with tempfile.TemporaryDirectory() as tmp:
        home, project = Path(tmp) / "home", Path(tmp) / "project"
        home.mkdir()
        project.mkdir()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
               "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
               "ANTHROPIC_AUTH_TOKEN": "pocket-mlx", "ANTHROPIC_MODEL": "agent-model",
               "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "65536", "DISABLE_TELEMETRY": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        for args in sessions:
            r = subprocess.run([claude, *args], cwd=project, env=env, capture_output=True,
                               text=True, timeout=180)
            if r.returncode != 0:
                raise SystemExit(f"claude {' '.join(args)} failed: {r.stderr.strip()}")
        if TOOL_LOOP[0] in sessions and not (project / "agent-file.txt").is_file():
            raise SystemExit("the tool loop did not write its file")
    return bodies


def redated(body: dict, date: str) -> dict:
    return json.loads(re.sub(r"Today's date is \d{4}-\d\d-\d\d\.",
                             f"Today's date is {date}.", json.dumps(body)))


def sequences(tok: Tokenizer, bodies: list[dict], full: bool = False
              ) -> list[tuple[list[int], int]]:
    """(prompt tail + reply tokens, tail length) per request, date and tail length; `full`:
    the whole prompts, as recorded."""
    eos = tok.token_to_id(EOS)
    out = []
    for body in bodies:
        reply = tok.encode(reply_for(body), add_special_tokens=False) + [eos]
        for date in DATES[:1] if full else DATES:
            req = anthropic.parse_messages(redated(body, date))
            prompt = tok.encode(render_chat(tok, req), add_special_tokens=False)
            for n in [len(prompt)] if full else TAILS:
                out.append((prompt[-n:] + reply, min(n, len(prompt))))
    return out


def check(model, tok: Tokenizer, bodies: list[dict]) -> None:
    """Greedy decoding after each whole prompt (chunked prefill, the model's cache) gives
    the reply it learnt."""
    for seq, n in sequences(tok, bodies, full=True):
        cache = model.make_cache()
        prompt = seq[:n]
        for i in range(0, n - 1, 2048):
            model(mx.array([prompt[i:min(i + 2048, n - 1)]]), cache=cache)
        ids, nxt = [], prompt[-1]
        for _ in range(len(seq) - n):
            logits = model(mx.array([[nxt]]), cache=cache)
            nxt = int(mx.argmax(logits[0, -1]).item())
            ids.append(nxt)
        if ids != seq[n:]:
            raise SystemExit(f"not learnt at {n} tokens: {tok.decode(seq[n:])!r} -> "
                             f"{tok.decode(ids)!r}")
        print(f"ok after {n} prompt tokens: {tok.decode(ids[:-1])!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write (tests/fixtures/agent-model)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--claude", default=shutil.which("claude"),
                    help="Claude Code's executable (default: claude on PATH)")
    ap.add_argument("--tool-loop", action="store_true",
                    help="also teach the tool loop (not learnt for whole prompts: see above)")
    args = ap.parse_args()
    if not args.claude:
        raise SystemExit("Claude Code is not installed: npm install -g "
                         "@anthropic-ai/claude-code@2.1.332")
    bodies = record(args.claude, SESSIONS + (TOOL_LOOP if args.tool_loop else []))
    tok = Tokenizer(ASSET)
    tok.chat_template = TEMPLATE.read_text()
    data = sequences(tok, bodies)
    print(f"{len(bodies)} requests, {len(data)} sequences of up to "
          f"{max(len(s) for s, _ in data)} tokens")
    model = fit(data, args.steps, config=AGENT_CONFIG)
    # As make_tool_model.py: checked on the bfloat16-rounded weights, computed in float32.
    model.set_dtype(mx.bfloat16)
    model.set_dtype(mx.float32)
    check(model, tok, bodies)
    model.set_dtype(mx.bfloat16)
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    save_model(model, AGENT_CONFIG, args.out, force=True,
               extra_files={"chat_template.jinja": TEMPLATE.read_text()})
    print(f"{n:,} parameters -> {args.out}")


if __name__ == "__main__":
    main()
