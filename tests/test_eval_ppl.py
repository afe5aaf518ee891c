"""`pocket-mlx eval-ppl`: the number itself, documents and separators, JSON and errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import mlx.core as mx
import numpy as np
from conftest import ROOT, hf_weights, tiny_config, write_checkpoint

from pocket_mlx.analysis.perplexity import perplexity
from pocket_mlx.corpus import read_documents, token_stream, windows
from pocket_mlx.engine.loader import load_model
from pocket_mlx.engine.tokenizer import load_tokenizer


def test_perplexity_matches_a_direct_computation(make_ckpt):
    model = load_model(make_ckpt("m"))
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 300, 50)]
    r = perplexity(model, ids, window=16)
    nll, n = 0.0, 0
    for w in windows(ids, 16):
        lg = model(mx.array(w)[None]).astype(mx.float32)
        logp = np.array(lg - mx.logsumexp(lg, axis=-1, keepdims=True))[0]
        nll -= sum(logp[t, w[t + 1]] for t in range(len(w) - 1))
        n += len(w) - 1
    assert r.tokens == n == 50 - 4  # 16 + 16 + 16 + 2 tokens: one unpredicted per window
    assert math.isclose(r.ppl, math.exp(nll / n), rel_tol=1e-4)


def test_uniform_model_has_vocab_size_perplexity(tmp_path):
    cfg = tiny_config()
    w = hf_weights(cfg)
    w["lm_head.weight"][:] = 0
    model = load_model(write_checkpoint(tmp_path / "u", cfg, w))
    r = perplexity(model, list(range(40)), window=10)
    assert math.isclose(r.ppl, 300, rel_tol=1e-4)


def test_documents_and_separator(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("one\n<|endoftext|>\n\ntwo\n  <|endoftext|>\n\n===\nthree\n")
    assert read_documents(f) == ["one", "two", "===\nthree"]
    assert read_documents(f, "===") == ["one\n<|endoftext|>\n\ntwo\n  <|endoftext|>", "three"]
    tok = load_tokenizer(ROOT / "assets" / "pocket-tiny")
    ids = token_stream(["a b", "c"], tok)
    assert tok.token_to_id("<|endoftext|>") in ids


def run(*args):
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "eval-ppl", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_json_and_errors(tmp_path, make_ckpt):
    model = make_ckpt("m", vocab_size=8192)
    data = tmp_path / "d.txt"
    data.write_text("In the beginning\n<|endoftext|>\ndef f(x):\n    return x\n")
    p = run("--model", str(model), "--data", str(data), "--window", "8", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"ppl", "tokens", "seconds"} and out["ppl"] > 1 and out["tokens"] > 5
    tok = load_tokenizer(model)
    ids = token_stream(read_documents(data), tok)
    assert out["tokens"] == len(ids) - len(windows(ids, 8))
    empty = tmp_path / "e.txt"
    empty.write_text("\n<|endoftext|>\n")
    for args, msg in (([str(tmp_path / "nope.txt")], "no such text file"),
                      ([str(empty)], "has no text")):
        p = run("--model", str(model), "--data", *args)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
        assert msg in p.stderr and p.stderr.startswith("pocket-mlx eval-ppl: error:")
