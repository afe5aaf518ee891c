"""`serve --speculative`: engine/batch.py's `BatchDecoder` with a drafter, used directly as
the server's worker uses it (and the flag through the real CLI). Greedy replies equal those of
plain batched decoding token for token, alone (verify passes, and plain pipelined steps where
there is nothing to draft) and with others (batched steps plain, passes while one decodes
alone); the cache a reply leaves holds exactly the tokens it says."""

from __future__ import annotations

import socket
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from pocket_mlx import kernels
from pocket_mlx.engine import devices
from pocket_mlx.engine.batch import BatchDecoder, Finished, Prefilled, Token
from pocket_mlx.engine.generation import SamplingParams, prompt_tokens
from pocket_mlx.engine.loader import default_model_path, load
from pocket_mlx.engine.prompt_cache import cache_offset
from pocket_mlx.errors import PocketError

CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef scale(points, k):\n"
    "    return [(x * k, y * k) for x, y in points]\n\n\nclass Box:\n"
    "    def __init__(self, w, h):\n        self.w = w\n        self.h = h\n"
)
EDIT = "# original\n" + CODE + "\n# edited\n" + CODE[:120]  # raw: the model copies, lookup drafts
# Raw, the code twice and a start of a third copy: the model repeats a line, lookup drafts it
# (EDIT's reply drafts nothing under `auto` in one of the layouts, panels or rows).
REPEAT = CODE + "\n" + CODE + "\n" + CODE[:60]
# Raw, a count: the model repeats "2" by wide logit margins (0.1 where EDIT's reply has 0.03),
# so the reply, and what lookup drafts of it, is the same whichever ISA's rounding ran.
COUNT = "1 2 3 4 5 6"
# Chat-templated: drafts partly accepted.
COPY = [
    {"role": "user", "content": "Repeat this code exactly, with add renamed to plus:\n\n" + CODE}
]


class Stored:
    """Remembers the caches it was handed at a reply's end (tokens, cache)."""

    def __init__(self) -> None:
        self.ends: list[tuple[list[int], list]] = []

    def store(self, tokens, cache, kind="end") -> None:
        if kind == "end":
            self.ends.append((list(tokens), cache))


@pytest.fixture(scope="module")
def tiny():
    kernels.keep_rows_independent(3)
    return load(default_model_path(), device="cpu", fuse=True)


def _run(tiny, spec: str, requests: list[tuple[list[int], int, dict]]):
    model, tok = tiny
    store = Stored()
    dec = BatchDecoder(
        model,
        tok,
        stream=devices.stream_for("cpu"),
        store=store,
        speculative=spec,
        num_draft_tokens=3,
    )
    uids = [
        dec.insert(
            ids,
            cache=model.make_cache(),
            n_cached=0,
            sampling=SamplingParams(**sampling),
            max_tokens=n,
            room=10_000,
        )
        for ids, n, sampling in requests
    ]
    texts, done = {u: "" for u in uids}, {}
    while len(dec):
        for ev in dec.step():
            assert isinstance(ev, (Prefilled, Token, Finished)), ev
            if isinstance(ev, (Token, Finished)):
                texts[ev.uid] += ev.text
            if isinstance(ev, Finished):
                done[ev.uid] = (ev.reason, ev.completion_tokens)
    return [(texts[u], done[u]) for u in uids], dec, store


def test_alone_equals_plain_and_cache_holds_the_reply(tiny, exact_kernels):
    model, tok = tiny
    ids = tok.encode(EDIT)
    plain, _, plain_store = _run(tiny, "off", [(ids, 48, {})])
    spec, dec, store = _run(tiny, "lookup", [(ids, 48, {})])
    assert spec == plain and plain[0][0]
    assert 0 < dec.accepted <= dec.drafted
    # The cache stored at the end holds the tokens it is stored under, no more (rows of a
    # pass past the reply's end were committed away): the next token's logits from it are a
    # fresh prefill's.
    ((tokens, cache),) = store.ends
    assert tokens == plain_store.ends[0][0] and cache_offset(cache) == len(tokens)
    probe = mx.array([[tokens[-1]]])
    fresh = model.make_cache()
    ref = model(mx.array(tokens + [tokens[-1]])[None], cache=fresh)[0, -1]
    np.testing.assert_allclose(
        np.array(model(probe, cache=cache)[0, -1]), np.array(ref), rtol=1e-3, atol=1e-3
    )


def test_alone_without_a_match_decodes_plainly(tiny, exact_kernels, monkeypatch):
    """Where lookup has no match the sequence decodes by pipelined steps, not a one-row verify
    pass per token (each waits for its token), until a match appears; same reply."""
    passes: list[int] = []
    speculate = BatchDecoder._speculate

    def counted(self, s):
        speculate(self, s)
        passes.append(s.spec[4] + 1)  # tokens this pass yields

    monkeypatch.setattr(BatchDecoder, "_speculate", counted)
    _, tok = tiny
    ids = tok.encode("Once upon a time")  # its reply matches now and then
    plain, _, _ = _run(tiny, "off", [(ids, 64, {})])
    spec, dec, _ = _run(tiny, "lookup", [(ids, 64, {})])
    assert spec == plain and dec.drafted > 0
    # Tokens from passes (each yields at least one), the rest from plain steps: 19 of 64 here
    # (with a pass for every token, 63 of 64).
    assert len(passes) < sum(passes) < plain[0][1][1] // 2


