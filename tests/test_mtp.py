"""Qwen3.5's multi-token-prediction head (`mtp.*`): loading, forward, convert, info."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import hf_weights, tiny_config, write_checkpoint

from pocket_mlx.cli.main import main
from pocket_mlx.config import read_config
from pocket_mlx.convert.pipeline import collect_router_stats
from pocket_mlx.engine.loader import load_model
from pocket_mlx.errors import PocketError

ROOT = Path(__file__).resolve().parent.parent
CALIB = ROOT / "assets" / "text" / "en.calib.txt"


def _ckpt(tmp_path: Path, layout: str, wrapped: bool, **over) -> tuple[Path, dict]:
    cfg = tiny_config(mtp_num_hidden_layers=1, **over)
    weights = hf_weights(cfg, 0, layout)
    return write_checkpoint(tmp_path / layout, cfg, weights, wrapped=wrapped), weights


@pytest.mark.parametrize("layout,wrapped", [("per_expert", True), ("fused", False)])
def test_head_loads_from_both_hugging_face_layouts(tmp_path, layout, wrapped):
    path, w = _ckpt(tmp_path, layout, wrapped)
    model = load_model(path, dtype="float32")
    mtp = model.mtp
    np.testing.assert_array_equal(np.array(mtp.fc.weight), w["mtp.fc.weight"])
    # (1 + w) norms are shifted as the trunk's are.
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        np.testing.assert_allclose(
            np.array(getattr(mtp, n).weight), 1 + w[f"mtp.{n}.weight"], rtol=1e-6
        )
    layer = mtp.layers[0]
    np.testing.assert_allclose(
        np.array(layer.input_layernorm.weight),
        1 + w["mtp.layers.0.input_layernorm.weight"],
        rtol=1e-6,
    )
    m = "mtp.layers.0.mlp.experts"
    if layout == "fused":
        gate = w[f"{m}.gate_up_proj"][:, :64]
        down = w[f"{m}.down_proj"]
    else:
        gate = np.stack([w[f"{m}.{e}.gate_proj.weight"] for e in range(8)])
        down = np.stack([w[f"{m}.{e}.down_proj.weight"] for e in range(8)])
    np.testing.assert_array_equal(np.array(layer.mlp.switch_mlp.gate_proj.weight), gate)
    np.testing.assert_array_equal(np.array(layer.mlp.switch_mlp.down_proj.weight), down)
    assert not hasattr(layer, "linear_attn")  # always full attention


def test_no_head_without_the_config_key(tmp_path, make_ckpt):
    model = load_model(make_ckpt("plain", wrapped=True))  # holds a stray mtp.fc.weight
    assert model.mtp is None
    with pytest.raises(PocketError, match="no multi-token-prediction head"):
        model.mtp_logits(mx.zeros((1, 1, 128)), mx.zeros((1, 1), mx.int32))


def test_declared_head_without_tensors_is_dropped(tmp_path):
    """Qwen3.5 configs say mtp_num_hidden_layers: 1 even where the tensors are gone (stock
    mlx-lm conversions): the model loads without a head, and convert writes none."""
    cfg = tiny_config(mtp_num_hidden_layers=1)
    weights = {k: v for k, v in hf_weights(cfg).items() if not k.startswith("mtp.")}
    src = write_checkpoint(tmp_path / "src", cfg, weights)
    model = load_model(src)
    assert model.mtp is None and model.args.mtp_num_hidden_layers == 0
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--recipe", "pocket-2bit"]) == 0
    assert "mtp_num_hidden_layers" not in json.loads((out / "config.json").read_text())
    assert load_model(out).mtp is None


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + w)


def _silu(x):
    return x / (1 + np.exp(-x))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _reference(w: dict, cfg: dict, hidden: np.ndarray, token: int) -> np.ndarray:
    """vLLM's Qwen3_5MultiTokenPredictor for one position with an empty cache (attention over
    the position itself: its value, gated), in float64 from the transformers tensors."""
    p = "mtp.layers.0"
    nh, nkv, hd, k = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["num_experts_per_tok"],
    )
    w = {n: v.astype(np.float64) for n, v in w.items()}
    e = w["model.embed_tokens.weight"][token]
    x = np.concatenate(
        [
            _rms(e, w["mtp.pre_fc_norm_embedding.weight"]),
            _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"]),
        ]
    )
    x = w["mtp.fc.weight"] @ x
    a = _rms(x, w[f"{p}.input_layernorm.weight"])
    q = (w[f"{p}.self_attn.q_proj.weight"] @ a).reshape(nh, 2 * hd)
    gate = q[:, hd:]
    v = (w[f"{p}.self_attn.v_proj.weight"] @ a).reshape(nkv, hd)
    heads = v[np.arange(nh) // (nh // nkv)] * _sigmoid(gate)
    x = x + w[f"{p}.self_attn.o_proj.weight"] @ heads.reshape(-1)
    m = _rms(x, w[f"{p}.post_attention_layernorm.weight"])
    logits = w[f"{p}.mlp.gate.weight"] @ m
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = np.argsort(-probs)[:k]
    moe = np.zeros_like(x)
    for j in top:
        g = w[f"{p}.mlp.experts.{j}.gate_proj.weight"] @ m
        u = w[f"{p}.mlp.experts.{j}.up_proj.weight"] @ m
        moe += (
            probs[j]
            / probs[top].sum()
            * (w[f"{p}.mlp.experts.{j}.down_proj.weight"] @ (_silu(g) * u))
        )
    s = f"{p}.mlp.shared_expert"
    shared = w[f"{s}.down_proj.weight"] @ (
        _silu(w[f"{s}.gate_proj.weight"] @ m) * (w[f"{s}.up_proj.weight"] @ m)
    )
    x = x + moe + _sigmoid(w[f"{p}.mlp.shared_expert_gate.weight"] @ m) * shared
    return w["lm_head.weight"] @ _rms(x, w["mtp.norm.weight"])


def test_head_forward_matches_vllm_formula(tmp_path, exact_kernels):
    cfg = tiny_config(mtp_num_hidden_layers=1)
    path, w = _ckpt(tmp_path, "per_expert", False)
    model = load_model(path, dtype="float32")
    hidden = np.random.default_rng(1).standard_normal(cfg["hidden_size"]).astype(np.float32)
    logits, h = model.mtp_logits(
        mx.array(hidden)[None, None], mx.array([[17]]), model.make_mtp_cache()
    )
    assert logits.shape == (1, 1, cfg["vocab_size"]) and h.shape == (1, 1, cfg["hidden_size"])
    want = _reference(w, cfg, hidden.astype(np.float64), 17)
    np.testing.assert_allclose(
        np.array(logits[0, 0]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max()
    )


def test_synthetic_head_runs_with_its_cache(tmp_path, exact_kernels):
    """synthetic:tiny-mtp: the trunk's hidden (return_hidden, same logits as a plain call),
    the head over a prompt in one call equals the head run position by position, and a second
    depth chains on the head's own hidden."""
    from pocket_mlx.convert import synthetic

    model = load_model(
        synthetic.build("tiny-mtp", out=tmp_path / "s", progress=False), dtype="float32"
    )
    x = mx.array([[5, 900, 31, 4000, 7, 66]])
    plain = model(x, model.make_cache())
    logits, hidden = model(x, model.make_cache(), return_hidden=True)
    assert hidden.shape == (1, 6, 128)
    np.testing.assert_array_equal(np.array(logits), np.array(plain))
    np.testing.assert_allclose(
        np.array(model.language_model.logits(hidden)), np.array(logits), rtol=1e-5, atol=1e-5
    )
    cache = model.make_mtp_cache()
    whole, h1 = model.mtp_logits(hidden[:, :-1], x[:, 1:], cache)
    assert whole.shape == (1, 5, 8192) and cache[0].offset == 5
    step_cache = model.make_mtp_cache()
    steps = [
        model.mtp_logits(hidden[:, t : t + 1], x[:, t + 1 : t + 2], step_cache)[0] for t in range(5)
    ]
    np.testing.assert_allclose(
        np.array(mx.concatenate(steps, axis=1)), np.array(whole), rtol=1e-4, atol=1e-4
    )
    deeper, h2 = model.mtp_logits(h1[:, -1:], mx.argmax(whole[:, -1:], -1), cache, step=1)
    assert deeper.shape == (1, 1, 8192) and h2.shape == (1, 1, 128) and cache[0].offset == 6
    # Fused projections (inference loads) cover the head's layer too, with the same output.
    assert model.fuse_projections() == 4 + 4 + 2  # trunk: 4 mixers, 4 shared; the head: 2
    assert "qkv_proj" in model.mtp.layers[0].self_attn
    fused, _ = model.mtp_logits(hidden[:, :-1], x[:, 1:], model.make_mtp_cache())
    np.testing.assert_allclose(np.array(fused), np.array(whole), rtol=1e-4, atol=1e-4)
    # Distributed runs do not draft: sharding drops the head.
    model.shard_experts(mx.distributed.init())
    assert model.mtp is None and "mtp" not in model


