"""Streaming generation: chunked prefill, pipelined decode, sampling, stops and live stats.

Generation runs on the stream of the chosen device (see `devices`), never on a stream fixed at
import time, so one loaded model can generate on the GPU, then on the CPU, without reloading.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from pocket_mlx.analysis.accounting import weight_stats
from pocket_mlx.engine import devices
from pocket_mlx.errors import PocketError
from pocket_mlx.system.memory import wired_limit


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise PocketError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise PocketError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise PocketError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise PocketError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise PocketError(f"repetition penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    ttft_s: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory_gb: float = 0.0
    bytes_per_token: int = 0
    device: str = "cpu"
    phase: str = "prefill"  # prefill | decode | done
    prefill_done: int = 0
    finish_reason: str | None = None  # eos | stop | length | context | cancelled

    @property
    def gbps(self) -> float:
        """Effective bandwidth: weights read per token x decode tokens per second."""
        return self.bytes_per_token * self.generation_tps / 1e9

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Response:
    text: str  # the new piece of text (may be empty)
    token: int | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    # On the last response only: the tokens this call fed into the cache (prompt, then reply
    # tokens), so a chat can continue from the cache and prefill only what is new. None when the
    # cache was left part-way (cancelled during prefill) and must not be reused.
    fed_tokens: list[int] | None = None


def make_sampler(p: SamplingParams) -> Callable[[mx.array], mx.array]:
    # mlx-lm's samplers are reused on purpose: generic, well tested, and they compile well.
    from mlx_lm.sample_utils import make_sampler as _make

    return _make(temp=p.temperature, top_p=p.top_p if p.top_p < 1 else 0.0, min_p=p.min_p,
                 top_k=p.top_k)


def make_logits_processors(p: SamplingParams) -> list:
    if p.repetition_penalty == 1.0:
        return []
    from mlx_lm.sample_utils import make_logits_processors as _make

    return _make(repetition_penalty=p.repetition_penalty,
                 repetition_context_size=p.repetition_context)


def context_limit(model) -> int:
    return int(model.args.max_position_embeddings)


def prompt_tokens(tokenizer, prompt: str | list[dict] | list[int], *, system: str | None = None,
                  raw: bool = False) -> list[int]:
    """Token ids for a prompt: a string (chat-templated unless `raw`), messages, or ids."""
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        ids = list(prompt)
    elif isinstance(prompt, list):
        msgs = ([{"role": "system", "content": system}] if system else []) + prompt
        ids = tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    elif raw:
        ids = tokenizer.encode(prompt)
    else:
        msgs = ([{"role": "system", "content": system}] if system else [])
        msgs.append({"role": "user", "content": prompt})
        ids = tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    if not ids:
        raise PocketError("the prompt is empty")
    return ids


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still become a stop string."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


def stream_generate(
    model,
    tokenizer,
    prompt: str | list[dict] | list[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: list[str] | None = None,
    device: str | None = None,
    system: str | None = None,
    raw: bool = False,
    cache: list | None = None,
    prefill_step: int = 512,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    warn: Callable[[str], object] | None = None,
    **sampling_kwargs,
) -> Iterator[Response]:
    """Yield `Response`s: text pieces as they decode, each with live stats; the last has
    `stats.finish_reason` set. Pass `cache` (from `model.make_cache()`) to continue a
    conversation: only the new tokens are prefilled. `warn` receives one-off warnings (the
    GPU memory one); default: stderr."""
    sampling = sampling or SamplingParams(**sampling_kwargs)
    sampling.validate()
    if max_tokens < 0:
        raise PocketError(f"max tokens must be >= 0, got {max_tokens}")
    dev = devices.resolve_device(device or getattr(model, "device", None))
    stream = devices.stream_for(dev)
    ids = prompt_tokens(tokenizer, prompt, system=system, raw=raw)
    if cache is None:
        cache = model.make_cache()
    start_pos = _cache_offset(cache)
    limit = context_limit(model)
    if start_pos + len(ids) >= limit:
        raise PocketError(f"the prompt ({start_pos + len(ids)} tokens) does not fit the "
                          f"context of {limit} tokens")
    stops = [s for s in (stop or []) if s]
    eos = set(tokenizer.eos_token_ids)
    sampler = make_sampler(sampling)
    processors = make_logits_processors(sampling)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)

    weights = weight_stats(model)
    stats = GenerationStats(prompt_tokens=len(ids), bytes_per_token=weights.bytes_per_token,
                            device=dev)
    # On the GPU, wire the model's memory for the duration (restored when the generator ends).
    wired = ExitStack()
    if dev == "gpu":
        warn = warn or (lambda m: print(m, file=sys.stderr))
        wired.enter_context(wired_limit(weights.bytes_total, dev, streams=[stream], warn=warn))
    room = limit - start_pos - len(ids)  # tokens that still fit the context

    def run() -> Iterator[Response]:
        """Prefill, then decode (arguments checked above)."""
        mx.reset_peak_memory()
        history = mx.array(ids, mx.uint32)
        fed = list(ids)  # tokens the cache will have consumed

        def step(tokens: mx.array, hist: mx.array) -> tuple[mx.array, mx.array]:
            logits = model(tokens[None], cache=cache)[:, -1, :]
            for proc in processors:
                logits = proc(hist, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return sampler(logprobs), logprobs

        t0 = time.perf_counter()
        with mx.stream(stream):
            # Prefill all but the last prompt token in chunks, evaluating caches as we go.
            rest = mx.array(ids, mx.uint32)
            done = 0
            while rest.size > 1:
                n = min(prefill_step, rest.size - 1)
                model(rest[:n][None], cache=cache)
                mx.eval([a for c in cache for a in _cache_arrays(c)])
                rest = rest[n:]
                done += n
                stats.prefill_done = done
                if progress:
                    progress(done, len(ids))
                if should_stop and should_stop():
                    stats.finish_reason = "cancelled"
                    stats.phase = "done"
                    yield Response("", None, stats, fed_tokens=None)
                    return
            y, _ = step(rest, history)
            mx.async_eval(y)
        detok = tokenizer.detokenizer()
        pending = ""  # decoded text held back because it might start a stop string
        n = 0  # tokens sampled so far
        t_decode = None
        while True:
            if n >= max_tokens or n >= room:
                stats.finish_reason = "length" if n >= max_tokens else "context"
                break
            if should_stop and should_stop():
                stats.finish_reason = "cancelled"
                break
            # Queue the next step from the still-lazy token before waiting for it: building the
            # graph in Python overlaps the device's work on the current step (as mlx-lm does).
            y_next = None
            if n + 1 < max_tokens and n + 1 < room:
                if processors:
                    history = mx.concatenate([history, y.astype(mx.uint32)])
                with mx.stream(stream):
                    y_next, _ = step(y.astype(mx.uint32), history)
                    mx.async_eval(y_next)
            token = y.item()
            if n == 0:
                t_decode = time.perf_counter()
                stats.ttft_s = t_decode - t0
                stats.prompt_tps = len(ids) / stats.ttft_s
                stats.phase = "decode"
                if progress:
                    progress(len(ids), len(ids))
            if y_next is not None:
                fed.append(token)
            if token in eos:
                stats.finish_reason = "eos"
                break
            n += 1
            pending += detok.add(token)
            stats.generation_tokens = n
            if n > 1:
                stats.generation_tps = (n - 1) / (time.perf_counter() - t_decode)
            hit = next((s for s in stops if s in pending), None)
            if hit is not None:
                piece = pending[: pending.index(hit)]
                stats.finish_reason = "stop"
                if piece:
                    yield Response(piece, token, stats)
                break
            hold = _stop_holdback(pending, stops) if stops else 0
            piece, pending = pending[: len(pending) - hold], pending[len(pending) - hold:]
            yield Response(piece, token, stats)
            if y_next is None:
                continue  # the checks at the top end the loop
            y = y_next
        if stats.finish_reason not in ("stop",):
            tail = pending + detok.flush()
            if tail:
                yield Response(tail, None, stats)
        stats.phase = "done"
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        if t_decode is not None and n > 1:
            stats.generation_tps = (n - 1) / (time.perf_counter() - t_decode)
        yield Response("", None, stats, fed_tokens=fed)

    with wired:
        yield from run()


def _cache_arrays(c) -> list[mx.array]:
    if hasattr(c, "arrays"):
        return c.arrays
    return [a for a in (getattr(c, "keys", None), getattr(c, "values", None)) if a is not None]


def _cache_offset(cache: list) -> int:
    return max((getattr(c, "offset", 0) for c in cache), default=0)


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole reply as one string."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
