"""scripts/make_shape_checkpoint.py: the 35B's hub layout (names, shapes, sharding), and a
slice of it that `pocket-mlx convert` reads (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_shape_checkpoint.py"
sys.path.insert(0, str(ROOT / "scripts"))

import make_shape_checkpoint as shape  # noqa: E402


def test_full_shape_is_the_35b():
    """40 layers, 256 experts: ~34.7B parameters (the real model less its vision tower and MTP
    head), 3 Gated DeltaNet layers then one full-attention layer, per-expert tensors."""
    cfg = shape.text_config(40, None)
    specs = {n: s for n, s, _ in shape.tensor_specs(cfg)}
    params = sum(shape._numel(s) for s in specs.values())
    assert 34.5e9 < params < 35e9
    assert cfg["layer_types"][:8] == ["linear_attention"] * 3 + ["full_attention"] \
        + ["linear_attention"] * 3 + ["full_attention"]
    p = "model.language_model.layers"
    assert specs["model.language_model.embed_tokens.weight"] == (248320, 2048)
    assert specs["lm_head.weight"] == (248320, 2048)
    assert specs[f"{p}.0.mlp.experts.255.gate_proj.weight"] == (512, 2048)
    assert specs[f"{p}.0.mlp.experts.255.down_proj.weight"] == (2048, 512)
    assert specs[f"{p}.0.mlp.gate.weight"] == (256, 2048)
    assert specs[f"{p}.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert specs[f"{p}.0.linear_attn.in_proj_qkv.weight"] == (8192, 2048)
    assert specs[f"{p}.0.linear_attn.conv1d.weight"] == (8192, 1, 4)
    assert specs[f"{p}.3.self_attn.q_proj.weight"] == (8192, 2048)
    assert f"{p}.3.linear_attn.in_proj_qkv.weight" not in specs
    assert f"{p}.0.mlp.experts.256.up_proj.weight" not in specs


def test_slice_is_sharded_and_converts(tmp_path):
    """--layers 2 --experts 4 --mtp at toy widths, in 3+ shards: an index covering every
    tensor, bf16 throughout; `pocket-mlx convert` reads it and writes a model with 4 experts a
    layer and the MTP head."""
    out = tmp_path / "slice"
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), "--layers", "2", "--experts",
                        "4", "--tiny-dims", "--shard-size-gb", str(1 / 1024), "--mtp"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) >= 3 and all(s.endswith(f"-of-{len(shards):05d}.safetensors")
                                    for s in shards)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["layer_types"] == ["linear_attention"] * 2
    want = {n: s for n, s, _ in shape.tensor_specs(cfg["text_config"])}
    got = {}
    for s in shards:
        with safe_open(str(out / s), "numpy") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                assert sl.get_dtype() == "BF16", k
                got[k] = tuple(sl.get_shape())
                assert index[k] == s
    assert got == want
    conv = tmp_path / "conv"
    r = subprocess.run([sys.executable, "-m", "pocket_mlx", "convert", str(out), str(conv),
                        "--recipe", "pocket-2bit"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    conv_cfg = json.loads((conv / "config.json").read_text())
    assert conv_cfg["num_experts"] == 4 and conv_cfg["mtp_num_hidden_layers"] == 1
    assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in got
    assert conv_cfg["quantization"]["mtp.layers.0.mlp.switch_mlp.up_proj"]["bits"] == 2


def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, msg in ((["--layers", "0"], "--layers must be"),
                      (["--layers", "1", "--experts", "1"], "--experts must be")):
        r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x"), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and msg in r.stderr, r.stderr


@pytest.mark.parametrize("layers", [5])
def test_layer_types_follow_the_real_order(layers):
    cfg = shape.text_config(layers, 8)
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention",
                                                             "linear_attention"]
    assert cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 8