def test_convert_keeps_prunes_and_quantizes_the_head(tmp_path, exact_kernels):
    """HF per-expert layout with a head -> pocket-2bit pruned 8 -> 5 by REAP-sum: the head is
    written (experts at the recipe's 2 bits, attention and fc at 4, router 8), its experts
    chosen by its own REAP-sum row, and stock mlx-lm still loads the build (ignoring mtp.*)."""
    from mlx_lm.utils import load_model as lm_load

    src, _ = _ckpt(tmp_path, "per_expert", True, vocab_size=8192)
    out = tmp_path / "out"
    assert (
        main(
            [
                "convert",
                str(src),
                str(out),
                "--recipe",
                "pocket-2bit",
                "--prune-to",
                "5",
                "--calib",
                str(CALIB),
                "--calib-tokens",
                "300",
            ]
        )
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert cfg["mtp_num_hidden_layers"] == 1
    assert q["mtp.layers.0.mlp.switch_mlp.gate_proj"]["bits"] == 2
    assert q["mtp.layers.0.self_attn.q_proj"]["bits"] == 4 and q["mtp.fc"]["bits"] == 4
    assert q["mtp.layers.0.mlp.gate"]["bits"] == 8
    stats, _ = collect_router_stats(src, read_config(src), [CALIB], 512, 300, progress=False)
    assert stats.reap_sum.shape == (5, 8)  # 4 trunk layers + the head's
    # Every window of n tokens gives the head n - 1 positions, each routed to top-2.
    assert stats.freq[4].sum() == (300 - 1) * 2
    top = sorted(int(e) for e in np.argsort(-stats.reap_sum[4], kind="stable")[:5])
    info = json.loads((out / "pocket.json").read_text())
    assert info["kept_experts"]["4"] == top
    ours = load_model(out)
    assert ours.mtp.layers[0].mlp.switch_mlp.gate_proj.num_experts == 5
    theirs = lm_load(out)[0]
    p = mx.array([[1, 2, 3, 400, 5000, 77]])
    a, b = np.array(ours(p)), np.array(theirs(p))
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
    # The head's experts are the kept ones, in order: each written (2-bit) expert is nearest
    # to the source expert of its id.
    src_w = np.array(load_model(src, dtype="float32").mtp.layers[0].mlp.switch_mlp.gate_proj.weight)
    sw = load_model(out, dtype="float32").mtp.layers[0].mlp.switch_mlp.gate_proj
    got = np.array(mx.dequantize(sw.weight, sw.scales, sw.biases, sw.group_size, sw.bits))
    dist = ((got[:, None] - src_w[None]) ** 2).sum(axis=(-1, -2))
    assert dist.argmin(axis=1).tolist() == top


def test_info_reports_the_head(tmp_path):
    src, w = _ckpt(tmp_path, "fused", False)
    run = subprocess.run(
        [sys.executable, "-m", "pocket_mlx", "info", "--model", str(src), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    d = json.loads(run.stdout)
    want = sum(v.nbytes for k, v in w.items() if k.startswith("mtp."))
    assert d["mtp"] == {"layers": 1, "bytes": want}
    assert d["quantization"]["mtp"]["bytes_per_token"] == 0
    text = subprocess.run(
        [sys.executable, "-m", "pocket_mlx", "info", "--model", "synthetic:tiny"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "mtp head         no" in text
