"""Fused projections (`Model.fuse_projections`, `load(..., fuse=True)`): same logits, fewer
quantized matmuls, mixed formats left alone, and the checkpoint's names for anything saving."""

from __future__ import annotations

import collections
import io
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from pocket_mlx.analysis import bench
from pocket_mlx.convert.writer import save_model
from pocket_mlx.engine.loader import load, load_model
from pocket_mlx.models.fusion import unfused_parameters

PROMPT = [[5, 17, 42, 7, 99]]
DECODE = [3, 250, 11]  # fixed tokens: a near-tie in a greedy choice cannot make runs diverge


@pytest.fixture(params=["pocket-kernels", "mlx"])
def kernels_path(request):
    """The CPU extension's matmuls (skip without it, fail under POCKET_MLX_REQUIRE_KERNELS=1), and
    MLX's own (those the GPU runs too)."""
    from pocket_mlx import kernels

    if request.param == "pocket-kernels":
        request.getfixturevalue("kernels_ext")
    was = kernels.enabled()
    kernels.set_enabled(request.param == "pocket-kernels")
    try:
        yield request.param
    finally:
        kernels.set_enabled(was)


def logits(model) -> list[np.ndarray]:
    """Prefill of PROMPT, then single-token decode steps, with a cache."""
    cache = model.make_cache()
    outs = [model(mx.array(PROMPT), cache=cache)]
    outs += [model(mx.array([[t]]), cache=cache) for t in DECODE]
    mx.eval(outs)
    return [np.array(o) for o in outs]


def assert_close(a: list[np.ndarray], b: list[np.ndarray], tol: float = 1e-5) -> None:
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert np.abs(x - y).max() <= tol * np.abs(y).max()


def dot(model) -> str:
    """The graph of one decode step (after a prompt), as Graphviz text."""
    cache = model.make_cache()
    mx.eval(model(mx.array(PROMPT), cache=cache))
    f = io.StringIO()
    mx.export_to_dot(f, model(mx.array([[DECODE[0]]]), cache=cache))
    return f.getvalue()


def qmm_nodes(model) -> int:
    """Quantized matmul nodes (MLX's or the extension's, not the experts' gathers) in the graph
    of one decode step."""
    labels = collections.Counter(re.findall(r'label ="([A-Za-z]+)', dot(model)))
    return labels["QuantizedMatmul"] + labels["PocketQMM"]


def test_fused_logits_equal(tiny_ckpt, kernels_path):
    model = load_model(tiny_ckpt, dtype="float32")
    before = logits(model)
    # 3 GatedDeltaNet + 1 attention mixers, 4 shared experts.
    assert model.fuse_projections() == 8
    after = logits(model)
    assert_close(after, before)


def test_fused_layers_replace_the_parts(tiny_ckpt):
    model, _ = load(tiny_ckpt, dtype="float32", fuse=True)
    lin, att = model.layers[0], model.layers[3]
    assert "in_proj" in lin.linear_attn and "in_proj_qkv" not in lin.linear_attn
    assert "qkv_proj" in att.self_attn and "q_proj" not in att.self_attn
    assert "gate_up_proj" in lin.mlp.shared_expert and "up_proj" not in lin.mlp.shared_expert
    names = {k for k, _ in tree_flatten(model.parameters())}
    assert not any(k.endswith(("in_proj_z.weight", "k_proj.scales", "gate_proj.biases"))
                   and ".switch_mlp." not in k for k in names)
    # Conversion and calibration load without it.
    plain = load_model(tiny_ckpt)
    assert "in_proj_qkv" in plain.layers[0].linear_attn


def test_fewer_quantized_matmuls_per_decode_step(tiny_ckpt, kernels_path):
    model = load_model(tiny_ckpt, dtype="float32")
    before = qmm_nodes(model)
    model.fuse_projections()
    # Per GatedDeltaNet 4 -> 1, per attention 3 -> 1, per shared expert 2 -> 1; with the CPU
    # extension the whole MoE block (shared expert included) is already one node.
    moe_is_one_node = "PocketMoE" in dot(model)
    assert before - qmm_nodes(model) == 3 * 3 + 1 * 2 + (0 if moe_is_one_node else 4 * 1)


def test_mixed_bits_stay_separate(make_ckpt):
    model = load_model(make_ckpt())  # float32, unquantized

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        if path.endswith(("self_attn.k_proj", "linear_attn.in_proj_b")):
            return {"group_size": 64, "bits": 8}
        return True

    nn.quantize(model, 64, 4, class_predicate=predicate)
    before = logits(model)
    assert model.fuse_projections() == 4  # the shared experts only
    lin, att = model.layers[0], model.layers[3]
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"} <= set(lin.linear_attn)
    assert {"q_proj", "k_proj", "v_proj"} <= set(att.self_attn)
    assert lin.mlp.shared_expert.gate_up_proj.bits == 4
    assert_close(logits(model), before)


def test_float_projections_fuse_too(make_ckpt):
    model = load_model(make_ckpt())
    before = logits(model)
    assert model.fuse_projections() == 8
    assert isinstance(model.layers[3].self_attn.qkv_proj, nn.Linear)
    assert_close(logits(model), before)


def test_checkpoint_names_of_a_fused_model(tiny_ckpt, tmp_path, exact_kernels):
    plain = load_model(tiny_ckpt, dtype="float32")
    fused = load_model(tiny_ckpt, dtype="float32", fuse=True)
    want = dict(tree_flatten(plain.parameters()))
    got = dict(unfused_parameters(fused))
    assert set(got) == set(want)
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
    # Saving a fused model writes the checkpoint's layout, which loads back unfused.
    saved = load_model(save_model(fused, fused.config, tmp_path / "saved",
                                  quantization=fused.config["quantization"]))
    assert {k for k, _ in tree_flatten(saved.parameters())} == set(want)
    assert_close(logits(saved), logits(plain))
    # bench --vs-mlx-lm builds mlx-lm's model from our (fused) arrays.
    theirs = bench.mlx_lm_model(tiny_ckpt, fused)
    a, b = np.array(theirs(mx.array(PROMPT))), np.array(fused(mx.array(PROMPT)))
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
