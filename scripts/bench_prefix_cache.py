#!/usr/bin/env python
"""Issue 30's measurement: a shared system prompt reused across conversations.

Through real HTTP against a `python -m pocket_mlx serve` child (fresh data and cache folders):
one unmeasured warm-up request, then two new conversations with the same long system prompt
and different user messages, on /v1/chat/completions, then the same on /v1/messages with
another system prompt (so its first request is cold too). Each timed request asks for one
token, not streamed: its wall time is the time to first token (prefill + one step + HTTP).
Reports each request's prompt and reused tokens, TTFT cold vs warm and the ratio.

With `--identity N`: a third new conversation behind the same system prompt, N greedy tokens on
the warm server (it starts from the system prompt's snapshot), then the same request on a fresh
server with the prompt cache off: the two replies must be identical (issue 30: reuse never
changes output).

With `--session-identity N`: the same check in process, through the chat's `ChatSession` (the
same snapshot points and store), comparing token ids rather than text (a random-weight model's
tokens past the bundled tokenizer's vocabulary decode to nothing, so equal text proves little
there): one session with the store serves a first conversation, then a new one behind the same
system prompt (it starts from the boundary snapshot); a session without the store serves the new
one cold.

Then, in process, the cost of one snapshot against the prefill it saves (the basis of
SNAPSHOT_INTERVAL): prefill `--interval` tokens, then time `PromptCache.store` of that cache.

    python scripts/bench_prefix_cache.py [--model MODEL] [--rules 45] [--interval 1024]
        [--identity N] [--session-identity N] [--no-cost]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def system_prompt(rules: int, salt: str) -> str:
    return " ".join(f"Rule {i}{salt}: answer the user about topic {i * 7 % 53} politely, briefly "
                    f"and without guessing." for i in range(rules))


def post(port: int, path: str, body: dict) -> tuple[float, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    dt = time.perf_counter() - t0
    conn.close()
    if r.status != 200:
        raise SystemExit(f"{path}: {r.status}: {out}")
    return dt, out


def serve(args, home: str, *extra: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "POCKET_MLX_HOME": home, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pocket_mlx", "serve", "--port", str(port),
           "--device", args.device, "--prompt-cache-dir", str(Path(home) / "cache")]
    if args.model:
        cmd += ["--model", args.model]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("serve did not start")


def http_part(args) -> None:
    with tempfile.TemporaryDirectory(prefix="pocket-prefix-bench-") as home:
        proc, port = serve(args, home)
        try:
            model = json.loads(_get(port, "/v1/models"))["data"][0]["id"]
            post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 1, "temperature": 0})
            sys_a = system_prompt(args.rules, "")
            rows = []
            for user in ("Tell me a joke.", "What is 2+2?"):
                dt, out = post(port, "/v1/chat/completions", {
                    "messages": [{"role": "system", "content": sys_a},
                                 {"role": "user", "content": user}],
                    "max_tokens": 1, "temperature": 0})
                u = out["usage"]
                rows.append(("openai", u["prompt_tokens"],
                             u["prompt_tokens_details"]["cached_tokens"], dt))
            sys_b = system_prompt(args.rules, "b")
            for user in ("Tell me a joke.", "What is 2+2?"):
                dt, out = post(port, "/v1/messages", {
                    "model": model, "system": sys_b, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": user}]})
                u = out["usage"]
                rows.append(("anthropic", u["input_tokens"] + u["cache_read_input_tokens"],
                             u["cache_read_input_tokens"], dt))
            if args.identity:
                third = identity_request(sys_a, args.identity)
                dt, out = post(port, "/v1/chat/completions", third)
                warm = (out["choices"][0]["message"]["content"],
                        out["usage"]["prompt_tokens_details"]["cached_tokens"], dt)
            held = [ln for ln in _get(port, "/metrics").splitlines()
                    if ln.startswith(("pocket_mlx_prompt_cache_bytes",
                                      "pocket_mlx_prompt_cache_entries"))]
        finally:
            proc.terminate()
            proc.wait()
        if args.identity:
            with tempfile.TemporaryDirectory(prefix="pocket-prefix-cold-") as cold_home:
                proc, port = serve(args, cold_home, "--prompt-cache-mb", "0")
                try:
                    dt, out = post(port, "/v1/chat/completions", third)
                    cold = (out["choices"][0]["message"]["content"],
                            out["usage"]["prompt_tokens_details"]["cached_tokens"], dt)
                finally:
                    proc.terminate()
                    proc.wait()
    print("\n".join(held))
    print("endpoint   prompt  reused  TTFT_s")
    for name, n, cached, dt in rows:
        print(f"{name:10} {n:6d} {cached:7d} {dt:7.3f}")
    for i in (0, 2):
        print(f"{rows[i][0]}: cold/warm TTFT = {rows[i][3] / rows[i + 1][3]:.1f}x")
    if args.identity:
        for name, (text, cached, dt) in (("warm", warm), ("cold, cache off", cold)):
            print(f"identity, {name}: reused {cached} tokens, {dt:.2f} s: {text!r}")
        same = warm[0] == cold[0]
        print(f"greedy reply identical with and without the cache: {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(1)


def identity_request(system: str, n: int) -> dict:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Name three colours, please."}],
            "max_tokens": n, "temperature": 0}


def session_identity(args) -> None:
    from pocket_mlx.engine.loader import load
    from pocket_mlx.engine.prompt_cache import PromptCache
    from pocket_mlx.engine.session import ChatSession, Settings

    model, tok = load(args.model or str(ROOT / "assets" / "pocket-tiny"), device=args.device)[:2]
    settings = Settings(system=system_prompt(args.rules, ""), temperature=0.0,
                        max_tokens=args.session_identity)

    def reply(session, text):
        t0, ttft, ids = time.perf_counter(), None, []
        for r, _ in session.generate([{"role": "user", "content": text}], settings, args.device):
            if r.token is not None:
                ttft = ttft or time.perf_counter() - t0
                ids.append(r.token)
        return ids, ttft

    store = PromptCache(model, 4 << 30)
    warm_session = ChatSession(model, tok, store)
    _, ttft_first = reply(warm_session, "Tell me a joke.")
    warm, ttft_warm = reply(warm_session, "Name three colours, please.")
    reused, kind = store.stats()["tokens_served"], store.last_kind
    cold, ttft_cold = reply(ChatSession(model, tok), "Name three colours, please.")
    print(f"session identity: first conversation TTFT {ttft_first:.2f} s; new conversation "
          f"behind the same system prompt: warm {ttft_warm:.2f} s (reused {reused} tokens, "
          f"{kind} snapshot) vs cold without the store {ttft_cold:.2f} s "
          f"({ttft_cold / ttft_warm:.1f}x); snapshots held {store.ram_used / 2**20:.0f} MiB")
    print(f"  warm token ids: {warm}\n  cold token ids: {cold}")
    print(f"greedy token ids identical with and without the store: "
          f"{'yes' if warm == cold else 'NO'}")
    if warm != cold:
        raise SystemExit(1)


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    return conn.getresponse().read().decode()


def snapshot_cost(args) -> None:
    import mlx.core as mx

    from pocket_mlx.engine.loader import load
    from pocket_mlx.engine.prompt_cache import PromptCache

    model, tok = load(args.model or str(ROOT / "assets" / "pocket-tiny"), device=args.device)[:2]
    ids = tok.encode(system_prompt(args.rules * 4, ""))[:args.interval]
    cache = model.make_cache()
    t0 = time.perf_counter()
    for i in range(0, len(ids), 512):
        model(mx.array(ids[i:i + 512])[None], cache=cache)
        mx.eval([a for c in cache for a in c.state if a is not None])
    prefill = time.perf_counter() - t0
    store = PromptCache(model, 1 << 40)
    t0 = time.perf_counter()
    store.store(ids, cache)
    cost = time.perf_counter() - t0
    print(f"prefill of {len(ids)} tokens: {prefill:.3f} s; one snapshot of it: {cost * 1e3:.1f} ms "
          f"({store.ram_used / 2**20:.1f} MiB); snapshot/prefill = {cost / prefill:.3%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rules", type=int, default=45, help="system prompt length (45: ~1,300 "
                    "tokens on the bundled tokenizer)")
    ap.add_argument("--interval", type=int, default=1024)
    ap.add_argument("--identity", type=int, default=0, metavar="N",
                    help="also check that N greedy tokens behind a reused prefix equal a "
                         "cache-off server's (a second server start)")
    ap.add_argument("--no-cost", action="store_true", help="skip the in-process snapshot cost "
                    "(it loads the model a second time)")
    ap.add_argument("--session-identity", type=int, default=0, metavar="N",
                    help="only the in-process chat-session check with N greedy tokens (token "
                         "ids compared; no server)")
    args = ap.parse_args()
    if args.session_identity:
        session_identity(args)
        return
    http_part(args)
    if not args.no_cost:
        snapshot_cost(args)


if __name__ == "__main__":
    main()