def test_with_others_equals_plain(tiny, exact_kernels):
    """Three requests: greedy (one with a repetition penalty) and seeded sampling (decoded
    plainly); they decode alone at the start and end, together in between."""
    _, tok = tiny
    reqs = [
        (prompt_tokens(tok, COPY), 40, {}),
        (tok.encode("Once upon a time"), 6, {"temperature": 0.8, "seed": 3}),
        (tok.encode(EDIT), 24, {"repetition_penalty": 1.2}),
    ]
    plain, _, _ = _run(tiny, "off", reqs)
    spec, dec, _ = _run(tiny, "lookup", reqs)
    assert spec == plain
    assert dec.drafted > 0


def test_auto_and_mtp_without_head(headless_asset):
    """A model without a head (the bundled one's trunk): `mtp` refused, `auto` drafts by
    lookup."""
    tiny = load(headless_asset, device="cpu", fuse=True)
    model, tok = tiny
    assert model.mtp is None
    with pytest.raises(PocketError, match="no MTP head"):
        BatchDecoder(
            model, tok, stream=devices.stream_for("cpu"), store=Stored(), speculative="mtp"
        )
    ids = tok.encode(REPEAT)
    plain, _, _ = _run(tiny, "off", [(ids, 32, {})])
    auto, dec, _ = _run(tiny, "auto", [(ids, 32, {})])
    assert auto == plain and dec.drafted > 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_flag_checks(headless_asset):
    for model, argv, text in (
        (str(headless_asset), ["--speculative", "mtp"], "no MTP head"),
        (str(default_model_path()), ["--speculative", "lookup", "--distributed", "pipeline"],
         "--distributed"),
    ):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pocket_mlx",
                "serve",
                "--model",
                model,
                "--port",
                str(_free_port()),
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        assert text in r.stderr and "Traceback" not in r.stderr


def test_mtp_head_alone_and_with_others(tmp_path, exact_kernels):
    """synthetic:tiny-mtp (a random head: drafts mostly rejected) through the batch: its MTP
    drafter fills its cache during the batch's prefill and drafts while a request is alone."""
    from pocket_mlx.convert import synthetic

    tiny = load(synthetic.build("tiny-mtp", out=tmp_path / "s", progress=False), device="cpu")
    _, tok = tiny
    reqs = [(tok.encode(EDIT), 20, {}), (tok.encode("Once upon a time"), 5, {})]
    for batch in (reqs[:1], reqs):
        plain, _, _ = _run(tiny, "off", batch)
        spec, dec, _ = _run(tiny, "mtp", batch)
        assert spec == plain and dec.drafted > 0


def test_server_flag_greedy_reply_equals_plain(tmp_path, tiny, exact_kernels, monkeypatch):
    """A real `serve --speculative lookup` process: a greedy completion is the one plain
    decoding gives (the batch's own, in process), and /metrics counts the drafts: as many
    drafted and accepted as the same decoder in process, some of them accepted.

    Both sides in the kernels' EXACT mode: a greedy reply must not depend on which ISA's FAST
    rounding ran (issue 54: with AVX2's, EDIT's reply no longer copied the prompt and nothing
    was accepted). The prompt is COUNT, whose reply repeats itself by wide logit margins:
    the same reply and counts under EXACT and FAST, AVX-512 and AVX2 (EDIT's reply hangs
    on margins of 0.03)."""
    import test_server
    from test_server import Server, scrape

    _, tok = tiny
    ids = tok.encode(COUNT)
    plain, _, _ = _run(tiny, "off", [(ids, 40, {})])
    spec, dec, _ = _run(tiny, "lookup", [(ids, 40, {})])
    assert spec == plain and 0 < dec.accepted <= dec.drafted
    monkeypatch.setitem(test_server.ENV, "POCKET_MLX_KERNEL_MODE", "exact")
    s = Server(tmp_path / "serve.log", "--speculative", "lookup", "--prompt-cache-mb", "0")
    try:
        body = {"prompt": COUNT, "max_tokens": 40, "temperature": 0}
        status, _, out = s.request("POST", "/v1/completions", body, timeout=60)
        assert status == 200, out
        assert out["choices"][0]["text"] == plain[0][0]
        m = scrape(s)
        assert m["pocket_mlx_speculative_drafted_tokens_total"] == dec.drafted
        assert m["pocket_mlx_speculative_accepted_tokens_total"] == dec.accepted
    finally:
        s.stop()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
