"""Batched decoding of N sequences on one thread (continuous batching), for `pocket-mlx serve`.

The shape is mlx-lm's `BatchGenerator`: `insert` a prompt (with its cache, sampling and
stops) and get a uid back, call `step()` to advance every sequence and get per-sequence
events (`Prefilled`, `Token`, `Finished`, `Failed`), `remove` uids to end them early. The caller (the
server's worker, server/engine.py) keeps admission, queueing and what the events mean to a
client; nothing here knows HTTP.

Each `step()` (1) runs one prefill chunk of the oldest sequence still prefilling (so a long
prompt delays the others by a chunk per step, never by its whole prefill), then its first
token alone, exactly as `generate` does, and (2) runs ONE decode step for every sequence past
its first token: one forward of [B, 1] tokens (models/batched.py), in which every weight
matrix is read once for all B. Sequences join after their first token and leave when they
finish, between steps. Each keeps its own sampling parameters, repetition history and random
key (`seed`), so its tokens are those it would get alone: greedy outputs equal sequential runs
bit for bit (tests/test_batched.py, tests/test_server_batch.py).

Decoding is pipelined as in `generation.generate_step`: the next step is queued from the
still-lazy sampled tokens before they are read, so building a step's graph in Python overlaps
the previous step's compute.

Speculative decoding (`serve --speculative`, greedy requests only): while exactly one sequence
is decoding, each step is a verify pass of its drafts instead (engine/speculative.py's greedy
rule, models/verify.py's row-exact pass: its tokens are still plain decode's); when others
decode too, every sequence steps in the batch plainly. Such a pass is not pipelined (the
drafts need the pending token's value); where the drafter has nothing (`auto` backing off,
lookup without a match) the sequence takes the ordinary pipelined step until it may draft.

Reasoning (thinking models, engine/reasoning.py): a sequence inserted with `thinking` has its
reply split as it streams (`Token.reasoning` / `Token.text`, `Finished.reasoning_tokens`), and
a `reasoning_budget` closes its block: after N reasoning tokens the token sampled next is
dropped and the tokens of `</think>\n\n` are fed instead (`Token.forced`), one a step, through
the same pipelined step as any other; such a sequence does not speculate.

Prompt-cache snapshots: prefill ends a chunk at each snapshot point
(engine/snapshot_points.py) and hands the cache to `store` there; a finished sequence's cache
is stored too (before its `Finished` event, so the client's next turn finds it).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from pocket_mlx.engine.drafters import DEFAULT_NUM_DRAFT_TOKENS, make_drafter
from pocket_mlx.engine.generation import (
    SamplingParams,
    StopText,
    cache_arrays,
    check_token_ids,
    prefill_chunk,
)
from pocket_mlx.engine.params import DEFAULT_PREFILL_STEP
from pocket_mlx.engine.prompt_cache import PrefixStore
from pocket_mlx.engine.reasoning import ReasoningTracker, tracker_for
from pocket_mlx.engine.sampling import processors_for, sample, sampler_for
from pocket_mlx.engine.snapshot_points import chunk_size, snapshot_points
from pocket_mlx.engine.speculative import accept_drafts
from pocket_mlx.errors import one_line
from pocket_mlx.models.batched import DecodeBatch
from pocket_mlx.models.verify import batched_rows_exact, commit, verify_forward
from pocket_mlx.system.memory import release_free_memory

log = logging.getLogger(__name__)


@dataclass
class Prefilled:
    """A prefill chunk (or the prompt's last token, fed alone) of `tokens` took `seconds`;
    `done` of the prompt's `total` tokens are in the cache now (`cached` of them came from the
    prompt cache), `wall_s` after the sequence was inserted."""

    uid: int
    tokens: int
    seconds: float
    done: int
    total: int
    cached: int
    wall_s: float


@dataclass
class Token:
    """A reply token was read (EOS excepted): its text safe to show (may be empty, held back
    for a stop string) and the seconds since the sequence was inserted (the first token) or
    since its previous token. A sequence inserted with `thinking` has its reply parsed: then
    `reasoning` is the piece of reasoning this token completed and `text` the answer's alone
    (both may be empty); `forced`: the engine fed this token (a budget closing the block)."""

    uid: int
    text: str
    seconds: float
    first: bool
    reasoning: str = ""
    forced: bool = False


@dataclass
class Finished:
    """A sequence ended (and left the batch): why, the text held back till now, its counts."""

    uid: int
    reason: str  # eos | stop | length | context | cancelled
    text: str  # the held-back tail (empty after a stop string)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_string: str | None
    tps: float  # decode tokens per second after the first
    seconds: float  # since it was inserted
    reasoning: str = ""  # the held-back tail of the reasoning (with `thinking`)
    reasoning_tokens: int = 0  # tokens the model wrote in its reasoning block (with `thinking`)


@dataclass
class Failed:
    """A sequence's step raised: it left the batch, nothing of it is stored."""

    uid: int
    error: Exception


