"""engine/batch.py's `BatchDecoder` used directly, as the server's worker uses it: prompts
inserted together give, token for token, the greedy replies `generate` gives each alone; a
sequence removed mid-reply ends as cancelled with its cache stored, the others go on; the
snapshots of a long prompt's prefill reach the store at their points."""

from __future__ import annotations

import pytest

from pocket_mlx import kernels
from pocket_mlx.engine import devices
from pocket_mlx.engine.batch import BatchDecoder, Finished, Prefilled, Token
from pocket_mlx.engine.generation import SamplingParams, generate
from pocket_mlx.engine.loader import default_model_path, load
from pocket_mlx.engine.prompt_cache import SNAPSHOT_INTERVAL
from pocket_mlx.errors import PocketError

PROMPTS = ["Once upon a time", "The king of the north said", "Water is"]


class Stored:
    """The smallest store: remembers what it was handed (tokens, kind)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], str]] = []

    def store(self, tokens, cache, kind="end") -> None:
        self.calls.append((list(tokens), kind))


@pytest.fixture(scope="module")
def tiny():
    kernels.keep_rows_independent(len(PROMPTS))
    return load(default_model_path(), device="cpu")


def decoder(tiny, store) -> BatchDecoder:
    model, tok = tiny
    return BatchDecoder(model, tok, stream=devices.stream_for("cpu"), store=store)


def insert(dec: BatchDecoder, ids: list[int], max_tokens: int) -> int:
    return dec.insert(ids, cache=dec.model.make_cache(), n_cached=0, sampling=SamplingParams(),
                      max_tokens=max_tokens, room=10_000)


def drain(dec: BatchDecoder, texts: dict[int, str], done: dict[int, Finished],
          prefilled: list[Prefilled] | None = None) -> None:
    while len(dec):
        step(dec, texts, done, prefilled)


def step(dec: BatchDecoder, texts: dict[int, str], done: dict[int, Finished],
         prefilled: list[Prefilled] | None = None) -> None:
    for ev in dec.step():
        assert isinstance(ev, (Prefilled, Token, Finished)), ev
        if isinstance(ev, Prefilled):
            if prefilled is not None:
                prefilled.append(ev)
            continue
        texts[ev.uid] += ev.text
        if isinstance(ev, Finished):
            done[ev.uid] = ev


def test_inserted_together_equal_generate_alone(tiny, exact_kernels):
    model, tok = tiny
    store = Stored()
    dec = decoder(tiny, store)
    ids = [tok.encode(p) for p in PROMPTS]
    uids = [insert(dec, i, 8) for i in ids]
    texts, done = {u: "" for u in uids}, {}
    drain(dec, texts, done)
    for u, i in zip(uids, ids):
        alone = generate(model, tok, i, max_tokens=8, temperature=0.0, device="cpu")
        assert texts[u] == alone and alone
        assert done[u].prompt_tokens == len(i) and done[u].reason in ("length", "eos")
    # Each finished cache went to the store, holding its prompt and the reply tokens fed.
    assert sorted(len(t) for t, k in store.calls if k == "end") == sorted(
        len(i) + done[u].completion_tokens - 1 for u, i in zip(uids, ids)
        if done[u].reason == "length")


def test_removed_sequence_is_cancelled_the_others_go_on(tiny, exact_kernels):
    model, tok = tiny
    store = Stored()
    dec = decoder(tiny, store)
    a, b = (tok.encode(p) for p in PROMPTS[:2])
    ua, ub = insert(dec, a, 12), insert(dec, b, 12)
    texts, done = {ua: "", ub: ""}, {}
    while len(dec.decoding) < 2:  # both past their first token
        step(dec, texts, done)
    step(dec, texts, done)
    (gone,) = dec.remove([ua])
    assert gone.reason == "cancelled" and gone.uid == ua and len(dec) == 1
    tokens, kind = store.calls[-1]
    assert kind == "end" and tokens[:len(a)] == a and len(tokens) > len(a)
    drain(dec, texts, done)
    assert set(done) == {ub}
    assert texts[ub] == generate(model, tok, b, max_tokens=12, temperature=0.0, device="cpu")


def test_prefill_stores_snapshots_at_their_points(tiny):
    model, tok = tiny
    store = Stored()
    dec = decoder(tiny, store)
    ids = (tok.encode(" ".join(["the quick brown fox"] * 400)))[:SNAPSHOT_INTERVAL + 40]
    insert(dec, ids, 1)
    prefilled: list[Prefilled] = []
    drain(dec, {0: ""}, {}, prefilled)
    kinds = [(len(t), k) for t, k in store.calls]
    assert kinds[0] == (SNAPSHOT_INTERVAL, "interval") and kinds[-1][1] == "end"
    # Every prompt token was fed once, in chunks that end at the snapshot point.
    assert sum(p.tokens for p in prefilled) == len(ids) == prefilled[-1].done
    assert SNAPSHOT_INTERVAL in [p.done for p in prefilled]


def test_insert_refuses_ids_past_the_vocabulary(tiny):
    """The server's path: a prompt id past the embedding fails that request with one line
    (server/engine.py turns it into the request's error) and queues nothing."""
    model, _ = tiny
    dec = decoder(tiny, Stored())
    for bad in ([1, 2, model.args.vocab_size], [-1, 5]):
        with pytest.raises(PocketError, match="outside the model's vocabulary"):
            insert(dec, bad, max_tokens=4)
    assert len(dec) == 0 and not dec.prefilling
