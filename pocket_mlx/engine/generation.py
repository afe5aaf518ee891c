"""Streaming generation: chunked prefill, pipelined decode, sampling, stops and live stats.

Two layers, as in mlx-lm: `generate_step` turns prompt token ids into (token, logprobs) pairs
(prefill, decode, sampling); `stream_generate` wraps it with the chat template, the
detokenizer, stop strings, the context limit and live stats.

Generation runs on the stream of the chosen device (see `devices`), never on a stream fixed at
import time, so one loaded model can generate on the GPU, then on the CPU, without reloading:
the model's float dtype follows the device (`loader.use_device`).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from pocket_mlx.engine import devices
from pocket_mlx.engine.drafters import (
    DEFAULT_NUM_DRAFT_TOKENS,
    Drafter,
    check_num_draft_tokens,
    make_drafter,
)
from pocket_mlx.engine.loader import model_weight_stats, use_device
from pocket_mlx.engine.params import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREFILL_STEP,
    DEFAULT_REPETITION_CONTEXT,
    check_max_tokens,
    check_min_p,
    check_prefill_step,
    check_repetition_context,
    check_repetition_penalty,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_p,
    checked,
)
from pocket_mlx.engine.reasoning import ReasoningTracker, thinking_for, tracker_for
from pocket_mlx.engine.sampling import Sampler, processors_for, sample, sampler_for
from pocket_mlx.engine.snapshot_points import chunk_size
from pocket_mlx.engine.speculative import SpecCounts, speculative_step
from pocket_mlx.errors import PocketError
from pocket_mlx.models.verify import batched_rows_exact
from pocket_mlx.system.memory import wired_limit


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = DEFAULT_REPETITION_CONTEXT
    seed: int | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> SamplingParams:
        """From keywords: `temperature` or mlx-lm's `temp` (not both with different values),
        and the other fields by name. The one place `temp` is understood."""
        kwargs = dict(kwargs)
        if "temp" in kwargs and "temperature" in kwargs:
            temp, temperature = kwargs.pop("temp"), kwargs["temperature"]
            if temp != temperature:
                raise PocketError(f"temp={temp} and temperature={temperature} disagree: "
                                  "give one of them")
        elif "temp" in kwargs:
            kwargs["temperature"] = kwargs.pop("temp")
        unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        return cls(**kwargs)

    def validate(self) -> None:
        """The ranges of engine/params.py; a bad value is a one-line PocketError."""
        checked(check_temperature, self.temperature)
        checked(check_top_p, self.top_p)
        checked(check_top_k, self.top_k)
        checked(check_min_p, self.min_p)
        checked(check_repetition_penalty, self.repetition_penalty)
        checked(check_repetition_context, self.repetition_context)
        if self.seed is not None:
            checked(check_seed, self.seed)


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
    stop_string: str | None = None  # the stop string that ended the reply (finish_reason stop)
    speculative: dict | None = None  # SpecCounts.to_dict() when decoding by speculation
    reasoning_tokens: int = 0  # tokens the model wrote in its reasoning block (thinking)
    reasoning_s: float = 0.0  # seconds from the first token to the block's end (or now)

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
    # With `thinking` (see stream_generate): the piece of reasoning this token completed; `text`
    # is then the answer's alone.
    reasoning: str = ""


def make_sampler(p: SamplingParams) -> Sampler:
    """`sampling.sampler_for(p)`: MLX's global key, as `generate --seed` seeds it."""
    return sampler_for(p)


def make_logits_processors(p: SamplingParams) -> list:
    return processors_for(p)


def context_limit(model) -> int:
    return int(model.args.max_position_embeddings)


