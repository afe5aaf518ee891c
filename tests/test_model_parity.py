"""Our Qwen3.5-MoE against stock mlx-lm's `qwen3_5_moe` (the test oracle), float32."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import hf_weights, tiny_config, write_checkpoint
from mlx.utils import tree_flatten

from pocket_mlx.convert.writer import save_model
from pocket_mlx.engine.loader import load_model

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 1, 2, 200, 33, 71, 8]


def mlx_lm_model(path):
    from mlx_lm.utils import load_model as lm_load

    model, _ = lm_load(path)
    return model


def oracle_copy(tmp_path, cfg, weights, wrapped):
    """mlx-lm reads only the fused layout and needs model_type qwen3_5_moe."""
    cfg = dict(cfg, model_type="qwen3_5_moe")
    return write_checkpoint(tmp_path / "oracle", cfg, weights, wrapped=wrapped)


def run_logits(model, steps=20):
    """Logits of the full prompt, then of `steps` incremental greedy steps with a cache."""
    cache = model.make_cache()
    full = model(mx.array(PROMPT)[None], cache=cache)
    outs = [full]
    tok = mx.argmax(full[:, -1], axis=-1)
    for _ in range(steps):
        logits = model(tok[None], cache=cache)
        outs.append(logits)
        tok = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(outs)
    return [np.array(o) for o in outs]


def assert_close(ours, theirs, tol=1e-4):
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        err = np.abs(a - b).max() / max(1.0, np.abs(b).max())
        assert err < tol, f"max error {err}"


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_logits_match_mlx_lm(tmp_path, layout, wrapped):
    cfg = tiny_config()
    weights = hf_weights(cfg, seed=1, layout=layout)
    ours = load_model(write_checkpoint(tmp_path / "ours", cfg, weights, wrapped=wrapped))
    fused = weights if layout == "fused" else hf_weights(cfg, seed=1, layout="fused")
    theirs = mlx_lm_model(oracle_copy(tmp_path, cfg, fused, wrapped))
    assert_close(run_logits(ours), run_logits(theirs))


def quantized_copy(tmp_path, model, config):
    """2-bit experts, 8-bit routers, 4-bit everything else: saved as an MLX checkpoint."""
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if path.endswith(("mlp.gate", "shared_expert_gate")):
            spec = {"group_size": 64, "bits": 8}
        elif ".switch_mlp." in path:
            spec = {"group_size": 64, "bits": 2}
        else:
            return True
        quant[path] = spec
        return spec

    nn.quantize(model, 64, 4, class_predicate=predicate)
    return save_model(model, config, tmp_path / "q", quantization=quant)


def test_quantized_logits_match_mlx_lm(tmp_path, make_ckpt, exact_kernels):
    src = make_ckpt("src", layout="fused")
    model = load_model(src)
    qpath = quantized_copy(tmp_path, model, model.config)
    qcfg = json.loads((qpath / "config.json").read_text())
    assert qcfg["quantization"]["language_model.model.layers.0.mlp.switch_mlp.gate_proj"]["bits"] == 2
    ours = load_model(qpath)
    layer = ours.language_model.model.layers[0].mlp
    assert layer.switch_mlp.gate_proj.bits == 2 and layer.gate.bits == 8
    assert_close(run_logits(ours), run_logits(mlx_lm_model(qpath)))


def test_tied_embeddings_and_saved_copy_round_trip(tmp_path, make_ckpt):
    src = make_ckpt("tied", tie_word_embeddings=True)
    model = load_model(src)
    assert "lm_head" not in model.language_model
    saved = load_model(save_model(model, model.config, tmp_path / "saved"))
    assert_close(run_logits(model, 3), run_logits(saved, 3), tol=1e-6)
    names = {k for k, _ in tree_flatten(saved.parameters())}
    assert not any("lm_head" in k for k in names)
