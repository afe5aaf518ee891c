"""Expert pruning: scores on a hand-built case, exact slicing for every input layout."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT

from pocket_mlx.cli.main import main
from pocket_mlx.config import read_config
from pocket_mlx.convert.pipeline import collect_router_stats
from pocket_mlx.convert.prune import ExpertStats, batch_stats, select_experts
from pocket_mlx.engine.loader import load_model

CALIB = ROOT / "assets" / "text" / "en.calib.txt"


# Parity with mlx-lm needs the kernels' EXACT mode (conftest.exact_kernels).
pytestmark = pytest.mark.usefixtures("exact_kernels")


def test_reap_and_frequency_on_two_experts():
    # Token 1 routes to experts (0, 1) with gates (0.75, 0.25), output norms (2, 4);
    # token 2 to (1, 0) with gates (0.6, 0.4), output norms (1, 3); token 3 to (0, 1), (0.5, 0.5),
    # norms (0, 10).
    inds = mx.array([[[0, 1], [1, 0], [0, 1]]])
    scores = mx.array([[[0.75, 0.25], [0.6, 0.4], [0.5, 0.5]]])
    outs = np.zeros((1, 3, 2, 4), np.float32)
    outs[0, 0, 0, :2] = [1.2, 1.6]  # norm 2
    outs[0, 0, 1, 2] = -4.0
    outs[0, 1, 0, 3] = 1.0
    outs[0, 1, 1, :2] = [1.8, 2.4]  # norm 3
    outs[0, 2, 1, :2] = [6.0, 8.0]  # norm 10
    freq, total = batch_stats(inds, scores, mx.array(outs), 2)
    np.testing.assert_allclose(np.array(freq), [3, 3])
    np.testing.assert_allclose(np.array(total), [0.75 * 2 + 0.4 * 3 + 0.0,
                                                 0.25 * 4 + 0.6 * 1 + 0.5 * 10], rtol=1e-6)
    stats = ExpertStats(1, 2)
    stats.observer(0)(None, inds, scores, mx.array(outs))
    np.testing.assert_allclose(stats.reap[0], [2.7 / 3, 6.6 / 3], rtol=1e-6)


def test_criteria_disagree_and_select_accordingly():
    stats = ExpertStats(1, 4)
    stats.freq[0] = [10, 1, 5, 8]
    stats.reap_sum[0] = [2.0, 3.0, 4.0, 1.0]  # mean: 0.2, 3, 0.8, 0.125
    assert select_experts(stats, 2, "frequency", 1, 4) == [[0, 3]]
    assert select_experts(stats, 2, "reap-sum", 1, 4) == [[1, 2]]
    assert select_experts(stats, 2, "reap", 1, 4) == [[1, 2]]
    # reap-max: per calibration file, each expert's share of the layer's REAP-sum; the largest
    # share counts. File 1 relies on expert 3, which the summed scores rank below expert 2.
    stats.by_source = np.array([[[8.0, 1.0, 1.0, 0.0]], [[0.0, 0.0, 1.0, 2.0]]])
    stats.reap_sum = stats.by_source.sum(0)  # [8, 1, 2, 2]
    assert select_experts(stats, 2, "reap-sum", 1, 4) == [[0, 2]]
    assert select_experts(stats, 2, "reap-max", 1, 4) == [[0, 3]]
    r = select_experts(None, 2, "random", 3, 4, seed=5)
    assert r == select_experts(None, 2, "random", 3, 4, seed=5) and all(len(x) == 2 for x in r)


def _router_and_experts(model, layer: int, x: mx.array):
    mlp = model.layers[layer].mlp
    sw = mlp.switch_mlp.up_proj
    w = sw.weight if not hasattr(sw, "scales") else (sw.weight, sw.scales, sw.biases)
    return np.array(mlp.gate(x)), w


@pytest.mark.parametrize("layout", ["per_expert", "fused", "quantized"])
def test_pruning_keeps_exactly_the_chosen_experts(tmp_path, make_ckpt, layout):
    src = make_ckpt("src", layout="fused" if layout == "quantized" else layout)
    recipe = "float"
    if layout == "quantized":
        q = tmp_path / "q"
        assert main(["convert", str(src), str(q), "--recipe", "pocket-2bit"]) == 0
        src, recipe = q, "pocket-2bit"  # same specs: tensors pass through unchanged
    out = tmp_path / "pruned"
    assert main(["convert", str(src), str(out), "--recipe", recipe, "--prune-to", "4",
                 "--criterion", "random", "--seed", "3"]) == 0
    info = json.loads((out / "pocket.json").read_text())
    kept = select_experts(None, 4, "random", 4, 8, seed=3)
    assert info["kept_experts"] == {str(i): k for i, k in enumerate(kept)}
    assert info["original_num_experts"] == 8 and info["num_experts"] == 4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    before, after = load_model(src), load_model(out)
    x = mx.random.normal((1, 5, 128), key=mx.random.key(0))
    for i in range(4):
        r0, w0 = _router_and_experts(before, i, x)
        r1, w1 = _router_and_experts(after, i, x)
        np.testing.assert_array_equal(r1, r0[..., kept[i]])
        idx = mx.array(kept[i])
        for a, b in zip(w1 if isinstance(w1, tuple) else [w1],
                        w0 if isinstance(w0, tuple) else [w0]):
            np.testing.assert_array_equal(np.array(a), np.array(b[idx]))


@pytest.mark.parametrize("experts, top_k, tokens", [(8, 2, 512), (32, 2, 2048)])
def test_default_calibration_tokens_scale_with_experts_per_routed_slot(tmp_path, make_ckpt,
                                                                      experts, top_k, tokens):
    """Without --calib-tokens, pruning reads 128 routed tokens per expert of each file
    (tokens x top_k / experts, whole 512-token windows): 4x the tokens for 4x the experts,
    as the 35B (256, top-8: 4096) needs more than the reference (32, top-4: 1024)."""
    from pocket_mlx.convert.calibrate import reap_tokens

    assert (reap_tokens(32, 4), reap_tokens(256, 8)) == (1024, 4096)
    src = make_ckpt("src", vocab_size=8192, num_experts=experts, num_experts_per_tok=top_k)
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--prune-to", str(experts // 2),
                 "--calib", str(CALIB)]) == 0
    info = json.loads((out / "pocket.json").read_text())
    assert [c["tokens"] for c in info["calibration"]] == [tokens]
    stats, _ = collect_router_stats(src, read_config(src), [CALIB], 512, tokens,
                                    progress=False)
    top = [sorted(int(e) for e in np.argsort(-row, kind="stable")[:experts // 2])
           for row in stats.reap_sum]
    assert info["kept_experts"] == {str(i): k for i, k in enumerate(top)}


def test_calibrated_pruning_keeps_top_reap_sum(tmp_path, make_ckpt):
    """The CLI's choice equals the top-K of REAP-sum computed independently; mlx-lm loads it."""
    from mlx_lm.utils import load_model as lm_load

    src = make_ckpt("src", vocab_size=8192)  # the real tokenizer's ids
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--recipe", "pocket-3bit", "--prune-to", "5",
                 "--calib", str(CALIB), "--calib", str(CALIB), "--calib-tokens", "300"]) == 0
    info = json.loads((out / "pocket.json").read_text())
    stats, files = collect_router_stats(src, read_config(src), [CALIB], 512, 300,
                                        progress=False)
    top = [sorted(int(e) for e in np.argsort(-row, kind="stable")[:5]) for row in stats.reap_sum]
    assert info["kept_experts"] == {str(i): k for i, k in enumerate(top)}
    assert info["criterion"] == "reap-sum" and len(info["calibration"]) == 2
    assert info["calibration"][0]["tokens"] == 300 == files[0].get("tokens")
    assert info["calibration"][0]["sha256"] == files[0]["sha256"]
    assert stats.freq.sum(axis=1).tolist() == [300 * 2] * 4  # every token routes to top-2
    # Per-file statistics (reap-max): two files, each file's share recorded apart.
    two, _ = collect_router_stats(src, read_config(src), [CALIB, CALIB], 64, 300, progress=False)
    assert two.by_source.shape == (2, 4, stats.num_experts)
    np.testing.assert_allclose(two.by_source[0], two.by_source[1], rtol=1e-5)
    np.testing.assert_allclose(two.by_source.sum(0), two.reap_sum, rtol=1e-6)
    p = mx.array([[1, 2, 3, 400, 5000, 77]])
    a, b = np.array(load_model(out)(p)), np.array(lm_load(out)[0](p))
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
