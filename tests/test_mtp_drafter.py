"""The MTP drafter (engine/mtp_drafter.py) on synthetic:tiny-mtp (a random head): greedy
speculation gives plain decode's tokens, and the head's own KV cache ends holding exactly what
the head computes over the trunk's hidden states of the whole sequence (prompt and reply),
after drafts that were rejected, partly accepted and wholly accepted."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import speculative_run

from pocket_mlx.convert import synthetic
from pocket_mlx.engine.drafters import BackOff, LookupDrafter, LookupFirst, make_drafter
from pocket_mlx.engine.loader import load
from pocket_mlx.engine.mtp_drafter import MAX_MTP_DEPTH, MTPDrafter

PROMPT = "The sea, the sea: a poem about the tide and the moon over the harbour."


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    path = synthetic.build("tiny-mtp", out=tmp_path_factory.mktemp("m") / "s", progress=False)
    return path, *load(path, device="cpu", fuse=True)


def _run(model, tok, spec="off", k=3, max_tokens=48, **sampling):
    return speculative_run(model, tok, PROMPT, spec, k, max_tokens, **sampling)


@pytest.fixture(scope="module")
def plain(tiny_mtp):
    _, model, tok = tiny_mtp
    return _run(model, tok)


def test_make_drafter_picks_the_head(tiny_mtp):
    _, model, _ = tiny_mtp
    assert isinstance(make_drafter("mtp", model), MTPDrafter)
    auto = make_drafter("auto", model)
    assert isinstance(auto, LookupFirst) and isinstance(auto.head.inner, MTPDrafter)
    assert isinstance(auto.lookup, BackOff) and isinstance(auto.lookup.inner, LookupDrafter)


@pytest.mark.parametrize("spec", ["mtp", "auto"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_mtp_equals_plain(tiny_mtp, plain, spec, k):
    _, model, tok = tiny_mtp
    got, stats = _run(model, tok, spec, k)
    assert got == plain[0]
    sp = stats.speculative
    assert sp["method"] == ("mtp" if spec == "mtp" else "auto:lookup+mtp") and sp["drafted"] > 0
    if spec == "mtp" and sp["accepted"] == 0:  # each pass drafts min(k, depth, tokens left - 1)
        n = len(got)
        assert sp["drafted"] == sum(min(k, MAX_MTP_DEPTH, n - 1 - i) for i in range(n))


class _Oracle(MTPDrafter):
    """The head drafts as usual (its cache bookkeeping runs), then its tokens are replaced by
    plain decode's next ones, the last of them spoiled on every other pass: passes accept all,
    some or none of the drafts."""

    def __init__(self, model, ref: list[int]) -> None:
        super().__init__(model)
        self.ref, self.passes, self.prompt = ref, 0, None

    def draft(self, tokens, k):
        drafts = super().draft(tokens, k)
        if self.prompt is None:  # the first pass drafts after the prompt
            self.prompt = list(tokens)
        j = len(tokens) - len(self.prompt)
        good = self.ref[j : j + len(drafts)]
        self.passes += 1
        if self.passes % 2 and good:
            good[-1] = (good[-1] + 1) % self.model.args.vocab_size
        return good


def test_head_cache_follows_accepted_tokens(tiny_mtp, monkeypatch, exact_kernels):
    """Exact kernels: the batched reference below then has decode's bits up to float error
    (FAST mode's int8 activations differ between prefill chunks and decode rows)."""
    _, model, tok = tiny_mtp
    ref, _ = _run(model, tok)
    d = _Oracle(model, ref)
    monkeypatch.setattr(model, "mtp_drafter", lambda: d, raising=False)
    got, stats = _run(model, tok, "mtp", 3)
    assert got == ref
    sp = stats.speculative
    assert 0 < sp["accepted"] < sp["drafted"]
    seq = d.prompt + got
    # The head's cache plus the rows waiting cover every position but the pending token's.
    n = d.cache[0].offset
    assert n + sum(h.shape[0] for h in d.waiting) == len(seq) - 1
    # ... and its keys are what the head computes over the trunk's hidden of the sequence in
    # one call (batched, so equal up to rounding), not over drafts or the head's own hidden.
    x = mx.array(seq)[None]
    _, hidden = model(x, model.make_cache(), return_hidden=True)
    whole = model.make_mtp_cache()
    model.mtp_logits(hidden[:, :n], x[:, 1 : n + 1], whole)
    got_k = np.array(d.cache[0].keys[..., :n, :].astype(mx.float32))
    ref_k = np.array(whole[0].keys[..., :n, :].astype(mx.float32))
    np.testing.assert_allclose(got_k, ref_k, rtol=1e-4, atol=1e-4)
    # Keys one position off (a pairing error) would be far from these: the check can fail.
    assert not np.allclose(got_k[..., 1:, :], ref_k[..., :-1, :], rtol=1e-2, atol=1e-2)


def test_generate_json_reports_mtp(tiny_mtp):
    path, _, _ = tiny_mtp
    base = [
        sys.executable,
        "-m",
        "pocket_mlx",
        "generate",
        "-m",
        str(path),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "24",
        "--json",
    ]
    runs = [
        subprocess.run(
            [*base, "--speculative", s, "--num-draft-tokens", "2"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for s in ("off", "mtp")
    ]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    off, mtp = (json.loads(r.stdout) for r in runs)
    assert mtp["text"] == off["text"] and "speculative" not in off
    sp = mtp["speculative"]
    assert sp["method"] == "mtp" and sp["num_draft_tokens"] == 2 and sp["drafted"] > 0
