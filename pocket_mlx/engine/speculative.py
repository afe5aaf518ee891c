"""Speculative decoding: a drafter proposes k tokens, one trunk pass checks them all.

Each pass feeds [pending token, d1..dk] through `models.verify.verify_forward` (one forward,
every row with one-token decode's bits), decides how many drafts to keep, and commits the cache
to those rows from the pass's tape: a rejection never costs a second trunk pass.

The acceptance rule keeps the output distribution of plain decode:
- greedy (temperature 0): d_{i+1} is kept while it is the argmax of row i; the first row whose
  argmax differs gives the correction, and when all k are kept row k gives one more token. The
  tokens are exactly plain decode's (same logits bits, same argmax).
- temperature > 0: the standard rule (Leviathan et al. 2023; Chen et al. 2023): keep d with
  probability min(1, p(d) / q(d)), p the distribution the sampler draws from (processors,
  top-p / min-p / top-k, temperature), q the drafter's (one-hot for lookup: keep with p(d));
  on a rejection draw from max(p - q, 0) normalized; when all are kept, draw row k with the
  sampler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import mlx.core as mx

from pocket_mlx.engine.drafters import Drafter
from pocket_mlx.engine.sampling import logit_filters, sample
from pocket_mlx.kernels import ops
from pocket_mlx.models.verify import commit, verify_forward


@dataclass
class SpecCounts:
    """What `generate --json` reports as "speculative"."""

    method: str
    num_draft_tokens: int
    drafted: int = 0
    accepted: int = 0
    passes: int = 0  # trunk passes after the prompt (verify passes and one-token steps)

    def to_dict(self) -> dict:
        return asdict(self)


def target_probs(
    logprobs: mx.array, temperature: float, top_p: float, min_p: float, top_k: int
) -> mx.array:
    """The distribution `sampling.make_sampler` draws from, given log-probabilities [1, V]:
    its filters, then softmax at the temperature."""
    for f in logit_filters(top_p, min_p, top_k):
        logprobs = f(logprobs)
    return mx.softmax(logprobs * (1.0 / temperature), axis=-1, precise=True)


def speculative_step(
    model,
    ids: list[int],
    cache: list,
    rest: mx.array,
    *,
    drafter: Drafter,
    num_draft_tokens: int,
    sampling,
    sampler: Callable[[mx.array], mx.array],
    processors: list | tuple = (),
    max_tokens: int,
    stream: mx.Stream,
    counts: SpecCounts,
    fed: list[int] | None = None,
    history_size: int | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs [1, vocab]) as `generation.generate_step` does, after its prefill
    (`rest`: the prompt's last token, not yet fed; `ids` the whole prompt), decoding by
    speculation. `fed` gets the tokens the cache holds; when the caller stops early the cache
    is committed back to exactly the tokens yielded (as plain decode leaves it)."""
    keep = len(ids) + max_tokens if history_size is None else history_size
    tokens = list(ids)  # prompt and reply: what the drafter reads
    if fed is not None:
        fed.extend(ids)
    greedy = sampling.temperature <= 0
    y = int(rest[0].item())
    first = True
    n = 0
    plain_steps = getattr(drafter, "plain_steps", None)  # auto: how long to back off
    has_draft = getattr(drafter, "has_draft", None)  # lookup: plain until a match
    timed = getattr(drafter, "timed", None)
    while n < max_tokens:
        k = min(num_draft_tokens, max_tokens - n - 1)
        # Both kinds of step are timed from here to their tokens' delivery (the drafter's own
        # work, the pass and the yields to the consumer, as a plain stretch's time holds its
        # yields): timing the verify pass alone made a one-draft try that the head got right
        # look faster than plain decode on the bundled model, and `auto` kept drafting (0.85x).
        t_step = time.perf_counter()
        drafts = drafter.draft(tokens, k)[:k] if k > 0 else []
        window = 0
        if not drafts and plain_steps is not None:
            window = min(plain_steps(), max_tokens - n)
        elif not drafts and has_draft is not None:
            window = max_tokens - n  # ended by `has_draft` (at the latest by max_tokens)
        if window > 0:  # a stretch of plain, pipelined decode (auto backing off, no match)
            y, m = yield from _plain(
                model,
                cache,
                y,
                window,
                first,
                tokens,
                stream=stream,
                sampler=sampler,
                processors=processors,
                keep=keep,
                fed=fed,
                drafter=drafter,
                until=has_draft,
                counts=counts,
            )
            n += m
            first = False
            if timed is not None:
                timed(1, time.perf_counter() - t_step, m)
            continue
        q = drafter.last_probs if drafts else None
        if not first and fed is not None:
            fed.append(y)
        rows = [y, *drafts]
        with mx.stream(stream):
            logits, hidden, tape = verify_forward(model, mx.array(rows, mx.uint32), cache)
            out, a = accept_drafts(logits, rows, tokens, greedy, sampling, sampler, processors, keep, q)
        counts.passes += 1
        counts.drafted += len(drafts)
        counts.accepted += a
        first = False
        kept = 1  # rows of this pass the cache must hold: y, then each draft yielded
        try:
            for j, (tok, lp) in enumerate(out):
                if j < a:
                    kept += 1
                    if fed is not None:
                        fed.append(tok)
                tokens.append(tok)
                n += 1
                yield tok, lp
                if n >= max_tokens:
                    break
        finally:
            commit(cache, tape, kept)
        if timed is not None and drafts:
            timed(len(rows), time.perf_counter() - t_step, a + 1)
        drafter.accepted(len(drafts), a, hidden[:kept])
        y = out[-1][0]


