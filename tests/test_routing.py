"""Routing consistency (`eval-ppl --routing-consistency REF`): the metric, pruned-id mapping, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT

from pocket_mlx.analysis.routing import Routes, consistency, record_routes
from pocket_mlx.cli.main import main
from pocket_mlx.engine.loader import load_model
from pocket_mlx.errors import PocketError

BF16 = ROOT / "assets" / "pocket-tiny-bf16"
TINY = ROOT / "assets" / "pocket-tiny"  # pocket-3bit build of BF16
VAL = ROOT / "assets" / "text" / "en.val.txt"

pytestmark = pytest.mark.usefixtures("exact_kernels")


def test_consistency_counts_shared_experts_per_token():
    a = Routes([np.array([[0, 1], [2, 3]]), np.array([[4, 5], [6, 7]])], 8, 2)
    b = Routes([np.array([[1, 0], [3, 5]]), np.array([[0, 1], [7, 2]])], 8, 2)
    c = consistency(a, b)
    # layer 0: token 1 shares 2 of 2, token 2 shares 1 of 2; layer 1: 0 and 1 of 2.
    assert c.per_layer == [0.75, 0.25] and c.overall == 0.5 and c.tokens == 2
    assert consistency(a, a).overall == 1.0
    with pytest.raises(PocketError, match="not builds of the same model"):
        consistency(a, Routes(b.per_layer, 16, 2))
    with pytest.raises(PocketError, match="MoE layers"):
        consistency(a, Routes(b.per_layer[:1], 8, 2))


def test_pruned_ids_map_back_to_the_original(tmp_path, make_ckpt):
    src = make_ckpt("src")
    out = tmp_path / "p"
    assert main(["convert", str(src), str(out), "--recipe", "bf16", "--prune-to", "5",
                 "--criterion", "random", "--seed", "3"]) == 0
    kept = json.loads((out / "pocket.json").read_text())["kept_experts"]
    ref, pruned = load_model(src, dtype="float32"), load_model(out, dtype="float32")
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 300, 40)]
    mine = record_routes(pruned, ids, 20, out)
    assert mine.num_experts == 8 and mine.top_k == 2
    # Layer 0 sees the same input in both models: the pruned router is the original one
    # restricted to the kept rows, so its choice is the original's top-k among the kept experts.
    xs = []
    blk = ref.language_model.model.layers[0].mlp
    blk.observer = lambda x, *_: xs.append(x)
    for i in range(0, 40, 20):
        ref(mx.array(ids[i:i + 20])[None])
    blk.observer = None
    logits = np.concatenate([np.array(blk.gate(x).reshape(-1, 8)) for x in xs])
    k0 = np.array(kept["0"])
    want = k0[np.argsort(-logits[:, k0], axis=1)[:, :2]]
    np.testing.assert_array_equal(np.sort(mine.per_layer[0], 1), np.sort(want, 1))
    for layer, ids_ in enumerate(mine.per_layer):
        assert set(np.unique(ids_)) <= set(kept[str(layer)])
    full = record_routes(ref, ids, 20, src)
    c = consistency(mine, full)
    assert 0 < c.overall < 1 and c.per_layer[0] < 1


def run(*args):
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "eval-ppl", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=180)


def test_cli_identical_quantized_and_bad_reference(tmp_path, make_ckpt):
    base = ("--data", str(VAL), "--max-tokens", "300", "--window", "150", "--json")
    p = run("--model", str(BF16), "--routing-consistency", str(BF16), *base)
    assert p.returncode == 0, p.stderr
    rc = json.loads(p.stdout)["routing_consistency"]
    assert rc["overall"] == 1.0 and rc["per_layer"] == [1.0] * 8 and rc["top_k"] == 4
    assert rc["tokens"] == 300
    p = run("--model", str(TINY), "--routing-consistency", str(BF16), *base)
    assert p.returncode == 0, p.stderr
    rc = json.loads(p.stdout)["routing_consistency"]
    assert 0.3 < rc["overall"] < 1 and len(rc["per_layer"]) == 8
    assert rc["overall"] == pytest.approx(np.mean(rc["per_layer"]), abs=1e-4)
    p = run("--model", str(TINY), "--routing-consistency", str(BF16), *base[:-1])
    assert p.returncode == 0 and "routing consistency with" in p.stdout
    other = tmp_path / "other.txt"
    other.write_text("x")
    for ref, msg in ((tmp_path / "nope", "no such model folder"),
                     (other, "is a file"),
                     (make_ckpt("m"), "vocabulary (300) differs")):
        p = run("--model", str(TINY), "--routing-consistency", str(ref), *base)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert msg in p.stderr and p.stderr.startswith("pocket-mlx eval-ppl: error:")
