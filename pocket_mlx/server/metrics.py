"""Counters, gauges and histograms for GET /metrics, in Prometheus' text format (0.0.4).

Written by hand rather than with prometheus_client: a dozen series need ~100 lines, and the
server then depends on nothing but Starlette and uvicorn. Updated from the engine thread and the
event loop alike, so every change takes one lock.
"""

from __future__ import annotations

import threading
from bisect import bisect_left

# Seconds. TTFT spans a tiny model on a GPU (ms) to a 4k-token prompt on a CPU (minutes).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Seconds per prefill chunk (512 tokens by default): ms on a GPU to ~30 s for the 35B shape on a
# 2-core CPU.
CHUNK_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1


class Metrics:
    """What the server has done since it started."""

    def __init__(self, bytes_per_token: int = 0) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cache_lookups = 0
        self.cache_hits = 0
        self.cached_tokens = 0
        self.cached_by_kind: dict[str, int] = {}  # snapshot kind -> prompt tokens reused
        self.cancelled = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.token_latency = Histogram(TOKEN_BUCKETS)
        self.decode_tps = 0.0  # of the last reply with 2+ tokens
        self.decode_steps = 0  # batched decode steps (one forward each)
        self.decode_rows = 0  # sequences those steps advanced, summed
        self.batch_size = 0  # sequences in the last step
        self.prefill_s = 0.0  # engine time in prefill (chunks and first tokens)
        self.prefilled = 0  # prompt tokens run through the model (not from the prompt cache)
        self.prefill_chunk_s = Histogram(CHUNK_BUCKETS)
        self.prefilling = 0  # requests holding a slot, still prefilling (gauge)
        self.pending = 0  # their prompt tokens not yet prefilled (gauge)
        self.planned_ram_bytes = 0  # the memory planner's figure for this server's window
        self.token_latency_max = 0.0  # the longest gap between two tokens of one reply
        self.bytes_per_token = bytes_per_token
        self.drafted = self.accepted = 0  # speculative decoding's drafts (serve --speculative)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def cache_lookup(self, n_cached: int, kind: str | None = None) -> None:
        """One prompt-cache lookup that reused `n_cached` tokens from a snapshot of `kind`
        (boundary | interval | end; None when the store does not say)."""
        with self._lock:
            self.cache_lookups += 1
            if n_cached:
                self.cache_hits += 1
                self.cached_tokens += n_cached
                k = kind or "unknown"
                self.cached_by_kind[k] = self.cached_by_kind.get(k, 0) + n_cached

    def first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def token(self, latency_s: float) -> None:
        with self._lock:
            self.token_latency.observe(latency_s)
            self.token_latency_max = max(self.token_latency_max, latency_s)

    def prefill(self, seconds: float) -> None:
        with self._lock:
            self.prefill_s += seconds

    def prefill_chunk(self, tokens: int, seconds: float) -> None:
        """One prefill chunk (or a prompt's last token, fed alone) of `tokens` took `seconds`."""
        with self._lock:
            self.prefilled += tokens
            self.prefill_chunk_s.observe(seconds)

    def prefill_pending(self, requests: int, tokens: int) -> None:
        """Now: `requests` prompts still prefilling, `tokens` of them left to prefill."""
        with self._lock:
            self.prefilling, self.pending = requests, tokens

    def step(self, batch_size: int) -> None:
        """One decode step advanced `batch_size` sequences together."""
        with self._lock:
            self.decode_steps += 1
            self.decode_rows += batch_size
            self.batch_size = batch_size

    def speculative(self, drafted: int, accepted: int) -> None:
        """The batch's running totals of drafts proposed and kept."""
        with self._lock:
            self.drafted, self.accepted = drafted, accepted

    def reply(self, prompt_tokens: int, completion_tokens: int, decode_tps: float,
              cancelled: bool) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.cancelled += cancelled
            if completion_tokens > 1 and decode_tps > 0:
                self.decode_tps = decode_tps

    def render(self, active: int, queued: int, cache: dict | None = None) -> str:
        """The exposition text; `active`, `queued` and the prompt cache's `stats()` are read
        from the engine now."""
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]):
            out.append(f"# HELP pocket_mlx_{name} {help_text}")
            out.append(f"# TYPE pocket_mlx_{name} {kind}")
            for labels, value in samples:
                v = int(value) if float(value).is_integer() else value
                out.append(f"pocket_mlx_{name}{labels} {v}")

        def histogram(name: str, help_text: str, h: Histogram) -> None:
            samples, total = [], 0
            for bound, n in zip((*h.buckets, "+Inf"), h.counts):
                total += n
                samples.append((f'_bucket{{le="{bound}"}}', total))
            samples += [("_sum", h.sum), ("_count", h.count)]
            metric(name, "histogram", help_text, samples)

        with self._lock:
            metric("requests_total", "counter", "HTTP requests by endpoint and status.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n)
                    for (e, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished replies.",
                   [("", self.prompt_tokens)])
            metric("completion_tokens_total", "counter", "Tokens generated.",
                   [("", self.completion_tokens)])
            metric("cancelled_total", "counter", "Replies stopped because the client left.",
                   [("", self.cancelled)])
            metric("prompt_cache_lookups_total", "counter", "Prompt-cache lookups.",
                   [("", self.cache_lookups)])
            metric("prompt_cache_hits_total", "counter", "Prompt-cache lookups that found a "
                   "prefix.", [("", self.cache_hits)])
            metric("prompt_cache_tokens_total", "counter", "Prompt tokens served from the "
                   "prompt cache instead of prefilled.", [("", self.cached_tokens)])
            metric("prompt_cache_reused_tokens_total", "counter", "Prompt tokens reused, by the "
                   "kind of snapshot (boundary: a message boundary inside a prompt; interval: "
                   "every N tokens of a prompt; end: the end of a prompt or reply).",
                   [(f'{{kind="{k}"}}', n) for k, n in sorted(self.cached_by_kind.items())])
            histogram("ttft_seconds", "Time from start of generation to the first token.",
                      self.ttft)
            histogram("token_latency_seconds", "Time between two generated tokens.",
                      self.token_latency)
            metric("decode_tokens_per_second", "gauge", "Decode rate of the last reply.",
                   [("", round(self.decode_tps, 3))])
            metric("weight_bytes_per_token", "gauge", "Bytes of weights read per decoded "
                   "token.", [("", self.bytes_per_token)])
            metric("decode_gigabytes_per_second", "gauge", "Weights read per second while "
                   "decoding the last reply (bytes per token x tokens per second / 1e9).",
                   [("", round(self.bytes_per_token * self.decode_tps / 1e9, 3))])
            metric("decode_steps_total", "counter", "Decode steps (one forward of every "
                   "sequence decoding together).", [("", self.decode_steps)])
            metric("decode_batch_rows_total", "counter", "Sequences advanced by decode steps, "
                   "summed (divided by the steps: the mean batch size).", [("", self.decode_rows)])
            metric("decode_batch_size", "gauge", "Sequences in the last decode step.",
                   [("", self.batch_size)])
            metric("speculative_drafted_tokens_total", "counter", "Tokens drafted by "
                   "--speculative (verify passes of a request decoding alone).",
                   [("", self.drafted)])
            metric("speculative_accepted_tokens_total", "counter", "Drafted tokens the verify "
                   "passes kept.", [("", self.accepted)])
            metric("prefill_seconds_total", "counter", "Time the engine spent prefilling "
                   "prompts (up to each one's first token); the rest of its busy time decodes.",
                   [("", round(self.prefill_s, 6))])
            metric("prompt_tokens_prefilled_total", "counter", "Prompt tokens run through "
                   "the model (those the prompt cache supplied excluded); counted per chunk, so "
                   "a long prompt's progress shows while it prefills.", [("", self.prefilled)])
            metric("prefill_tokens_pending", "gauge", "Prompt tokens of the requests holding a "
                   "slot not yet prefilled.", [("", self.pending)])
            metric("prefill_requests", "gauge", "Requests holding a slot, still prefilling.",
                   [("", self.prefilling)])
            metric("token_latency_max_seconds", "gauge", "The longest time between two "
                   "tokens of one reply since the server started (a stall: another request's "
                   "prefill chunk, a prompt-cache snapshot written to disk).",
                   [("", round(self.token_latency_max, 6))])
            metric("planned_ram_bytes", "gauge", "What the memory planner says the server "
                   "holds with one sequence at a full window: weights as loaded, its cache, the "
                   "prompt cache's budget or a full-window snapshot (the larger).",
                   [("", self.planned_ram_bytes)])
            histogram("prefill_chunk_seconds", "Time of one prefill chunk (up to the prefill "
                      "step's tokens; a prompt's last token is one of its own).",
                      self.prefill_chunk_s)
        metric("active_requests", "gauge", "Requests generating now.", [("", active)])
        metric("queued_requests", "gauge", "Requests waiting for a slot.", [("", queued)])
        if cache:
            metric("prompt_cache_bytes", "gauge", "Bytes the prompt cache holds, by tier.",
                   [('{tier="ram"}', cache["ram_bytes"]), ('{tier="disk"}', cache["disk_bytes"])])
            metric("prompt_cache_entries", "gauge", "Cached token sequences, by tier.",
                   [('{tier="ram"}', cache["entries_ram"]),
                    ('{tier="disk"}', cache["entries_disk"])])
            metric("prompt_cache_spills_total", "counter", "Entries moved from RAM to disk.",
                   [("", cache["spills"])])
            metric("prompt_cache_restores_total", "counter", "Entries read back from disk.",
                   [("", cache["restores"])])
        return "\n".join(out) + "\n"