def check_token_ids(model, ids: Sequence[int]) -> None:
    """Refuse ids outside the model's vocabulary. MLX's `take` does not check its indices: an
    id past the embedding would read whatever memory follows it (garbage, different from run to
    run), which is what a tokenizer that does not match its model produces."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if not ids or not isinstance(vocab, int):
        return
    top, low = max(ids), min(ids)
    if top >= vocab or low < 0:
        bad = top if top >= vocab else low
        raise PocketError(f"token id {bad} is outside the model's vocabulary ({vocab} tokens): "
                          "the tokenizer does not match the model")


def prompt_text(tokenizer, prompt: str | list[dict] | list[int], *, system: str | None = None,
                raw: bool = False, template_kwargs: dict | None = None) -> str | None:
    """The chat-templated text of a prompt (a string unless `raw`, or messages), with
    `template_kwargs` (e.g. `enable_thinking`) for the template; None for token ids and raw
    text, which no template renders."""
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return None
    if not isinstance(prompt, list) and raw:
        return None
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(msgs, **(template_kwargs or {}))


def prompt_tokens(tokenizer, prompt: str | list[dict] | list[int], *, system: str | None = None,
                  raw: bool = False, template_kwargs: dict | None = None,
                  text: str | None = None) -> list[int]:
    """Token ids for a prompt: a string (chat-templated unless `raw`), messages, or ids
    (`text`: the prompt's `prompt_text`, when the caller rendered it already)."""
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        ids = list(prompt)
    elif not isinstance(prompt, list) and raw:
        ids = tokenizer.encode(prompt)
    else:
        if text is None:
            text = prompt_text(tokenizer, prompt, system=system, template_kwargs=template_kwargs)
        ids = tokenizer.encode(text, add_special_tokens=False)
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


def generate_step(
    model,
    ids: list[int],
    cache: list,
    *,
    sampler: Callable[[mx.array], mx.array],
    processors: list | tuple = (),
    max_tokens: int,
    stream: mx.Stream,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    on_prefill: Callable[[int], bool] | None = None,
    fed: list[int] | None = None,
    history_size: int | None = None,
    points: Sequence[tuple[int, str]] = (),
    on_point: Callable[[int, str], object] | None = None,
    force: Callable[[], int | None] | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs [1, vocab]) for up to `max_tokens` sampled tokens after `ids`.

    All but the last prompt token are prefilled in chunks of `prefill_step`, evaluating the
    cache as it goes; `on_prefill(done)` is called after each chunk and may return True to stop
    there (nothing is yielded). Decoding is pipelined: the next step's graph is queued from the
    still-lazy token before the current one is read, so building it in Python overlaps the
    device's work (as mlx-lm does). `fed`, when given, receives every token the cache consumed
    (the prompt, then each sampled token whose successor was queued), so a caller that stops
    early knows what the cache holds. `processors` get the last `history_size` tokens (all of
    them when None): the repetition penalty reads only its context, so only that is kept.
    `points` are (position in `ids`, kind) where a chunk must end (engine/snapshot_points.py);
    `on_point(position, kind)` is called there, the cache holding exactly `ids[:position]`
    past what it held before (the prompt cache stores a snapshot). `force()`, called once the
    prompt is in and after each token yielded, may return a token id to feed (and yield) next
    instead of the one sampled (a reasoning budget closing the block: engine/reasoning.py)."""
    keep = len(ids) + max_tokens if history_size is None else history_size
    history = mx.array(ids[-keep:], mx.uint32)
    if fed is not None:
        fed.extend(ids)

    # A distributed run (engine/distributed/): every rank takes rank 0's token.
    share = getattr(model, "share_token", None)

    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        logits = model(tokens[None], cache=cache)[:, -1, :]
        y, logprobs = sample(logits, sampler, processors, history)
        return (share(y) if share is not None else y), logprobs

    rest = prefill(model, ids, cache, stream=stream, prefill_step=prefill_step,
                   on_prefill=on_prefill, points=points, on_point=on_point)
    if rest is None:
        return
    with mx.stream(stream):
        y, logprobs = step(rest)
        mx.async_eval(y, logprobs)
    if force is not None and (f := force()) is not None:
        y = mx.array([f], mx.uint32)
    n = 0
    while n < max_tokens:
        y_next = None
        if n + 1 < max_tokens:
            if processors:
                history = mx.concatenate([history, y.astype(mx.uint32)])[-keep:]
            with mx.stream(stream):
                y_next, logprobs_next = step(y.astype(mx.uint32))
                mx.async_eval(y_next, logprobs_next)
        token = y.item()
        if y_next is not None and fed is not None:
            fed.append(token)
        yield token, logprobs
        n += 1
        if y_next is None:
            return
        y, logprobs = y_next, logprobs_next
        # The token sampled from the step just queued is dropped: the forced one is fed.
        if force is not None and (f := force()) is not None:
            y = mx.array([f], mx.uint32)


def prefill(model, ids: list[int], cache: list, *, stream: mx.Stream, prefill_step: int,
            on_prefill: Callable[[int], bool] | None = None,
            points: Sequence[tuple[int, str]] = (),
            on_point: Callable[[int, str], object] | None = None,
            on_hidden: Callable[[mx.array], object] | None = None) -> mx.array | None:
    """All but the last of `ids` into `cache`, in chunks (see `generate_step`): returns the last
    token (not fed), or None when `on_prefill` stopped it. `on_hidden`, when given, gets each
    chunk's final-norm hidden states [n, hidden] and its token ids [n] (lazy; an MTP drafter
    fills its own cache from them), the trunk's forward then stopping before the lm_head."""
    with mx.stream(stream):
        rest = mx.array(ids, mx.uint32)
        done = 0
        points = deque(points)
        while rest.size > 1:
            n = chunk_size(done, rest.size - 1, prefill_step, points[0][0] if points else None)
            if on_hidden is not None:
                on_hidden(model.language_model.model(rest[:n][None], cache,
                                                     eval_layers=True)[0], rest[:n])
                mx.eval([a for c in cache for a in cache_arrays(c)])
            else:
                prefill_chunk(model, rest[:n], cache)
            rest = rest[n:]
            done += n
            if points and points[0][0] == done:
                _, kind = points.popleft()
                if on_point is not None:
                    on_point(done, kind)
            if on_prefill is not None and on_prefill(done):
                return None
    return rest


