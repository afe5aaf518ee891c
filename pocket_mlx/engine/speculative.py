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

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import mlx.core as mx

from pocket_mlx.engine.drafters import Drafter
from pocket_mlx.engine.sampling import _filters, sample
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
    for f in _filters(top_p, min_p, top_k):
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
    while n < max_tokens:
        k = min(num_draft_tokens, max_tokens - n - 1)
        drafts = drafter.draft(tokens, k)[:k] if k > 0 else []
        q = drafter.last_probs if drafts else None
        if not first and fed is not None:
            fed.append(y)
        rows = [y, *drafts]
        with mx.stream(stream):
            logits, hidden, tape = verify_forward(model, mx.array(rows, mx.uint32), cache)
            out, a = _accept(logits, rows, tokens, greedy, sampling, sampler, processors, keep, q)
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
        drafter.accepted(len(drafts), a, hidden[:kept])
        y = out[-1][0]


def _row_logprobs(logits: mx.array, processors, history: list[int], keep: int) -> mx.array:
    """Row logits [1, V] -> log-probabilities after the processors over `history`: the same
    ops as `sampling.sample` before its draw."""
    hist = mx.array(history[-keep:], mx.uint32)
    for proc in processors:
        logits = proc(hist, logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _accept(
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
    if greedy:  # every row as plain decode samples it, read back in one evaluation
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