def _plain(
    model,
    cache,
    y: int,
    count: int,
    first: bool,
    tokens: list[int],
    *,
    stream,
    sampler,
    processors,
    keep: int,
    fed,
    drafter,
    until: Callable[[list[int]], bool] | None = None,
    counts: SpecCounts | None = None,
):
    """`count` one-token steps from the pending token `y`, pipelined as `generate_step`
    decodes (the next step queued before the token is read): yields them, returns (the new
    pending token, how many were yielded). The drafter hears each step's hidden state. With
    `until`, the stretch ends early once `until(tokens)` holds (lookup: a match to draft from),
    after the step already queued then (ending a stretch costs its last step's overlap, never a
    step thrown away)."""
    lm = model.language_model

    def step(tok: mx.array, hist: mx.array | None):
        h = lm.model(tok.reshape(1, 1), cache)
        logits = (
            lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
        )
        t, lp = sample(logits[:, -1, :], sampler, processors, hist)
        return t, lp, h[0]

    if not first and fed is not None:
        fed.append(y)
    with mx.stream(stream):
        hist = mx.array(tokens[-keep:], mx.uint32) if processors else None
        t, lp, h = step(mx.array([y], mx.uint32), hist)
        mx.async_eval(t, lp)
    stop = False
    for i in range(count):
        nxt = None
        if i + 1 < count and not stop:  # queue the successor from the still-lazy token, read it
            with mx.stream(stream):
                if processors:
                    hist = mx.concatenate([hist, t.astype(mx.uint32)])[-keep:]
                nxt = step(t.astype(mx.uint32), hist)
                mx.async_eval(nxt[0], nxt[1])
        tok = int(t.item())
        tokens.append(tok)
        if nxt is not None and fed is not None:
            fed.append(tok)
        drafter.accepted(0, 0, h)
        if counts is not None:  # counted before the yield: a reply may end (EOS) right there
            counts.passes += 1
        yield tok, lp
        if nxt is None:
            return tok, i + 1
        if until is not None and not stop:
            stop = until(tokens)
        t, lp, h = nxt
    raise AssertionError("unreachable")


def _row_logprobs(logits: mx.array, processors, history: list[int], keep: int) -> mx.array:
    """Row logits [1, V] -> log-probabilities after the processors over `history`: the same
    ops as `sampling.sample` before its draw."""
    hist = mx.array(history[-keep:], mx.uint32)
    for proc in processors:
        logits = proc(hist, logits)
    return ops.log_softmax(logits)


def accept_drafts(
    logits: mx.array,
    rows: list[int],
    tokens: list[int],
    greedy: bool,
    sampling,
    sampler,
    processors,
    keep: int,
    q: mx.array | None,
) -> tuple[list[tuple[int, mx.array]], int]:
    """The tokens this pass yields ((token, logprobs) each) and how many drafts were kept."""
    drafts = rows[1:]
    # Row i's history: the tokens so far, then the rows fed up to and including row i (the
    # pending token y is already in `tokens` unless this is the prompt's last token).
    hist = list(tokens[-keep:]) if processors else []
    out: list[tuple[int, mx.array]] = []
    if greedy and not processors:  # every row as plain decode samples it, in one call: the
        # log-softmax and argmax are row-wise (each row's bits are its own; checked bit for bit
        # against one-row calls, tests/test_speculative.py)
        tok, lp = sample(logits, sampler)
        picked = tok.tolist()
        a = next((i for i, d in enumerate(drafts) if picked[i] != d), len(drafts))
        return [(picked[i], lp[i : i + 1]) for i in range(a + 1)], a
    if greedy:  # every row as plain decode samples it (its own history), read back at once
        toks, lps = [], []
        for i in range(len(rows)):
            h = mx.array((hist + drafts[:i])[-keep:], mx.uint32) if processors else None
            tok, lp = sample(logits[i : i + 1], sampler, processors, h)
            toks.append(tok)
            lps.append(lp)
        picked = mx.concatenate(toks).tolist()
        a = next((i for i, d in enumerate(drafts) if picked[i] != d), len(drafts))
        return list(zip(picked[: a + 1], lps[: a + 1], strict=True)), a
    for i, d in enumerate(drafts):
        lp = _row_logprobs(logits[i : i + 1], processors, hist + drafts[:i], keep)
        p = target_probs(lp, sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k)[
            0
        ]
        qd = q[i] if q is not None else None
        ratio = p[d] if qd is None else mx.minimum(1.0, p[d] / mx.maximum(qd[d], 1e-30))
        if mx.random.uniform().item() < ratio.item():
            out.append((d, lp))
            continue
        if qd is None:
            residual = p * (mx.arange(p.shape[0]) != d)
        else:
            residual = mx.maximum(p - qd, 0.0)
        tok = int(mx.random.categorical(mx.log(residual / residual.sum())).item())
        out.append((tok, lp))
        return out, i
    i = len(drafts)
    h = mx.array((hist + drafts)[-keep:], mx.uint32) if processors else None
    tok, lp = sample(logits[i : i + 1], sampler, processors, h)
    out.append((int(tok.item()), lp))
    return out, len(drafts)
