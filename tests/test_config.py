"""pocket_mlx.config: the one reader of config.json's text part, layer types, the quantization
dict, safetensors sizes and pocket.json, on real files and the bundled model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from pocket_mlx import config as C
from pocket_mlx.errors import PocketError
from pocket_mlx.models import build_model
from pocket_mlx.models.qwen3_5_moe import ModelArgs
from pocket_mlx.system.wired import kv_cache_bytes

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "assets" / "pocket-tiny"

TEXT = {"num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 64,
        "max_position_embeddings": 128, "linear_num_value_heads": 2, "linear_num_key_heads": 1,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32}


# -- text_config ---------------------------------------------------------------------------------
def test_text_config_flat_nested_and_filled_from_outer():
    flat = {"model_type": "qwen3_5_moe", **TEXT, "vision_config": {"depth": 2}}
    assert C.text_config(flat) == {"model_type": "qwen3_5_moe", **TEXT}
    assert "vision_config" in flat  # a copy: the caller's dict is untouched

    nested = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "eos_token_id": 7,
              "hidden_size": 999, "vision_config": {"depth": 2},
              "text_config": {**TEXT, "model_type": "qwen3_5_moe_text", "eos_token_id": 9}}
    text = C.text_config(nested)
    assert text["hidden_size"] == 64 and text["eos_token_id"] == 9  # the nested part wins
    assert text["tie_word_embeddings"] is True  # what it lacks comes from the outer config
    assert "text_config" not in text and "vision_config" not in text
    assert C.model_type(nested) == "qwen3_5_moe"  # the checkpoint's own type first
    assert C.model_type({"text_config": {"model_type": "qwen3_5_moe_text"}}) == "qwen3_5_moe_text"
    # The model reads the same: the outer tie flag reaches ModelArgs.
    args = ModelArgs.from_config(nested)
    assert args.tie_word_embeddings is True and args.hidden_size == 64
    assert args.model_type == "qwen3_5_moe"


# -- layer types ---------------------------------------------------------------------------------
def test_layer_types_default_is_every_fourth_layer_full():
    types = C.layer_types(TEXT)
    assert types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert C.layer_types({**TEXT, "full_attention_interval": None}) == types
    assert C.layer_types({**TEXT, "full_attention_interval": 2}) == (
        ["linear_attention", "full_attention"] * 4)
    given = ["full_attention"] * 8
    assert C.layer_types({"text_config": {**TEXT, "layer_types": given}}) == given


def test_model_and_kv_estimate_agree_on_layer_types():
    """ModelArgs and `wired`'s KV estimate once derived different defaults; now one rule."""
    for cfg in (TEXT, {**TEXT, "full_attention_interval": 2}, {"text_config": TEXT}):
        args = ModelArgs.from_config({"model_type": "qwen3_5_moe", **cfg})
        kv = kv_cache_bytes(cfg)
        assert kv.full_layers == args.layer_types.count("full_attention")
        assert kv.linear_layers == args.layer_types.count("linear_attention")
        assert args.layer_types == C.layer_types(cfg)


@pytest.mark.parametrize("cfg,msg", [
    ({**TEXT, "layer_types": ["full_attention"] * 3}, "3 entries for 8 layers"),
    ({**TEXT, "layer_types": ["full_attention"] * 7 + ["sliding"]}, "unknown layer type"),
    ({**TEXT, "full_attention_interval": 0}, "full_attention_interval must be"),
    ({**TEXT, "full_attention_interval": "4"}, "full_attention_interval must be"),
    ({"hidden_size": 64}, "lacks 'num_hidden_layers'"),
    ({**TEXT, "num_hidden_layers": "eight"}, "num_hidden_layers must be a whole number"),
])
def test_bad_layer_types(cfg, msg):
    with pytest.raises(PocketError, match=msg):
        C.layer_types(cfg)


# -- quantization ----------------------------------------------------------------------------------
MIXED = {"group_size": 64, "bits": 4, "mode": "affine",
         "language_model.lm_head": {"group_size": 64, "bits": 6},
         "language_model.model.layers.0.mlp.gate": {"bits": 8},
         "language_model.model.layers.0.linear_attn.conv1d": False}


def test_quantization_found_where_mlx_lm_looks():
    assert C.quantization({**TEXT}) is None
    assert C.quantization({"quantization": MIXED}) is MIXED
    assert C.quantization({"quantization_config": MIXED}) is MIXED
    assert C.quantization({"text_config": {**TEXT, "quantization": MIXED}}) is MIXED
    for bits in C.AFFINE_BITS:
        for gs in C.GROUP_SIZES:
            assert C.quantization({"quantization": {"bits": bits, "group_size": gs}})