Event = Prefilled | Token | Finished | Failed


class _Seq:
    """One sequence: its cache, sampling state and reply so far."""

    def __init__(self, uid: int, ids: list[int], cache: list, n_cached: int,
                 sampling: SamplingParams, max_tokens: int | None, room: int, tokenizer,
                 stop: Sequence[str], boundaries: Sequence[int],
                 cancelled: Callable[[], bool], drafter=None,
                 reasoning: ReasoningTracker | None = None) -> None:
        self.uid, self.ids, self.cache, self.n_cached = uid, ids, cache, n_cached
        self.cancelled = cancelled
        self.rest = mx.array(ids[n_cached:], mx.uint32)  # prompt tokens not yet fed
        self.fed: list[int] | None = list(ids[n_cached:])  # what the cache consumed
        # Each sequence draws from its own key, as `generate --seed` draws from a freshly seeded
        # global one: the same seed gives the same tokens alone or batched. Greedy draws nothing.
        self.sampler = sampler_for(sampling, own_key=True)
        self.processors = processors_for(sampling)
        self.keep = sampling.repetition_context
        self.history = mx.array(ids[n_cached:][-self.keep:], mx.uint32)
        self.max_tokens = max_tokens  # None: no cap but the window (agents send none)
        self.limit = room if max_tokens is None else min(max_tokens, room)  # may be sampled
        self.text = StopText(tokenizer, [s for s in stop if s])
        self.eos = set(tokenizer.eos_token_ids)
        self.read = 0  # sampled tokens read so far (an EOS included)
        self.n = 0  # reply tokens (no EOS)
        self.unread: mx.array | None = None  # sampled, not yet read
        self.next: mx.array | None = None  # sampled in the step just queued
        self.fed_now = False  # `unread` was fed to the step just queued
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_prev = 0.0
        self.prefilled = 0  # prompt tokens fed so far (past the cached prefix)
        # Positions past the cached prefix where prefill stops a chunk and stores a snapshot.
        self.points = deque(snapshot_points(len(ids), boundaries, n_cached))
        # Speculative decoding (see the module's docstring), or None.
        self.drafter = drafter
        self.seen: list[int] = list(ids)  # prompt and tokens read: what the drafter reads
        self.synced = True  # the drafter heard every token's hidden state (no batched step)
        self.plain_left = 0  # steps left without drafts (`auto` backing off, lookup no match)
        self.plain_t0: float | None = None  # when this stretch's pipelined steps began
        self.plain_n = 0  # and how many it has queued (alone: `timed` hears them at its end)
        self.spec: tuple | None = None  # the pass to read: (tape, hidden, drafts, accepted)
        self.drafted = self.accepted = 0
        self.reasoning = reasoning  # the reply's reasoning block, when parsed

    def force(self) -> None:
        """After a token is read (or the first sampled): a reasoning budget that ran out
        replaces the token sampled next (still unread, not fed) with the one to force."""
        if self.reasoning is not None and (f := self.reasoning.next_forced()) is not None:
            self.unread = mx.array([f], mx.uint32)

    def sample(self, logits: mx.array) -> mx.array:
        """The next token [1] from logits [1, vocab] (lazy), as `generate_step` samples."""
        return sample(logits, self.sampler, self.processors, self.history)[0]