def stream_generate(
    model,
    tokenizer,
    prompt: str | list[dict] | list[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: SamplingParams | None = None,
    stop: list[str] | None = None,
    device: str | None = None,
    system: str | None = None,
    raw: bool = False,
    cache: list | None = None,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    warn: Callable[[str], object] | None = None,
    points: Sequence[tuple[int, str]] = (),
    on_point: Callable[[int, str], object] | None = None,
    speculative: str = "off",
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    thinking: bool | str | None = None,
    reasoning_budget: int | None = None,
    template_kwargs: dict | None = None,
    **sampling_kwargs,
) -> Iterator[Response]:
    """Yield `Response`s: text pieces as they decode, each with live stats; the last has
    `stats.finish_reason` set (eos, stop, length, context: the model's context limit cut the
    reply, or cancelled). Sampling comes as `sampling=SamplingParams(...)` or as its keywords
    (`temperature=` or mlx-lm's `temp=`, `top_p=`, `seed=`, ...). Pass `cache` (from
    `model.make_cache()`) to continue a conversation: only the new tokens are prefilled. A
    `device` other than the model's switches it (its float dtype follows, and the cache's
    with it, see `loader.use_device`). `warn` receives one-off warnings (the GPU memory one); default:
    stderr. `points` and `on_point` (positions in the tokens fed) are `generate_step`'s: where
    prefill ends a chunk and what to do there (store a prompt-cache snapshot). `speculative`
    (off, lookup, mtp, auto; engine/drafters.py) decodes by speculation, `num_draft_tokens`
    drafts per pass: the tokens are plain decode's (greedy) or have its distribution; the
    stats then carry `speculative` (drafted, accepted).

    Reasoning (engine/reasoning.py): `thinking` True (the prompt left the model inside a
    `<think>` block), False (it may open one itself), "auto" (decided from the chat template
    and the prompt it rendered; token ids: None) or None (no parsing, the reply as it comes).
    Parsed, each response's `reasoning` holds the block's text and `text` the answer's alone,
    and `stats.reasoning_tokens` counts the block's tokens; `reasoning_budget` N closes the
    block after N of them (the tokens of `</think>\n\n` fed instead of sampled; then no
    speculation). `template_kwargs` reach the chat template (e.g. `enable_thinking`)."""
    run = _set_up(model, tokenizer, prompt, max_tokens=max_tokens, sampling=sampling,
                  stop=stop, device=device, system=system, raw=raw, cache=cache,
                  prefill_step=prefill_step, warn=warn, sampling_kwargs=sampling_kwargs,
                  template_kwargs=template_kwargs)
    run.reasoning = _tracker(tokenizer, prompt, thinking, reasoning_budget, run.prompt_text)
    # A budget forces tokens between the sampled ones: speculation's drafts would have to
    # know of it, so a budgeted reply simply decodes plainly.
    method = speculative if run.reasoning is None or run.reasoning.budget is None else "off"
    run.drafter, run.spec = _speculation(model, method, num_draft_tokens, run.stream,
                                         run.sampling)
    if run.spec is not None:
        run.stats.speculative = run.spec.to_dict()
    with run.wired:
        mx.reset_peak_memory()
        yield from _decode(model, run, prefill_step=prefill_step, progress=progress,
                           should_stop=should_stop, points=points, on_point=on_point)
        yield from _finish(run)


@dataclass
class _Run:
    """One `stream_generate` call: what its set-up decided and what its loop counts."""

    ids: list[int]  # the prompt's tokens
    cache: list
    stream: mx.Stream
    sampling: SamplingParams
    max_tokens: int  # the caller's cap
    room: int  # tokens that still fit the context
    stats: GenerationStats
    text: StopText
    eos: set[int]
    wired: ExitStack  # on the GPU: the model's memory wired while generating
    fed: list[int] = field(default_factory=list)  # tokens the cache consumed
    n: int = 0  # tokens sampled so far, EOS not counted
    t_decode: float | None = None  # when the first token was read
    cancelled_prefill: bool = False  # should_stop ended the prefill
    drafter: Drafter | None = None  # speculative decoding (engine/speculative.py), or None
    spec: SpecCounts | None = None
    prompt_text: str | None = None  # the rendered chat prompt (None: ids or raw text)
    reasoning: ReasoningTracker | None = None  # the reply's reasoning block, when parsed


def _tracker(tokenizer, prompt, thinking: bool | str | None, budget: int | None,
             text: str | None) -> ReasoningTracker | None:
    """The reasoning tracker of a `stream_generate` call (see its docstring), or None."""
    if thinking == "auto":
        thinking = thinking_for(tokenizer.chat_template, text) if text is not None else None
    elif thinking is not None and not isinstance(thinking, bool):
        raise PocketError(f"thinking must be True, False, 'auto' or None, got {thinking!r}")
    try:
        return tracker_for(tokenizer, thinking, budget)
    except ValueError as e:
        raise PocketError(f"reasoning budget {e}") from None


def _set_up(model, tokenizer, prompt, *, max_tokens: int, sampling: SamplingParams | None,
            stop: list[str] | None, device: str | None, system: str | None, raw: bool,
            cache: list | None, prefill_step: int, warn: Callable[[str], object] | None,
            sampling_kwargs: dict, template_kwargs: dict | None = None) -> _Run:
    """Check the arguments, tokenize, put the model (and cache) on the device, seed, and
    prepare the stats: everything before the first forward."""
    if sampling is not None and sampling_kwargs:
        raise PocketError("give sampling=SamplingParams(...) or sampling keywords, not both")
    sampling = sampling or SamplingParams.from_kwargs(sampling_kwargs)
    sampling.validate()
    checked(check_max_tokens, max_tokens)
    checked(check_prefill_step, prefill_step)
    dev = devices.resolve_device(device or getattr(model, "device", None))
    stream = devices.stream_for(dev)
    text = prompt_text(tokenizer, prompt, system=system, raw=raw, template_kwargs=template_kwargs)
    ids = prompt_tokens(tokenizer, prompt, system=system, raw=raw, text=text)
    check_token_ids(model, ids)
    use_device(model, dev, cache)  # the model's dtypes, and the cache's, follow the device
    if cache is None:
        cache = model.make_cache()
    start_pos = cache_offset(cache)
    limit = context_limit(model)
    if start_pos + len(ids) >= limit:
        raise PocketError(f"the prompt ({start_pos + len(ids)} tokens) does not fit the "
                          f"context of {limit} tokens")
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    weights = model_weight_stats(model)
    stats = GenerationStats(prompt_tokens=len(ids), bytes_per_token=weights.bytes_per_token,
                            device=dev)
    # On the GPU, wire the model's memory for the duration (restored when the generator ends).
    wired = ExitStack()
    if dev == "gpu":
        warn = warn or (lambda m: print(m, file=sys.stderr))
        wired.enter_context(wired_limit(weights.bytes_total, dev, streams=[stream], warn=warn))
    return _Run(ids=ids, cache=cache, stream=stream, sampling=sampling, max_tokens=max_tokens,
                room=limit - start_pos - len(ids), stats=stats,
                text=StopText(tokenizer, [s for s in (stop or []) if s]),
                eos=set(tokenizer.eos_token_ids), wired=wired, prompt_text=text)


def _decode(model, run: _Run, *, prefill_step: int,
            progress: Callable[[int, int], None] | None,
            should_stop: Callable[[], bool] | None, points: Sequence[tuple[int, str]],
            on_point: Callable[[int, str], object] | None) -> Iterator[Response]:
    """Prefill and decode: a `Response` per token read, until EOS, a stop string, the cap,
    the context or `should_stop`; sets `run.stats.finish_reason` (not on a cancelled
    prefill: `run.cancelled_prefill` says so)."""
    ids, stats, text, thought = run.ids, run.stats, run.text, run.reasoning
    cap = min(run.max_tokens, run.room)

    def on_prefill(done: int) -> bool:
        stats.prefill_done = done
        if progress:
            progress(done, len(ids))
        if should_stop and should_stop():
            run.cancelled_prefill = True
        return run.cancelled_prefill

    t0 = time.perf_counter()
    if run.drafter is not None:
        steps = _speculative_steps(model, run, cap, prefill_step=prefill_step,
                                   on_prefill=on_prefill, points=points, on_point=on_point)
    else:
        steps = generate_step(model, ids, run.cache, sampler=sampler_for(run.sampling),
                              processors=processors_for(run.sampling), max_tokens=cap,
                              stream=run.stream, prefill_step=prefill_step,
                              on_prefill=on_prefill, fed=run.fed,
                              history_size=run.sampling.repetition_context, points=points,
                              on_point=on_point,
                              force=thought.next_forced if thought is not None else None)
    for token, _ in steps:
        if run.t_decode is None:
            run.t_decode = time.perf_counter()
            stats.ttft_s = run.t_decode - t0
            stats.prompt_tps = len(ids) / stats.ttft_s
            stats.phase = "decode"
            if progress:
                progress(len(ids), len(ids))
        if token in run.eos:
            stats.finish_reason = "eos"
            break
        run.n += 1
        if run.spec is not None:
            stats.speculative = run.spec.to_dict()
        piece, stopped = text.add(token)
        reasoning = ""
        if thought is not None:
            was = thought.in_block
            reasoning, piece = thought.add(piece)
            stats.reasoning_tokens = thought.tokens
            if was or thought.in_block:
                stats.reasoning_s = time.perf_counter() - run.t_decode
        stats.generation_tokens = run.n
        if run.n > 1:
            stats.generation_tps = (run.n - 1) / (time.perf_counter() - run.t_decode)
        if stopped:
            stats.finish_reason, stats.stop_string = "stop", text.hit
            if piece or reasoning:
                yield Response(piece, token, stats, reasoning=reasoning)
            break
        yield Response(piece, token, stats, reasoning=reasoning)
        if should_stop and should_stop() and run.n < cap:
            stats.finish_reason = "cancelled"
            break
    else:
        if not run.cancelled_prefill:
            stats.finish_reason = "length" if run.n >= run.max_tokens else "context"
    steps.close()


def _speculation(model, method: str, k: int, stream: mx.Stream,
                 sampling: SamplingParams) -> tuple[Drafter | None, SpecCounts | None]:
    """The drafter and counters of `--speculative METHOD` (None, None: plain decode). `auto`
    decodes plainly where a verify pass cannot batch its rows exactly (not the CPU: see
    models/verify.py), since it would then cost k + 1 steps, and when sampling (temperature >
    0): the rejection rule keeps the distribution but not the draws, and a seeded reply should
    stay the one plain decode (and `serve`) gives; lookup and mtp, asked by name, sample by it."""
    checked_k = check_num_draft_tokens(k)
    drafter = make_drafter(method, model)
    if drafter is None:
        return None, None
    if method == "auto" and sampling.temperature > 0:
        return None, None
    with mx.stream(stream):
        if method == "auto" and not batched_rows_exact():
            return None, None
    return drafter, SpecCounts(method=drafter.name if method != "auto" else f"auto:{drafter.name}",
                               num_draft_tokens=checked_k)


def _speculative_steps(model, run: _Run, cap: int, *, prefill_step: int, on_prefill,
                       points, on_point) -> Iterator[tuple[int, mx.array]]:
    """`generate_step`'s prefill, then speculative decoding (engine/speculative.py)."""
    run.drafter.reset()
    rest = prefill(model, run.ids, run.cache, stream=run.stream, prefill_step=prefill_step,
                   on_prefill=on_prefill, points=points, on_point=on_point,
                   on_hidden=getattr(run.drafter, "prompt_hidden", None))
    if rest is None:
        return
    yield from speculative_step(
        model, run.ids, run.cache, rest, drafter=run.drafter,
        num_draft_tokens=run.spec.num_draft_tokens, sampling=run.sampling,
        sampler=sampler_for(run.sampling), processors=processors_for(run.sampling),
        max_tokens=cap, stream=run.stream, counts=run.spec, fed=run.fed,
        history_size=run.sampling.repetition_context)


def _finish(run: _Run) -> Iterator[Response]:
    """The last responses: the text held back (unless a stop string cut it), then the final
    stats with the tokens the cache holds (None after a cancelled prefill: the cache is
    part-way)."""
    stats = run.stats
    if run.cancelled_prefill:
        stats.finish_reason, stats.phase = "cancelled", "done"
        yield Response("", None, stats, fed_tokens=None)
        return
    tail = run.text.flush() if stats.finish_reason != "stop" else ""
    reasoning = ""
    if run.reasoning is not None:
        reasoning, tail = run.reasoning.finish(tail)
    if tail or reasoning:
        yield Response(tail, None, stats, reasoning=reasoning)
    stats.phase = "done"
    if run.spec is not None:
        stats.speculative = run.spec.to_dict()
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    if run.t_decode is not None and run.n > 1:
        stats.generation_tps = (run.n - 1) / (time.perf_counter() - run.t_decode)
    yield Response("", None, stats, fed_tokens=run.fed)


class StopText:
    """The reply's text as tokens arrive: pieces safe to show, text that might start a stop
    string held back until it cannot (or does), and what precedes a stop string that hit."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok = tokenizer.detokenizer()
        self.stops = stops
        self.pending = ""  # decoded text held back because it might start a stop string
        self.hit: str | None = None  # the stop string found, once one is

    def add(self, token: int) -> tuple[str, bool]:
        """(piece to show, whether a stop string hit: then the piece is the text before it)."""
        self.pending += self.detok.add(token)
        hit = next((s for s in self.stops if s in self.pending), None)
        if hit is not None:
            self.hit = hit
            return self.pending[: self.pending.index(hit)], True
        hold = _stop_holdback(self.pending, self.stops) if self.stops else 0
        cut = len(self.pending) - hold
        piece, self.pending = self.pending[:cut], self.pending[cut:]
        return piece, False

    def flush(self) -> str:
        """Everything held back, at the end of a reply that no stop string cut."""
        tail, self.pending = self.pending + self.detok.flush(), ""
        return tail


def prefill_chunk(model, tokens: mx.array, cache: list) -> None:
    """Feed `tokens` (1-D) into `cache`, evaluated, their logits never computed: the model's
    own `prefill` (one layer at a time, a bounded working set) where it has one."""
    if (prefill := getattr(model, "prefill", None)) is not None:
        prefill(tokens[None], cache)
        return
    model(tokens[None], cache=cache)
    mx.eval([a for c in cache for a in cache_arrays(c)])


def cache_arrays(c) -> list[mx.array]:
    """The arrays of one layer's cache (KV or linear-attention state), to evaluate them."""
    if hasattr(c, "arrays"):
        return c.arrays
    return [a for a in (getattr(c, "keys", None), getattr(c, "values", None)) if a is not None]


def cache_offset(cache: list) -> int:
    """The tokens a model cache holds (its longest layer)."""
    return max((getattr(c, "offset", 0) for c in cache), default=0)


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole reply as one string (keywords as `stream_generate`'s)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