def test_module_quantization_and_bits_used():
    assert C.module_quantization(MIXED, "language_model.lm_head") == (6, 64)
    assert C.module_quantization(MIXED, "language_model.model.layers.0.mlp.gate") == (8, 64)
    assert C.module_quantization(MIXED, "language_model.model.layers.0.linear_attn.conv1d") is None
    assert C.module_quantization(MIXED, "anything.else") == (4, 64)
    assert C.module_quantization({}, "x") is None and C.module_quantization(None, "x") is None
    assert C.module_quantization({"language_model.lm_head": True}, "language_model.lm_head") == (
        C.DEFAULT_BITS, C.DEFAULT_GROUP_SIZE)
    assert C.bits_used(MIXED) == [4, 6, 8]


BAD_QUANT = [
    ({"bits": 7}, "quantization.bits is 7", "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"bits": 0}, "quantization.bits is 0", "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"bits": 16}, "quantization.bits is 16", "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"bits": "abc"}, 'quantization.bits is "abc"', "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"bits": "4"}, 'quantization.bits is "4"', "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"bits": True}, "quantization.bits is true", "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"bits": 4.0}, "quantization.bits is 4.0", "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"bits": None}, "quantization.bits is null", "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"group_size": 7}, "quantization.group_size is 7", "group_size 32, 64 or 128"),
    ({"group_size": "64"}, 'quantization.group_size is "64"', "group_size 32, 64 or 128"),
    ({"group_size": False}, "quantization.group_size is false", "group_size 32, 64 or 128"),
    ({"language_model.lm_head": {"bits": 7}},
     'quantization["language_model.lm_head"].bits is 7', "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"language_model.lm_head": {"bits": "abc", "group_size": 64}},
     'quantization["language_model.lm_head"].bits is "abc"', "bits 1, 2, 3, 4, 5, 6 or 8"),
    ({"language_model.lm_head": {"bits": 4, "group_size": 7}},
     'quantization["language_model.lm_head"].group_size is 7', "group_size 32, 64 or 128"),
    ({"language_model.lm_head": 8}, 'quantization["language_model.lm_head"] is 8',
     "object with bits and group_size, or false"),
    ({"mode": "mxfp4"}, "unsupported quantization mode 'mxfp4'", "affine only"),
    ({"quant_method": "awq"}, "unsupported quantization method 'awq'", "MLX affine only"),
]


@pytest.mark.parametrize("override,names,allowed", BAD_QUANT)
def test_bad_quantization_is_one_line_naming_key_and_allowed_values(override, names, allowed):
    q = {"group_size": 64, "bits": 4, "mode": "affine", **override}
    with pytest.raises(PocketError) as e:
        C.quantization({**TEXT, "quantization": q}, where="m/config.json")
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    assert msg.startswith("m/config.json: ") and names in msg and allowed in msg


def test_quantization_that_is_not_an_object():
    with pytest.raises(PocketError, match=r"quantization must be an object, got \[4\]"):
        C.quantization({"quantization": [4]})


@pytest.mark.parametrize("override", [{"bits": "abc"},
                                      {"language_model.lm_head": {"group_size": 7}}])