class BatchDecoder:
    """The sequences being generated together on the calling thread (the model's owner)."""

    def __init__(self, model, tokenizer, *, stream: mx.Stream, store: PrefixStore,
                 prefill_step: int = DEFAULT_PREFILL_STEP, speculative: str = "off",
                 num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS) -> None:
        self.model, self.tokenizer, self.stream = model, tokenizer, stream
        self.store, self.prefill_step = store, prefill_step
        self.speculative, self.num_draft_tokens = speculative, num_draft_tokens
        make_drafter(speculative, model)  # `mtp` on a model without a head: PocketError here
        self.drafted = self.accepted = 0  # drafts proposed and kept, all sequences
        self.prefilling: deque[_Seq] = deque()  # in arrival order; the first one prefills
        self.decoding: list[_Seq] = []  # past their first token
        self.batch = DecodeBatch(model)
        self._uids = itertools.count()
        self.prefill_s: float | None = None  # the last step's prefill time (None: no prefill)
        self.batch_size = 0  # sequences in the last step's decode forward

    def __len__(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def pending(self) -> tuple[int, int]:
        """(prompts still prefilling, their tokens left to prefill)."""
        return len(self.prefilling), sum(int(s.rest.size) for s in self.prefilling)

    def insert(self, ids: list[int], *, cache: list, n_cached: int, sampling: SamplingParams,
               max_tokens: int | None, room: int, stop: Sequence[str] = (),
               boundaries: Sequence[int] = (),
               cancelled: Callable[[], bool] = lambda: False, thinking: bool | None = None,
               reasoning_budget: int | None = None) -> int:
        """Queue a prompt whose first `n_cached` tokens `cache` already holds; returns its uid.
        At most `max_tokens` reply tokens (None: no cap) and `room` (what the window leaves);
        `cancelled()` is checked after every prefill chunk and every token.

        `thinking` (engine/reasoning.py's `thinking_for` of the rendered prompt): None, the
        reply as it comes; True, the prompt left the model inside a `<think>` block; False, it
        may open one itself. Not None: the reply is parsed (`Token.reasoning` apart from
        `Token.text`, `Finished.reasoning_tokens`), and `reasoning_budget` N (None: no limit)
        closes the block after N reasoning tokens by feeding the tokens of `</think>\n\n`
        instead of sampling; the answer follows. ValueError for a negative budget."""
        check_token_ids(self.model, ids)
        reasoning = tracker_for(self.tokenizer, thinking, reasoning_budget)
        uid = next(self._uids)
        self.prefilling.append(_Seq(uid, ids, cache, n_cached, sampling, max_tokens, room,
                                    self.tokenizer, stop, boundaries, cancelled,
                                    self._drafter(sampling, reasoning), reasoning))
        return uid

    def _drafter(self, sampling: SamplingParams, reasoning: ReasoningTracker | None = None):
        """A drafter for a new sequence, or None: greedy requests only (a sampled one would
        draw with the global key, not its own seed's), and `auto` only where the verify pass
        batches its rows exactly (models/verify.py). Not with a reasoning budget: it forces
        tokens between the sampled ones, which a verify pass's drafts know nothing of."""
        if self.speculative == "off" or sampling.temperature > 0:
            return None
        if reasoning is not None and reasoning.budget is not None:
            return None
        with mx.stream(self.stream):
            if self.speculative == "auto" and not batched_rows_exact():
                return None
        return make_drafter(self.speculative, self.model)

    def remove(self, uids: Iterable[int]) -> list[Finished]:
        """End these sequences now, as cancelled (a decoding one's cache is still stored)."""
        wanted, out = set(uids), []
        for s in [s for s in self.prefilling if s.uid in wanted]:
            self.prefilling.remove(s)
            s.fed = None  # the cache is part-way: never stored
            out.append(self._finish(s, "cancelled"))
        for s in [s for s in self.decoding if s.uid in wanted]:
            self.decoding.remove(s)
            # Its last queued step is not read: the cache holds it, `fed` does not say so.
            if s.fed_now:
                s.fed.append(s.unread.item())
            out.append(self._finish(s, "cancelled"))
        return out

    def step(self) -> list[Event]:
        """One prefill chunk (of the oldest prefilling sequence) and one decode step of all
        the others; the events of the tokens read, in sequence order."""
        events: list[Event] = []
        self.prefill_s, self.batch_size = None, 0
        self._prefill_one(events)
        self._decode_all(events)
        self._read(events)
        return events

    # ---- the parts of a step -----------------------------------------------------------------
    def _prefill_one(self, events: list[Event]) -> None:
        """Cancelled prefills leave; the oldest one runs one chunk, or its first token (then
        it joins the decoding ones)."""
        for s in [s for s in self.prefilling if s.cancelled()]:
            self.prefilling.remove(s)
            s.fed = None  # the cache is part-way: never stored
            events.append(self._finish(s, "cancelled"))
        if not self.prefilling:
            return
        s = self.prefilling[0]
        try:
            with mx.stream(self.stream):
                # The step in flight first, so the time below is the prefill's alone
                # (/metrics' prefill_seconds_total: decode time = the rest).
                mx.eval([d.unread for d in self.decoding])
                t = time.perf_counter()
                ready = self._prefill(s, events)
                self.prefill_s = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - this sequence fails, the others go on
            self.prefilling.popleft()
            events.append(Failed(s.uid, e))
            return
        if ready:
            self.prefilling.popleft()
            self.decoding.append(s)

    def _prefill(self, s: _Seq, events: list[Event]) -> bool:
        """One chunk of `s`'s prompt into its cache (all but the last token, as
        `generate_step`), or, once only the last is left, that token alone: its first sampled
        token is then queued and True returned (it joins the batch). A chunk ends at the next
        snapshot point, where the cache is stored (no extra pass: the chunk was due anyway)."""
        if s.rest.size > 1:
            pos = len(s.ids) - s.rest.size
            n = chunk_size(pos, s.rest.size - 1, self.prefill_step,
                           s.points[0][0] if s.points else None)
            t = time.perf_counter()
            hook = getattr(s.drafter, "prompt_hidden", None)
            if hook is not None:  # an MTP head fills its own cache from the trunk's hidden
                chunk = s.rest[:n]
                hook(self.model.language_model.model(chunk[None], s.cache, eval_layers=True)[0],
                     chunk)
                mx.eval([a for c in s.cache for a in cache_arrays(c)])
            else:
                prefill_chunk(self.model, s.rest[:n], s.cache)
            s.rest = s.rest[n:]
            if s.points and s.points[0][0] == pos + n:
                _, kind = s.points.popleft()
                self._store(s.ids[:pos + n], s.cache, kind)  # a snapshot is an optimisation
            release_free_memory()  # the chunk's scratch, not kept mapped (system/memory.py)
            # The chunk's time as the other streams wait for it: its snapshot (a copy, maybe
            # a spill to disk) included.
            events.append(self._prefilled(s, n, time.perf_counter() - t))
            return False
        t = time.perf_counter()
        if s.drafter is not None:
            logits, hidden = self.model(s.rest[None], cache=s.cache, return_hidden=True)
            s.drafter.accepted(0, 0, hidden[0])
            logits = logits[:, -1, :]
        else:
            logits = self.model(s.rest[None], cache=s.cache)[:, -1, :]
        s.unread = s.sample(logits)
        mx.eval(s.unread)
        s.force()  # a budget of 0: the block closes at once
        events.append(self._prefilled(s, int(s.rest.size), time.perf_counter() - t))
        return True

    @staticmethod
    def _prefilled(s: _Seq, n: int, seconds: float) -> Prefilled:
        s.prefilled += n
        return Prefilled(s.uid, n, seconds, s.n_cached + s.prefilled, len(s.ids), s.n_cached,
                         time.perf_counter() - s.t0)

    def _decode_all(self, events: list[Event]) -> None:
        """One decode step for every sequence that needs another token (pipelined: from the
        tokens sampled last step, not yet read). A failed step fails its sequences."""
        feed = [s for s in self.decoding if s.read + 1 < s.limit]
        spec = None
        if len(self.decoding) == 1 and feed and feed[0].drafter is not None:
            s = feed[0]
            if s.plain_left > 0:
                # A stretch without drafts decodes as plain decode does, pipelined (a one-row
                # verify pass waits for its token: ~1.4x a pipelined step on the bundled model).
                s.plain_left -= 1
                s.plain_n += 1
                if s.plain_t0 is None:
                    s.plain_t0 = time.perf_counter()
            else:
                self._end_stretch(s)
                spec, feed = s, []  # alone: a verify pass (the batch hands its states back)
        elif self.speculative != "off":
            for s in self.decoding:  # in company: a stretch's speed is not plain decode's alone
                if s.plain_n:
                    s.plain_t0, s.plain_n = None, 0
        for s in feed:
            if s.drafter is not None:
                s.synced = False  # a batched step: its drafter does not hear this token
        try:
            with mx.stream(self.stream):
                members = self.batch.set_members(feed)
                if members:
                    for s in members:
                        if s.processors:
                            s.history = mx.concatenate(
                                [s.history, s.unread.astype(mx.uint32)])[-s.keep:]
                    logits = self.batch.step(mx.concatenate(
                        [s.unread.astype(mx.uint32) for s in members]))
                    for i, s in enumerate(members):
                        s.next, s.fed_now = s.sample(logits[i:i + 1]), True
                    mx.async_eval([s.next for s in members])
                    self.batch_size = len(members)
        except Exception as e:  # noqa: BLE001 - the step failed: so do its sequences
            events.extend(Failed(s.uid, e) for s in self.decoding)
            self.decoding, self.batch = [], DecodeBatch(self.model)
            return
        if spec is not None:
            try:
                with mx.stream(self.stream):
                    self._speculate(spec)
                self.batch_size = 1
            except Exception as e:  # noqa: BLE001 - this sequence fails
                self.decoding.remove(spec)
                events.append(Failed(spec.uid, e))

    @staticmethod
    def _end_stretch(s: _Seq) -> None:
        """The drafter hears how long the plain stretch just ended took (`auto`'s back-off
        compares it with its drafting passes)."""
        if s.plain_t0 is not None and s.plain_n:
            if (timed := getattr(s.drafter, "timed", None)) is not None:
                timed(1, time.perf_counter() - s.plain_t0, s.plain_n)
        s.plain_t0, s.plain_n = None, 0

    def _speculate(self, s: _Seq) -> None:
        """A verify pass over [pending token, drafts] for `s`, decided by the greedy rule; what
        it yields is read (and the cache committed to it) by `_read`."""
        d = s.drafter
        if not s.synced:  # it missed batched steps' hidden states: start it over
            getattr(d, "reset_sequence", d.reset)()
            s.synced = True
        y = int(s.unread.item())
        # Tokens this pass may yield after y: all but the last are read now, the last next step.
        k = min(self.num_draft_tokens, s.limit - s.read - 2)
        t = time.perf_counter()  # the drafter's own work counts against its passes
        drafts: list[int] = []
        if k > 0:
            drafts = d.draft([*s.seen, y], k)[:k]
            # No draft: the steps after this pass decode plainly (`_decode_all`), for as long
            # as `auto` backs off, or (lookup) until a match appears (`_read` asks `has_draft`).
            if not drafts and hasattr(d, "plain_steps"):
                s.plain_left = d.plain_steps() - 1
            elif not drafts and hasattr(d, "has_draft"):
                s.plain_left = s.limit
        rows = [y, *drafts]
        hist = [*s.history.tolist(), y] if s.processors else []
        logits, hidden, tape = verify_forward(self.model, mx.array(rows, mx.uint32), s.cache)
        out, a = accept_drafts(logits, rows, hist, True, None, s.sampler, s.processors, s.keep, None)
        if (timed := getattr(d, "timed", None)) is not None:
            timed(len(rows), time.perf_counter() - t, a + 1)
        s.spec = (tape, hidden, [tok for tok, _ in out[:a]], len(drafts), a)
        s.next, s.fed_now = mx.array([out[a][0]], mx.uint32), True
        s.drafted, s.accepted = s.drafted + len(drafts), s.accepted + a
        self.drafted, self.accepted = self.drafted + len(drafts), self.accepted + a

    def _read(self, events: list[Event]) -> None:
        """Read what the previous step sampled; finished sequences leave."""
        for s in list(self.decoding):
            if s.spec is not None:
                self._read_pass(s, events)
                continue
            try:
                reason = self._take(s, s.unread.item(), events)
                if reason is not None:
                    self.decoding.remove(s)
                    events.append(self._finish(s, reason))
                    continue
                if s.plain_left > 0 and (has := getattr(s.drafter, "has_draft", None)):
                    if has(s.seen):  # a match: the stretch ends after the step queued
                        s.plain_left = 0
            except Exception as e:  # noqa: BLE001
                self.decoding.remove(s)
                if s.fed_now:
                    self.batch.release(s)
                events.append(Failed(s.uid, e))
                continue
            s.unread, s.next, s.fed_now = s.next, None, False
            s.force()

    def _read_pass(self, s: _Seq, events: list[Event]) -> None:
        """Read a verify pass's tokens: the pending one, then the drafts kept, up to where the
        reply ends; the cache is committed to exactly the rows read (so `fed` says what it
        holds), and the drafter hears their hidden states."""
        tape, hidden, kept_drafts, drafted, a = s.spec
        s.spec = None
        rows = [int(s.unread.item())]
        try:
            reason = self._take(s, rows[0], events)
            for tok in kept_drafts:
                if reason is not None:
                    break
                rows.append(tok)
                reason = self._take(s, tok, events)
            commit(s.cache, tape, len(rows))
            s.fed_now = False
            if s.processors:
                s.history = mx.array([*s.history.tolist(), *rows][-s.keep:], mx.uint32)
            s.drafter.accepted(drafted, a, hidden[:len(rows)])
        except Exception as e:  # noqa: BLE001
            self.decoding.remove(s)
            events.append(Failed(s.uid, e))
            return
        if reason is not None:
            self.decoding.remove(s)
            events.append(self._finish(s, reason))
            return
        s.unread, s.next = s.next, None

    def _take(self, s: _Seq, token: int, events: list[Event]) -> str | None:
        """Account for `s`'s next sampled token (its text as a `Token`); the finish reason when
        this token ends the reply (as `stream_generate` decides), else None."""
        s.read += 1
        if s.fed_now:
            s.fed.append(token)
        if s.drafter is not None:
            s.seen.append(token)
        if token in s.eos:
            return "eos"
        now = time.perf_counter()
        first = s.t_first is None
        if first:
            s.t_first = now
        piece, stopped = s.text.add(token)
        reasoning, forced = "", False
        if s.reasoning is not None:
            forced = s.reasoning.owed
            reasoning, piece = s.reasoning.add(piece)
        events.append(Token(s.uid, piece, now - (s.t0 if first else s.t_prev), first,
                            reasoning, forced))
        s.t_prev = now
        s.n += 1
        if stopped:
            return "stop"
        if s.read >= s.limit:
            capped = s.max_tokens is not None and s.n >= s.max_tokens
            return "length" if capped else "context"
        if s.cancelled():
            return "cancelled"
        return None

    def _finish(self, s: _Seq, reason: str) -> Finished:
        """Close `s`: the held-back text, its cache into the store (before the caller hears
        the end, so a next turn finds it)."""
        tail = s.text.flush() if reason != "stop" and s.fed is not None else ""
        reasoning, n_reasoning = "", 0
        if s.reasoning is not None:
            reasoning, tail = s.reasoning.finish(tail)
            n_reasoning = s.reasoning.tokens
        tps = (s.n - 1) / (time.perf_counter() - s.t_first) if s.n > 1 else 0.0
        # fed is None only when the cache was left part-way (cancelled in prefill); a reply
        # cancelled while decoding still leaves a cache worth keeping for a retry.
        if s.fed is not None:
            if s.fed_now:
                self.batch.release(s)  # its linear states, this last step included
            # The reply is complete: a cache that could not be kept costs a later prefill,
            # not this answer.
            self._store(s.ids[:s.n_cached] + s.fed, s.cache, "end")
        return Finished(s.uid, reason, tail, len(s.ids), s.n, s.n_cached,
                        s.text.hit if reason == "stop" else None, tps,
                        time.perf_counter() - s.t0, reasoning, n_reasoning)

    def _store(self, tokens: list[int], cache: list, kind: str) -> None:
        store_cache(self.store, tokens, cache, kind)


def store_cache(store: PrefixStore, tokens: list[int], cache: list, kind: str) -> None:
    """`store.store(...)`, a failure logged: keeping a cache is an optimisation, a reply that
    is complete does not fail for it (it costs a later prefill)."""
    try:
        store.store(tokens, cache, kind=kind)
    except Exception as e:  # noqa: BLE001
        log.warning(f"prompt cache: not stored: {type(e).__name__}: {one_line(e)}")


def decode_lockstep(lockstep, model, tokenizer, ids: list[int], *, uid: int, cache: list,
                    n_cached: int, sampling: SamplingParams, max_tokens: int,
                    stop: Sequence[str] | None, device: str, cancelled: Callable[[], bool],
                    store: PrefixStore) -> Iterator[Token | Finished]:
    """One sequence generated on every rank at once (`serve --distributed`, where every
    forward is collective, so the ranks run one request at a time): `Lockstep.stream_generate`'s
    responses as this module's events, so the server handles both paths alike."""
    t0 = time.perf_counter()
    last, t_token, tail = None, None, ""
    for r in lockstep.stream_generate(model, tokenizer, ids[n_cached:], cache=cache,
                                      max_tokens=max_tokens, sampling=sampling, stop=stop,
                                      device=device, should_stop=cancelled,
                                      warn=log.warning):
        last = r
        if r.token is None:  # the text held back, at the end
            tail += r.text
            continue
        now = time.perf_counter()
        first = t_token is None
        yield Token(uid, r.text, r.stats.ttft_s if first else now - t_token, first)
        t_token = now
    stats = last.stats
    # fed_tokens is None only when the cache was left part-way (cancelled in prefill); a
    # reply cancelled while decoding still leaves a cache worth keeping for a retry.
    if last.fed_tokens is not None:
        store_cache(store, ids[:n_cached] + last.fed_tokens, cache, "end")
    yield Finished(uid, stats.finish_reason, tail, len(ids), stats.generation_tokens, n_cached,
                   stats.stop_string, stats.generation_tps, time.perf_counter() - t0)
