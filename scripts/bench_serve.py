#!/usr/bin/env python
"""Issue 13's serving benchmark, through real HTTP against a `python -m pocket_mlx serve` child.

(a) aggregate tok/s with 1, 2 and 4 concurrent streaming chat requests (distinct short
    prompts, temperature 0, --max-tokens each), and its ratio to one stream. Wall rate = all
    completion tokens / (first request sent -> last stream's finish chunk), the short prompts'
    prefill included. Decode rate = the tokens after each stream's first / (that wall time -
    the engine's time in prefill, from /metrics' prefill_seconds_total): the engine thread
    either prefills (prompts up to their first token) or runs decode steps of every sequence
    past its first token, so the rest is the time it spent decoding. Per round also the mean
    batch (sequences per decode step) and the time per decode step. The server runs with
    --max-concurrency (default 4; 1 = one request at a time, the unbatched peer).
(b) TTFT (request sent -> first chunk that carries content or the finish reason, through the
    client) of a conversation's 2nd turn whose 1st turn had a ~--prompt-tokens prompt (served
    from the prompt cache), against a cold request of the same length (another part of the
    text, so nothing can hit), and the ratio. The timed requests ask for one token: a
    random-weight synthetic model's tokens often decode to no text for a while (a byte of a
    multi-byte character, a special token), so "first content chunk" would time later tokens;
    with max_tokens 1 the finish chunk follows the first token at once. The 1st turn's reply is
    --reply-tokens long (default 1): such a model's longer replies do not come back as the
    same tokens through the chat template, so the 2nd turn would miss for a reason a real
    model's text rarely has; with one token the cached prefix is the 1st turn's prompt.
(c) the same 2nd turn after a restart of the server with the same --prompt-cache-dir (the disk
    tier), after one short unrelated warm-up request.
(l) long prompt (`--parts l`, issue 28): a stream decodes (short prompt, long reply); once it
    has --lead-pieces pieces, a second request sends a ~--long-tokens prompt. Recorded: the
    decoding stream's gaps between chunks while the long prompt prefills (median, longest) and
    before it (median alone), the long prompt's TTFT, its chunks' prefill times (from the
    server log's progress lines), /metrics' prefill counters, the server's peak RSS
    while serving (/proc/PID/status VmHWM reset after the warm-up, and VmRSS sampled every
    0.25 s; the load's own peak apart) and the planner's figure for the window (`pocket-mlx
    info --context W`'s "serve needs": weights + KV + linear state + the prompt cache's RAM
    budget or a full-window snapshot, the larger). Checks: longest gap <
    3 x the median gap alone + the longest chunk's prefill time; peak RSS within 10% of the
    planner's figure. The server runs with --ctx-size W (the long prompt + 1024, rounded up to
    256) and --max-concurrency 2; its prompt cache at its default RAM budget. Writes
    docs/bench-log/bench-serve-long-<model>.json with --out.

The text comes from assets/text/en.val.txt, counted with the bundled tokenizer (assets/
pocket-tiny), which the synthetic models share. POCKET_MLX_HOME and the prompt cache folder are
temporary and removed at the end. Each server gets one unmeasured warm-up request first.

    python scripts/bench_serve.py [--model synthetic:pocket-35b-e128 | tiny] [--device cpu]
        [--prompt-tokens 2000] [--max-tokens 64] [--json] [--port 8090]
    python scripts/bench_serve.py --parts l [--long-tokens 16384] [--prefill-step 512]
        [--out docs/bench-log/bench-serve-long-pocket-35b-e128.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocket_mlx.engine.tokenizer import load_tokenizer  # noqa: E402 - after the path above

TINY = ROOT / "assets" / "pocket-tiny"
TEXT = ROOT / "assets" / "text" / "en.val.txt"
FOLLOW_UP = "Now summarize the text above in one short sentence."
SHORT_PROMPT_TOKENS = 32  # each concurrent stream's text: short, so prefill stays small
LOAD_TIMEOUT_S = 1800  # building/loading a 35B synthetic folder on a busy CPU takes minutes


# ---- the machine ------------------------------------------------------------------------------

def machine() -> dict:
    """CPU model and vector flags, cores, load average: what the numbers depend on."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(),
                                                         platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux
        pass
    wanted = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_vbmi",
              "avx512_bf16", "amx_tile"]
    return {"cpu": model, "flags": [f for f in wanted if f in flags],
            "cores": os.cpu_count(),
            "threads_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version()}


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


# ---- the server -------------------------------------------------------------------------------

class Server:
    """A `python -m pocket_mlx serve` child; stops with SIGTERM (writes RAM entries to disk)."""

    def __init__(self, model: str, device: str, port: int, cache_dir: Path, home: Path,
                 log: Path, max_concurrency: int = 4, extra: tuple[str, ...] = ()) -> None:
        self.port, self.log = port, log
        cmd = [sys.executable, "-m", "pocket_mlx", "serve", "--port", str(port),
               "--device", device, "--prompt-cache-dir", str(cache_dir),
               "--max-concurrency", str(max_concurrency), *extra]
        if model:
            cmd += ["--model", model]
        env = {**os.environ, "POCKET_MLX_HOME": str(home),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=log.open("a"))
        while time.perf_counter() - t0 < LOAD_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench_serve: the server exited {self.proc.returncode}:\n"
                                 f"{log.read_text()[-3000:]}")
            if self._healthy():
                self.start_s = time.perf_counter() - t0
                self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                            api_key="unused", max_retries=0, timeout=3600)
                self.model_id = self.client.models.list().data[0].id
                return
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"bench_serve: no /health answer in {LOAD_TIMEOUT_S} s; see {log}")

    def _healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=300)  # flushing a few 2k-token caches to disk
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Stream:
    """One streaming chat request's timings (perf_counter seconds) and usage."""

    sent: float = 0.0
    first: float | None = None  # first chunk with content or a finish reason
    done: float | None = None  # the chunk with finish_reason
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    pieces: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def chat(server: Server, messages: list[dict], max_tokens: int,
         barrier: threading.Barrier | None = None) -> Stream:
    """Send one streaming chat request (temperature 0) and time its chunks."""
    s = Stream()
    if barrier is not None:
        barrier.wait()
    s.sent = time.perf_counter()
    chunks = server.client.chat.completions.create(
        model=server.model_id, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    parts = []
    for c in chunks:
        now = time.perf_counter()
        if c.choices:
            ch = c.choices[0]
            if ch.delta.content:
                parts.append(ch.delta.content)
                s.pieces += 1
            if (ch.delta.content or ch.finish_reason) and s.first is None:
                s.first = now
            if ch.finish_reason:
                s.done, s.finish_reason = now, ch.finish_reason
        if c.usage:
            s.prompt_tokens = c.usage.prompt_tokens
            s.completion_tokens = c.usage.completion_tokens
            details = c.usage.prompt_tokens_details
            s.cached_tokens = (details.cached_tokens or 0) if details else 0
    s.text = "".join(parts)
    return s


# ---- the text ---------------------------------------------------------------------------------

class Texts:
    """Slices of en.val.txt by token count, handed out in order so none repeats."""

    def __init__(self) -> None:
        self.tok = load_tokenizer(TINY)
        self.ids = self.tok.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
        self.at = 0

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def prompt_len(self, messages: list[dict]) -> int:
        """Tokens of `messages` as the server will see them (chat template, generation prompt)."""
        return len(self.tok.encode(self.tok.apply_chat_template(messages),
                                   add_special_tokens=False))

    def take(self, n: int, exact: int | None = None) -> str:
        """The next ~n tokens of text (`exact`: re-encoding to exactly that many, if a slice
        within a few tokens of n does)."""
        for d in (0, -1, 1, -2, 2, -3, 3, -4, 4) if exact is not None else (0,):
            end = self.at + n + d
            if end > len(self.ids):
                raise SystemExit(f"bench_serve: {TEXT} has {len(self.ids)} tokens, too few for "
                                 "these prompts; lower --prompt-tokens")
            text = self.tok.decode(self.ids[self.at:end]).strip()
            if exact is None or self.count(text) == exact:
                self.at = end + 1
                return text
        self.at = end + 1
        return text


# ---- the measurements -------------------------------------------------------------------------

def server_metrics(server: Server) -> dict[str, float]:
    """The server's /metrics samples without labels ({name: value})."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("pocket_mlx_") and "{" not in line:
            name, value = line.split()
            out[name[len("pocket_mlx_"):]] = float(value)
    return out


def streams_once(server: Server, texts: Texts, n: int, max_tokens: int) -> dict:
    """(a), one measurement: n concurrent streams, each its own prompt."""
    prompts = [[{"role": "user", "content": "Continue this text: "
                 + texts.take(SHORT_PROMPT_TOKENS)}] for _ in range(n)]
    barrier = threading.Barrier(n)
    out: list[Stream | BaseException] = [None] * n  # type: ignore[list-item]

    def run(i: int, out=out, prompts=prompts, barrier=barrier) -> None:
        try:
            out[i] = chat(server, prompts[i], max_tokens, barrier)
        except BaseException as e:  # noqa: BLE001 - reported below
            out[i] = e

    load0, m0 = loadavg(), server_metrics(server)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in out:
        if isinstance(s, BaseException):
            raise SystemExit(f"bench_serve: a stream failed: {type(s).__name__}: {s}")
    streams: list[Stream] = out  # type: ignore[assignment]
    decode_tokens = sum(max(s.completion_tokens - 1, 0) for s in streams)
    wall = max(s.done for s in streams) - min(s.sent for s in streams)
    m1 = server_metrics(server)
    prefill = m1["prefill_seconds_total"] - m0["prefill_seconds_total"]
    steps = m1["decode_steps_total"] - m0["decode_steps_total"]
    rows = m1["decode_batch_rows_total"] - m0["decode_batch_rows_total"]
    decoding = wall - prefill
    return {
        "streams": n,
        "decode_tok_s": decode_tokens / decoding if decoding else None,
        "wall_tok_s": sum(s.completion_tokens for s in streams) / wall,
        "wall_s": wall,
        "server_prefill_s": prefill,
        "decode_steps": steps,
        "mean_batch": rows / steps if steps else None,
        "step_ms": 1e3 * decoding / steps if steps else None,
        "completion_tokens": [s.completion_tokens for s in streams],
        "prompt_tokens": [s.prompt_tokens for s in streams],
        "cached_tokens": [s.cached_tokens for s in streams],
        "ttft_s": [s.ttft_s for s in streams],
        "finish_reasons": [s.finish_reason for s in streams],
        "loadavg_before": load0,
    }


def concurrency(server: Server, texts: Texts, max_tokens: int, repeats: int,
                say) -> list[dict]:
    """(a): rounds of 1, 2, 4 concurrent streams (interleaved, so a slow phase of the machine
    hits every width); per width the median round, and its ratio to one stream's median."""
    runs: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for r in range(repeats):
        for n in runs:
            run = streams_once(server, texts, n, max_tokens)
            runs[n].append(run)
            say(f"    round {r + 1}, {n} streams: decode {run['decode_tok_s']:.2f} tok/s, "
                f"wall {run['wall_tok_s']:.2f} tok/s")
    rows = [{"streams": n, "decode_tok_s": statistics.median(x["decode_tok_s"] for x in rs),
             "wall_tok_s": statistics.median(x["wall_tok_s"] for x in rs), "runs": rs}
            for n, rs in runs.items()]
    one = rows[0]
    for r in rows:
        r["decode_vs_1"] = r["decode_tok_s"] / one["decode_tok_s"]
        r["wall_vs_1"] = r["wall_tok_s"] / one["wall_tok_s"]
    return rows


def summary(s: Stream) -> dict:
    d = asdict(s)
    d.pop("text")
    for k in ("sent", "first", "done"):
        d.pop(k)
    d["ttft_s"] = s.ttft_s
    return d


@dataclass
class Conversation:
    """(b)'s messages: the first turn, its reply, the second turn, and the cold look-alike."""

    turn1: list[dict]
    turn2: list[dict] = field(default_factory=list)
    cold: list[dict] = field(default_factory=list)


def warm_up(server: Server, texts: Texts) -> Stream:
    """One unmeasured request: first-call costs (page faults, lazy setup) are not timed."""
    return chat(server, [{"role": "user", "content": texts.take(SHORT_PROMPT_TOKENS)}], 16)


# ---- (l) a long prompt beside a decoding stream ----------------------------------------------

class RssSampler(threading.Thread):
    """The server's resident memory: VmRSS every `every_s`, its maximum, and VmHWM (the
    kernel's own peak, load time included) when asked."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s = pid, every_s
        self.max_rss = 0
        self.stop_event = threading.Event()

    def status(self) -> dict[str, int]:
        """VmRSS and VmHWM in bytes ({} when /proc is not there)."""
        out = {}
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
        except OSError:
            pass
        return out

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.max_rss = max(self.max_rss, self.status().get("VmRSS", 0))
            time.sleep(self.every_s)


@dataclass
class Timed:
    """A streaming request's chunk arrival times (perf_counter), usage and end."""

    sent: float = 0.0
    times: list[float] = field(default_factory=list)  # chunks with content
    first: float | None = None  # first chunk with content or a finish reason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


def timed_stream(server: Server, messages: list[dict], max_tokens: int, out: Timed,
                 stop: threading.Event | None = None, started: threading.Event | None = None,
                 lead: int = 0, temperature: float = 0.0) -> None:
    """Stream one chat reply into `out`; `started` is set after `lead` content chunks; the
    stream is closed (the server cancels it) once `stop` is set. The decoding stream samples
    (temperature 1, seed 0): a random-weight model's greedy reply falls into a loop of tokens
    that decode to no text (a byte of a character never completed), so no chunk would come
    to time; sampled tokens are nearly all text, one chunk each."""
    out.sent = time.perf_counter()
    try:
        chunks = server.client.chat.completions.create(
            model=server.model_id, messages=messages, max_tokens=max_tokens,
            temperature=temperature, seed=0, stream=True,
            stream_options={"include_usage": True})
        for c in chunks:
            now = time.perf_counter()
            if c.choices:
                ch = c.choices[0]
                if ch.delta.content:
                    out.times.append(now)
                if (ch.delta.content or ch.finish_reason) and out.first is None:
                    out.first = now
                if ch.finish_reason:
                    out.finish_reason = ch.finish_reason
            if c.usage:
                out.prompt_tokens = c.usage.prompt_tokens
                out.completion_tokens = c.usage.completion_tokens
            if started is not None and len(out.times) >= lead:
                started.set()
            if stop is not None and stop.is_set():
                chunks.close()
                out.finish_reason = out.finish_reason or "closed by the client"
                break
    except Exception as e:  # noqa: BLE001 - reported in the result
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if started is not None:
            started.set()


CHUNK_LINE = re.compile(r"prefill req (\d+): (\d+)/(\d+) tokens, chunk (\d+) in ([0-9.]+) s")


def chunk_times(log: Path, req: int) -> list[tuple[int, float]]:
    """(tokens, seconds) of each prefill chunk of request `req`, from the server's log."""
    out = []
    for m in CHUNK_LINE.finditer(log.read_text(errors="replace")):
        if int(m.group(1)) == req:
            out.append((int(m.group(4)), float(m.group(5))))
    return out


def planner_bytes(model: str, context: int) -> dict:
    """`pocket-mlx info --context` for the window: what the planner says it needs."""
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "info", "--model", model,
                        "--context", str(context), "--json"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        raise SystemExit(f"bench_serve: pocket-mlx info failed: {r.stderr.strip()}")
    d = json.loads(r.stdout)
    return {k: d[k] for k in ("serve_ram_needed_bytes", "ram_needed_bytes", "weights_bytes",
                              "kv_cache_bytes", "linear_state_bytes", "serve_prompt_cache_bytes",
                              "context", "serve_context")}


def gaps(times: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive chunks, for those arriving in (lo, hi]."""
    return [b - a for a, b in zip(times, times[1:]) if lo < b <= hi]


def long_prompt(model: str, args: argparse.Namespace, tmp: Path, texts: Texts, say) -> dict:
    """(l): see the module's docstring."""
    home, cache_dir, log = tmp / "home", tmp / "prompt-cache", tmp / "serve.log"
    overhead = texts.prompt_len([{"role": "user", "content": ""}])
    long_msgs = [{"role": "user", "content": texts.take(args.long_tokens - overhead)}]
    n_long = texts.prompt_len(long_msgs)
    window = -(-(n_long + 1024) // 256) * 256
    short = [{"role": "user", "content": "Continue this text: " + texts.take(SHORT_PROMPT_TOKENS)}]
    r: dict = {"long_prompt_tokens_target": args.long_tokens, "long_prompt_tokens": n_long,
               "ctx_size": window, "prefill_step": args.prefill_step, "max_concurrency": 2}
    r["planner"] = planner_bytes(model, window)
    say(f"(l) long prompt {n_long} tokens, window {window}; planner "
        f"{r['planner']['serve_ram_needed_bytes'] / 2**30:.2f} GiB; starting the server")
    server = Server(model, args.device, args.port, cache_dir, home, log, 2,
                    ("--ctx-size", str(window), "--prefill-step", str(args.prefill_step)))
    sampler = RssSampler(server.proc.pid)
    sampler.start()
    try:
        r["server_start_s"] = server.start_s
        r["warm_up"] = summary(warm_up(server, texts))
        r["rss_after_warm_up_bytes"] = sampler.status().get("VmRSS")
        r["vm_hwm_load_bytes"] = sampler.status().get("VmHWM")
        # From here VmHWM is the serving peak: 5 resets it to the current RSS (Linux 4.0+).
        try:
            Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")
            r["vm_hwm_reset"] = True
        except OSError:
            r["vm_hwm_reset"] = False
        sampler.max_rss = 0
        m0 = server_metrics(server)
        a, b = Timed(), Timed()
        started, stop = threading.Event(), threading.Event()
        ta = threading.Thread(target=timed_stream, args=(server, short, window - 64, a, stop,
                                                         started, args.lead_pieces, 1.0))
        ta.start()
        started.wait()
        if a.error:
            raise SystemExit(f"bench_serve: the decoding stream failed: {a.error}")
        say(f"    stream A decoding ({len(a.times)} pieces); sending the long prompt")
        m_sent = server_metrics(server)
        tb = threading.Thread(target=timed_stream, args=(server, long_msgs, 4, b))
        tb.start()
        m_first = None
        progress_at = time.perf_counter()
        while tb.is_alive():
            tb.join(timeout=1)
            if m_first is None and b.first is not None:
                m_first = server_metrics(server)  # decode steps up to B's first token
            if time.perf_counter() - progress_at >= 60:
                progress_at = time.perf_counter()
                m = server_metrics(server)
                say(f"    prefilled {m['prompt_tokens_prefilled_total']:.0f} tokens, pending "
                    f"{m['prefill_tokens_pending']:.0f}; stream A {len(a.times)} pieces; RSS "
                    f"{sampler.max_rss / 2**30:.2f} GiB max")
        # A few more of A's tokens after B's first, then A is closed (the server cancels it).
        if m_first is None:
            m_first = server_metrics(server)
        n_after = len(a.times)
        while ta.is_alive() and len(a.times) < n_after + 4:
            time.sleep(0.05)
        stop.set()
        ta.join()
        if b.error or b.first is None:
            raise SystemExit(f"bench_serve: the long prompt failed: {b.error}")
        m1 = server_metrics(server)
        st = sampler.status()
        steps_during = m_first["decode_steps_total"] - m_sent["decode_steps_total"]
    finally:
        sampler.stop_event.set()
        server.stop()
    req = 3  # the warm-up is request 1, A 2, B 3
    chunks = chunk_times(log, req)
    during = gaps(a.times, b.sent, b.first)
    alone = gaps(a.times, 0, b.sent)
    chunk_max = max((c[1] for c in chunks), default=0.0)
    med_alone = statistics.median(alone) if alone else None
    peak = max(st.get("VmHWM", 0) if r["vm_hwm_reset"] else 0, sampler.max_rss)
    # The server's own planner figure (weights as loaded: float parts in float32 on the CPU);
    # `info`'s, from the weights as stored, is kept beside it.
    planner = m1.get("planned_ram_bytes") or r["planner"]["serve_ram_needed_bytes"]
    r["planner_server_bytes"] = m1.get("planned_ram_bytes")
    r.update({
        "long_ttft_s": b.first - b.sent,
        "long_prompt_tokens_served": b.prompt_tokens,
        "stream_a_pieces_during_prefill": len(during),
        "stream_a_gap_median_alone_s": med_alone,
        "stream_a_gap_median_during_s": statistics.median(during) if during else None,
        "stream_a_gap_longest_during_s": max(during) if during else None,
        "stream_a_completion_tokens": a.completion_tokens,
        "stream_a_pieces": len(a.times),
        "decode_steps_during_prefill": steps_during,
        "chunks": len(chunks),
        "chunk_s_median": statistics.median(c[1] for c in chunks) if chunks else None,
        "chunk_s_longest": chunk_max,
        "chunk_tokens": [c[0] for c in chunks],
        "chunk_s": [c[1] for c in chunks],
        "metrics_prefilled_tokens": m1["prompt_tokens_prefilled_total"]
        - m0["prompt_tokens_prefilled_total"],
        "metrics_prefill_chunks": m1["prefill_chunk_seconds_count"]
        - m0["prefill_chunk_seconds_count"],
        "peak_rss_bytes": peak,
        "vm_hwm_bytes": st.get("VmHWM"),
        "max_sampled_rss_bytes": sampler.max_rss,
        "peak_vs_planner": peak / planner,
    })
    # The server's view of stream A's tokens (the only reply decoding while B prefills): mean
    # gap alone (A's tokens before B was sent) and during B's prefill, from the token-latency
    # histogram's sum and count, and the longest gap (A's, the warm-up's are short). Used for
    # the check when too few chunks carried text (a random-weight model's tokens often decode
    # to none: then the client sees no gaps to time).
    def mean_gap(m_a: dict, m_b: dict) -> float | None:
        n = m_b["token_latency_seconds_count"] - m_a["token_latency_seconds_count"]
        return (m_b["token_latency_seconds_sum"] - m_a["token_latency_seconds_sum"]) / n \
            if n else None

    r["server_gap_mean_alone_s"] = mean_gap(m0, m_sent)
    r["server_gap_mean_during_s"] = mean_gap(m_sent, m_first)
    r["server_gap_longest_s"] = m1.get("token_latency_max_seconds")
    r["server_tokens_during_prefill"] = (m_first["token_latency_seconds_count"]
                                         - m_sent["token_latency_seconds_count"])
    if len(during) >= 3 and med_alone is not None:
        r["gap_source"] = "client: stream A's chunks (median alone)"
        r["check_gap"] = max(during) < 3 * med_alone + chunk_max
    else:
        r["gap_source"] = "server: token latency (mean alone, longest)"
        r["check_gap"] = bool(r["server_gap_mean_alone_s"] and r["server_gap_longest_s"]
                              and r["server_gap_longest_s"]
                              < 3 * r["server_gap_mean_alone_s"] + chunk_max)
    r["check_rss_within_10pct"] = abs(peak / planner - 1) <= 0.10
    r["log_tail"] = log.read_text(errors="replace").splitlines()[-8:]
    return r


def report_long(r: dict) -> None:
    """(l)'s table."""
    m, lp = r["machine"], r["long"]
    gib = 2**30
    print(f"model {r['model']} on {r['device']}; CPU: {m['cpu']}; flags: "
          f"{' '.join(m['flags'])}; {m['cores']} cores; load average start "
          f"{r['loadavg_start']}, end {r['loadavg_end']}")
    rows = [
        ("long prompt", f"{lp['long_prompt_tokens_served']} tokens (window --ctx-size "
                        f"{lp['ctx_size']}, --prefill-step {lp['prefill_step']})"),
        ("long prompt TTFT", f"{lp['long_ttft_s']:.1f} s"),
        ("prefill chunks", f"{lp['chunks']}: median {lp['chunk_s_median']:.2f} s, longest "
                           f"{lp['chunk_s_longest']:.2f} s"),
        ("/metrics", f"prefilled {lp['metrics_prefilled_tokens']:.0f} tokens in "
                     f"{lp['metrics_prefill_chunks']:.0f} chunks"),
        ("stream A gaps", f"median alone {1e3 * lp['stream_a_gap_median_alone_s']:.1f} ms; "
                          f"during the prefill: {lp['stream_a_pieces_during_prefill']} pieces, "
                          f"median {1e3 * (lp['stream_a_gap_median_during_s'] or 0):.1f} ms, "
                          f"longest {1e3 * (lp['stream_a_gap_longest_during_s'] or 0):.1f} ms"),
        ("server gaps", f"mean alone {1e3 * (lp['server_gap_mean_alone_s'] or 0):.1f} ms; "
                        f"during the prefill: {lp['server_tokens_during_prefill']:.0f} tokens, "
                        f"mean {1e3 * (lp['server_gap_mean_during_s'] or 0):.1f} ms, longest "
                        f"{1e3 * (lp['server_gap_longest_s'] or 0):.1f} ms"),
        ("gap check", f"longest < 3 x typical gap alone + longest chunk "
                      f"({lp['gap_source']}): {lp['check_gap']}; "
                      f"decode steps during the prefill: {lp['decode_steps_during_prefill']:.0f}"),
        ("peak RSS", f"{lp['peak_rss_bytes'] / gib:.2f} GiB while serving (VmHWM "
                     f"{(lp['vm_hwm_bytes'] or 0) / gib:.2f} since the warm-up, sampled max "
                     f"{lp['max_sampled_rss_bytes'] / gib:.2f}; after warm-up "
                     f"{(lp['rss_after_warm_up_bytes'] or 0) / gib:.2f}, load peak "
                     f"{(lp['vm_hwm_load_bytes'] or 0) / gib:.2f})"),
        ("planner", f"server {(lp['planner_server_bytes'] or 0) / gib:.2f} GiB (weights as "
                    f"loaded); info: serve needs "
                    f"{lp['planner']['serve_ram_needed_bytes'] / gib:.2f} GiB at "
                    f"{lp['planner']['context']} tokens (weights + cache "
                    f"{lp['planner']['ram_needed_bytes'] / gib:.2f} GiB + prompt cache); peak / "
                    f"planner {lp['peak_vs_planner']:.3f}; within 10%: "
                    f"{lp['check_rss_within_10pct']}"),
    ]
    for k, v in rows:
        print(f"  {k:<18} {v}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:pocket-35b-e128",
                    help="model for `serve --model`; 'tiny' = the bundled pocket-tiny "
                         "(default: synthetic:pocket-35b-e128)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=2000,
                    help="the first turn's prompt length in (b), chat template included")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream in (a)")
    ap.add_argument("--reply-tokens", type=int, default=1,
                    help="max_tokens of the first turn's reply in (b) (the timed requests ask "
                         "for one token)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of (a) (1, 2 and 4 streams each); medians are reported")
    ap.add_argument("--parts", default="abc",
                    help="'a' alone skips (b) and (c) (they need two cold --prompt-tokens "
                         "prefills); (b) and (c) always run together; 'l' alone: the long-prompt "
                         "run (l)")
    ap.add_argument("--max-concurrency", type=int, default=4,
                    help="the server's --max-concurrency (1: one request at a time, the "
                         "others queued: the unbatched peer)")
    ap.add_argument("--long-tokens", type=int, default=16384,
                    help="(l): the long prompt's length, chat template included")
    ap.add_argument("--prefill-step", type=int, default=512,
                    help="(l): the server's --prefill-step")
    ap.add_argument("--lead-pieces", type=int, default=16,
                    help="(l): pieces the decoding stream has before the long prompt is sent")
    ap.add_argument("--out", type=Path, default=None,
                    help="(l): also write the result as JSON there (e.g. docs/bench-log/bench-serve-long-"
                         "pocket-35b-e128.json)")
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temporary folder (server logs, prompt cache)")
    args = ap.parse_args()
    model = str(TINY) if args.model in ("tiny", "pocket-tiny") else args.model

    def say(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="pocket-mlx-bench-serve-"))
    home, cache_dir, log = tmp / "home", tmp / "prompt-cache", tmp / "serve.log"
    home.mkdir()
    texts = Texts()
    result: dict = {"model": args.model, "device": args.device, "machine": machine(),
                    "max_concurrency": args.max_concurrency,
                    "loadavg_start": loadavg(), "max_tokens": args.max_tokens,
                    "reply_tokens": args.reply_tokens, "prompt_tokens_target": args.prompt_tokens}
    if args.parts == "l":
        try:
            result["long"] = long_prompt(model, args, tmp, texts, say)
        finally:
            result["loadavg_end"] = loadavg()
            if args.keep:
                say(f"kept {tmp}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        if args.out is not None:
            part = args.out.with_name(args.out.name + ".part")
            part.write_text(json.dumps(result, indent=2) + "\n")
            part.replace(args.out)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            report_long(result)
        return 0
    # (b)'s texts first: the two long ones, the same token count.
    overhead = texts.prompt_len([{"role": "user", "content": ""}])
    n_long = args.prompt_tokens - overhead
    long_a = texts.take(n_long)
    long_b = texts.take(n_long, exact=texts.count(long_a))
    server = None
    try:
        say(f"starting the server ({model}, {args.device}); log {log}")
        server = Server(model, args.device, args.port, cache_dir, home, log,
                        args.max_concurrency)
        result["server_start_s"] = server.start_s
        say(f"up in {server.start_s:.1f} s; warm-up request")
        result["warm_up_1"] = summary(warm_up(server, texts))

        say(f"(a) 1, 2, 4 concurrent streams, {args.repeats} rounds")
        result["concurrency"] = concurrency(server, texts, args.max_tokens, args.repeats, say)
        if "b" in args.parts or "c" in args.parts:

            say(f"(b) first turn: {texts.prompt_len([{'role': 'user', 'content': long_a}])} "
                "prompt tokens (cold)")
            conv = Conversation([{"role": "user", "content": long_a}])
            t1 = chat(server, conv.turn1, args.reply_tokens)
            conv.turn2 = conv.turn1 + [{"role": "assistant", "content": t1.text},
                                       {"role": "user", "content": FOLLOW_UP}]
            conv.cold = [{"role": "user", "content": long_b},
                         {"role": "assistant", "content": t1.text},
                         {"role": "user", "content": FOLLOW_UP}]
            say(f"    TTFT {t1.ttft_s:.2f} s; second turn")
            t2 = chat(server, conv.turn2, 1)
            say(f"    TTFT {t2.ttft_s:.3f} s ({t2.cached_tokens} of {t2.prompt_tokens} cached); "
                "cold request of the same length")
            cold = chat(server, conv.cold, 1)
            say(f"    TTFT {cold.ttft_s:.2f} s ({cold.cached_tokens} of {cold.prompt_tokens} "
                "cached)")
            result["turn1"], result["turn2"], result["cold"] = map(summary, (t1, t2, cold))
            result["turn2_speedup"] = cold.ttft_s / t2.ttft_s

            say("(c) restarting the server with the same --prompt-cache-dir")
            server.stop()
            server = None
            result["cache_files"] = len(list(cache_dir.rglob("*.safetensors")))
            result["cache_dir_bytes"] = sum(f.stat().st_size for f in cache_dir.rglob("*")
                                            if f.is_file())
            server = Server(model, args.device, args.port, cache_dir, home, log,
                            args.max_concurrency)
            result["server_restart_s"] = server.start_s
            result["warm_up_2"] = summary(warm_up(server, texts))
            t2d = chat(server, conv.turn2, 1)
            say(f"    TTFT {t2d.ttft_s:.3f} s ({t2d.cached_tokens} of {t2d.prompt_tokens} cached)")
            result["turn2_disk"] = summary(t2d)
            result["turn2_disk_speedup"] = cold.ttft_s / t2d.ttft_s
            result["same_reply_after_restart"] = t2d.text == t2.text
    finally:
        if server is not None:
            server.stop()
        result["loadavg_end"] = loadavg()
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    return finish(result, args)


def finish(result: dict, args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)
    return 0


def report(r: dict) -> None:
    m = r["machine"]
    print(f"model {r['model']} on {r['device']}; server start {r['server_start_s']:.1f} s")
    print(f"CPU: {m['cpu']}; flags: {' '.join(m['flags']) or 'none of AVX2/AVX-512'}; "
          f"{m['cores']} cores ({m['threads_usable']} usable); {m['system']}")
    print(f"load average: start {r['loadavg_start']}, end {r['loadavg_end']}")
    print(f"\n(a) concurrent streaming clients, max_tokens {r['max_tokens']}, temperature 0")
    print(f"server --max-concurrency {r['max_concurrency']}")
    print("streams  decode tok/s  vs 1  wall tok/s  vs 1  (medians)  decode tok/s per round"
          "  [mean batch, ms per step]")
    for c in r["concurrency"]:
        each = " ".join(f"{x['decode_tok_s']:.2f}" for x in c["runs"])
        steps = " ".join(f"[{x['mean_batch']:.2f}, {x['step_ms']:.0f}]" for x in c["runs"]
                         if x.get("mean_batch"))
        print(f"{c['streams']:>7}  {c['decode_tok_s']:>12.2f}  {c['decode_vs_1']:>4.2f}  "
              f"{c['wall_tok_s']:>10.2f}  {c['wall_vs_1']:>4.2f}  {'':>9}  {each}  {steps}")
    if "turn2" not in r:
        return
    print(f"\nserver restart {r['server_restart_s']:.1f} s")
    print("\n(b)/(c) TTFT (request sent -> first chunk with content or finish reason)")
    for key, label in (("turn1", "1st turn (cold)"), ("turn2", "2nd turn (RAM cache)"),
                       ("cold", "cold, same length"), ("turn2_disk", "2nd turn after restart")):
        s = r[key]
        print(f"  {label:<24} {s['ttft_s']:>8.3f} s  prompt {s['prompt_tokens']} tokens, "
              f"{s['cached_tokens']} cached")
    print(f"  cold / 2nd turn: {r['turn2_speedup']:.1f}x (RAM), "
          f"{r['turn2_disk_speedup']:.1f}x (disk, after restart); same reply after restart: "
          f"{r['same_reply_after_restart']}")


if __name__ == "__main__":
    sys.exit(main())