def test_bad_quantization_refused_by_every_command(tmp_path, override):
    """A copy of the bundled model with one bad value: one line on stderr, exit 2 (generate,
    info, eval-ppl, bench), not a traceback from inside nn.quantize."""
    model = tmp_path / "m"
    shutil.copytree(BUNDLED, model)
    cfg = json.loads((model / "config.json").read_text())
    for key, value in override.items():
        if isinstance(value, dict):
            cfg["quantization"][key].update(value)
        else:
            cfg["quantization"][key] = value
    (model / "config.json").write_text(json.dumps(cfg))
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 20)
    for argv in (["generate", "--model", str(model), "--prompt", "hi", "-n", "2"],
                 ["info", "--model", str(model)],
                 ["eval-ppl", "--model", str(model), "--data", str(text)],
                 ["bench", "--model", str(model), "-p", "0", "-n", "1", "-r", "1", "-q"]):
        proc = subprocess.run([sys.executable, "-m", "pocket_mlx", *argv], capture_output=True,
                              text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 2, (argv[0], proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert "config.json: quantization" in proc.stderr, (argv[0], proc.stderr)


@pytest.mark.parametrize("key, value", [("max_position_embeddings", "x"),
                                        ("num_attention_heads", 0), ("hidden_size", "abc"),
                                        ("num_experts", True), ("rms_norm_eps", -1.0)])
def test_bad_model_size_in_config_is_one_line(tmp_path, key, value):
    """A hand-edited size or rate in config.json: one line naming it, exit 2, before any layer
    is built (it used to end in a ZeroDivisionError, TypeError or ValueError traceback)."""
    model = tmp_path / "m"
    shutil.copytree(BUNDLED, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    proc = subprocess.run([sys.executable, "-m", "pocket_mlx", "generate", "--model", str(model),
                           "--prompt", "hi", "-n", "2"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert f"config: {key} must be" in proc.stderr
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


# -- safetensors -----------------------------------------------------------------------------------
def test_weights_bytes_counts_tensors_not_headers(tmp_path):
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"),
                        {"a": mx.zeros((3, 5), mx.bfloat16), "b": mx.zeros((7,), mx.uint32)})
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"),
                        {"c": mx.zeros((2, 2), mx.float32)})
    assert C.weights_bytes(tmp_path) == 3 * 5 * 2 + 7 * 4 + 4 * 4
    assert C.weights_bytes(tmp_path / "nothing-here") == 0
    whole = (tmp_path / "model-00002-of-00002.safetensors").read_bytes()
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(whole[:-3])
    with pytest.raises(PocketError, match="model-00002-of-00002.safetensors is truncated"):
        C.weights_bytes(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x05")
    with pytest.raises(PocketError, match="not a valid safetensors file"):
        C.weights_bytes(tmp_path)


def test_weights_bytes_of_the_bundled_model_is_its_size_in_memory():
    from pocket_mlx.engine.loader import load_model
    from pocket_mlx.models.accounting import weight_stats

    stats = weight_stats(load_model(BUNDLED, lazy=True))
    assert C.weights_bytes(BUNDLED) == stats.bytes_total
    assert C.weights_bytes(BUNDLED) < sum(f.stat().st_size for f in BUNDLED.glob("*.safetensors"))


# -- pocket.json and the recipe label ------------------------------------------------------------
def test_recipe_label_from_convert_dict_and_from_plain_string():
    cfg = {**TEXT, "num_experts": 24, "quantization": MIXED}
    convert = {"recipe": {"name": "pocket-3bit", "rules": [{"pattern": "*", "spec": None}] * 40},
               "original_num_experts": 32}
    assert C.recipe_name(cfg, convert) == "pocket-3bit"
    assert C.recipe_label(cfg, convert) == "pocket-3bit (24/32 experts)"
    synthetic = {"recipe": "pocket-2bit", "original_num_experts": 24}
    assert C.recipe_label(cfg, synthetic) == "pocket-2bit"  # not pruned: the name alone
    nested = {"text_config": {**TEXT, "num_experts": 24}}
    assert C.recipe_label(nested, {"recipe": "r", "original_num_experts": 32}) == "r (24/32 experts)"


def test_recipe_label_without_pocket_json(tmp_path):
    assert C.read_pocket_json(tmp_path) == {}  # absent
    (tmp_path / "pocket.json").write_text("{not json")
    assert C.read_pocket_json(tmp_path) == {}
    (tmp_path / "pocket.json").write_text("[1, 2]")
    assert C.read_pocket_json(tmp_path) == {}
    assert C.recipe_label({**TEXT, "quantization": {"bits": 4, "group_size": 64}}, {}) == "uniform-4"
    assert C.recipe_label({**TEXT, "quantization": MIXED}) == "mixed-4/6/8"
    kept_float = {"bits": 4, "group_size": 64, "language_model.lm_head": False}
    assert C.recipe_label({**TEXT, "quantization": kept_float}) == "mixed-4"
    assert C.recipe_label({**TEXT, "torch_dtype": "bfloat16"}) == "bf16"
    assert C.recipe_label({**TEXT, "dtype": "float16"}) == "fp16"
    assert C.recipe_label(dict(TEXT)) == "bf16"


def test_bundled_model_label():
    cfg = json.loads((BUNDLED / "config.json").read_text())
    pocket = C.read_pocket_json(BUNDLED)
    assert isinstance(pocket["recipe"], dict) and len(json.dumps(pocket["recipe"])) > 500
    assert C.recipe_label(cfg, pocket) == "pocket-3bit (24/32 experts)"
    model = build_model(cfg)
    assert model.args.layer_types == C.layer_types(cfg)
