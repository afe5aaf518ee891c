"""`pocket-mlx bench prefix-cache`: a shared system prompt reused across conversations.

Through real HTTP against a `pocket-mlx serve` child (a fresh, temporary data and cache folder):
one unmeasured warm-up request, then two new conversations with the same long system prompt
and different user messages on /v1/chat/completions, then the same on /v1/messages with
another system prompt (so its first request is cold too). Each timed request asks for one
token, not streamed: its wall time is the time to first token (prefill + one step + HTTP).
Reports each request's prompt and reused tokens, TTFT cold vs warm and the ratio.

With identity N: a third new conversation behind the same system prompt, N greedy tokens on
the warm server, then the same request on a fresh server with the prompt cache off: the two
replies must be identical (reuse never changes output). With session-identity N instead: the
same check in process, through the chat's ChatSession, token ids compared. Then, in process,
the cost of one snapshot against the prefill it saves: prefill `interval` tokens, then time
PromptCache.store of that cache.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pocket_mlx.errors import PocketError

Say = Callable[[str], None]
START_TIMEOUT_S = 1800  # a big model's load


def system_prompt(rules: int, salt: str) -> str:
    """A long system prompt (45 rules: ~1,300 tokens on the bundled tokenizer)."""
    return " ".join(f"Rule {i}{salt}: answer the user about topic {i * 7 % 53} politely, briefly "
                    f"and without guessing." for i in range(rules))


def identity_request(system: str, n: int) -> dict:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Name three colours, please."}],
            "max_tokens": n, "temperature": 0}


class Serve:
    """A `pocket-mlx serve` child on a free port (its data folder `home`), until close()."""

    def __init__(self, model: str | None, device: str, home: str, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "POCKET_MLX_HOME": home}
        cmd = [sys.executable, "-m", "pocket_mlx", "serve", "--port", str(self.port),
               "--device", device, "--prompt-cache-dir", str(Path(home) / "cache"),
               *(["--model", model] if model else []), *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PocketError(f"serve exited {self.proc.returncode} (its error is above)")
            try:
                if self._call("GET", "/health", None, 5)[0] == 200:
                    return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise PocketError(f"serve did not answer /health in {START_TIMEOUT_S} s")

    def _call(self, method: str, path: str, body: dict | None, timeout: float):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def get(self, path: str) -> str:
        return self._call("GET", path, None, 60)[1].decode()

    def post(self, path: str, body: dict) -> tuple[float, dict]:
        """(wall seconds, JSON reply) of one request; a non-200 reply is an error."""
        t0 = time.perf_counter()
        status, raw = self._call("POST", path, body, 3600)
        dt = time.perf_counter() - t0
        if status != 200:
            raise PocketError(f"{path}: {status}: {raw.decode(errors='replace')}")
        return dt, json.loads(raw)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def _timed_rows(srv: Serve, rules: int) -> list[tuple[str, int, int, float]]:
    """(endpoint, prompt tokens, reused tokens, TTFT) of two conversations per endpoint."""
    model = json.loads(srv.get("/v1/models"))["data"][0]["id"]
    srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 1, "temperature": 0})  # warm-up
    rows = []
    for user in ("Tell me a joke.", "What is 2+2?"):
        dt, out = srv.post("/v1/chat/completions", {
            "messages": [{"role": "system", "content": system_prompt(rules, "")},
                         {"role": "user", "content": user}], "max_tokens": 1, "temperature": 0})
        u = out["usage"]
        rows.append(("openai", u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                     dt))
    for user in ("Tell me a joke.", "What is 2+2?"):
        dt, out = srv.post("/v1/messages", {
            "model": model, "system": system_prompt(rules, "b"), "max_tokens": 1,
            "temperature": 0, "messages": [{"role": "user", "content": user}]})
        u = out["usage"]
        rows.append(("anthropic", u["input_tokens"] + u["cache_read_input_tokens"],
                     u["cache_read_input_tokens"], dt))
    return rows


def _reply(srv: Serve, request: dict) -> tuple[str, int, float]:
    dt, out = srv.post("/v1/chat/completions", request)
    return (out["choices"][0]["message"]["content"],
            out["usage"]["prompt_tokens_details"]["cached_tokens"], dt)


def http_part(*, model: str | None, device: str, rules: int, identity: int,
              say: Say = print) -> bool:
    """The HTTP measurement (and the identity check when `identity` > 0); False if the
    replies with and without the cache differ."""
    third = identity_request(system_prompt(rules, ""), identity)
    with tempfile.TemporaryDirectory(prefix="pocket-prefix-bench-") as home:
        srv = Serve(model, device, home)
        try:
            rows = _timed_rows(srv, rules)
            warm = _reply(srv, third) if identity else None
            held = [ln for ln in srv.get("/metrics").splitlines()
                    if ln.startswith(("pocket_mlx_prompt_cache_bytes",
                                      "pocket_mlx_prompt_cache_entries"))]
        finally:
            srv.close()
    if identity:
        with tempfile.TemporaryDirectory(prefix="pocket-prefix-cold-") as cold_home:
            srv = Serve(model, device, cold_home, "--prompt-cache-mb", "0")
            try:
                cold = _reply(srv, third)
            finally:
                srv.close()
    say("\n".join(held))
    say("endpoint   prompt  reused  TTFT_s")
    for name, n, cached, dt in rows:
        say(f"{name:10} {n:6d} {cached:7d} {dt:7.3f}")
    for i in (0, 2):
        say(f"{rows[i][0]}: cold/warm TTFT = {rows[i][3] / rows[i + 1][3]:.1f}x")
    if not identity:
        return True
    for name, (text, cached, dt) in (("warm", warm), ("cold, cache off", cold)):
        say(f"identity, {name}: reused {cached} tokens, {dt:.2f} s: {text!r}")
    same = warm[0] == cold[0]
    say(f"greedy reply identical with and without the cache: {'yes' if same else 'NO'}")
    return same


def session_identity(model, tok, *, device: str, rules: int, n: int, say: Say = print) -> bool:
    """In process: a new conversation behind a stored system prompt gives the token ids a
    session without the store gives; False if not."""
    from pocket_mlx.engine.prompt_cache import PromptCache
    from pocket_mlx.engine.session import ChatSession, Settings

    settings = Settings(system=system_prompt(rules, ""), temperature=0.0, max_tokens=n)

    def reply(session, text):
        t0, ttft, ids = time.perf_counter(), None, []
        for r, _ in session.generate([{"role": "user", "content": text}], settings, device):
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
    say(f"session identity: first conversation TTFT {ttft_first:.2f} s; new conversation "
        f"behind the same system prompt: warm {ttft_warm:.2f} s (reused {reused} tokens, "
        f"{kind} snapshot) vs cold without the store {ttft_cold:.2f} s "
        f"({ttft_cold / ttft_warm:.1f}x); snapshots held {store.ram_used / 2**20:.0f} MiB")
    say(f"  warm token ids: {warm}\n  cold token ids: {cold}")
    say(f"greedy token ids identical with and without the store: "
        f"{'yes' if warm == cold else 'NO'}")
    return warm == cold


def snapshot_cost(model, tok, *, rules: int, interval: int, say: Say = print) -> None:
    """The time of one snapshot of an `interval`-token prefill against that prefill's."""
    import mlx.core as mx

    from pocket_mlx.engine.prompt_cache import PromptCache

    ids = tok.encode(system_prompt(rules * 4, ""))[:interval]
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
    say(f"prefill of {len(ids)} tokens: {prefill:.3f} s; one snapshot of it: {cost * 1e3:.1f} ms "
        f"({store.ram_used / 2**20:.1f} MiB); snapshot/prefill = {cost / prefill:.3%}")
