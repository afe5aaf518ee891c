"""`pocket-mlx convert`: recipes, mlx-lm compatibility, streaming shards, bad inputs, kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import ROOT, tiny_config, write_checkpoint

from pocket_mlx.cli.main import main
from pocket_mlx.config import safetensors_header
from pocket_mlx.convert import writer
from pocket_mlx.convert.recipes import Spec, load_recipe, parse_recipe
from pocket_mlx.engine.loader import load_model
from pocket_mlx.errors import PocketError

L0 = "language_model.model.layers.0"
PROMPT = mx.array([[5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 1, 2]])


# Parity with mlx-lm needs the kernels' EXACT mode (conftest.exact_kernels).
pytestmark = pytest.mark.usefixtures("exact_kernels")


def cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocket_mlx", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def logits(model) -> np.ndarray:
    return np.array(model(PROMPT).astype(mx.float32))


# ---- recipes -----------------------------------------------------------------------------------
def test_pocket_recipe_resolves_each_family():
    r = load_recipe("pocket-2bit")
    want = {
        f"{L0}.mlp.switch_mlp.gate_proj": 2, f"{L0}.mlp.switch_mlp.down_proj": 2,
        f"{L0}.mlp.gate": 8, f"{L0}.mlp.shared_expert_gate": 8,
        f"{L0}.mlp.shared_expert.up_proj": 4, f"{L0}.linear_attn.in_proj_qkv": 4,
        f"{L0}.linear_attn.in_proj_b": 4, "language_model.model.layers.3.self_attn.o_proj": 4,
        "language_model.model.embed_tokens": 6, "language_model.lm_head": 6,
    }
    for path, bits in want.items():
        assert r.spec_for(path) == Spec(bits, 64), path
    assert load_recipe("pocket-3bit").spec_for(f"{L0}.mlp.switch_mlp.up_proj").bits == 3
    assert load_recipe("uniform-3").spec_for(f"{L0}.mlp.gate") == Spec(3, 64)
    assert load_recipe("bf16").spec_for("language_model.lm_head") is None


def test_user_recipe_first_match_wins_glob_regex_float_and_base(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text("""
name = "mine"
base = "pocket-2bit"
[[rules]]
regex = 'language_model\\.model\\.layers\\.0\\..*switch_mlp\\..*'
bits = 4
group_size = 32
[[rules]]
glob = "*lm_head"
float = true
[[rules]]
glob = "*lm_head"
bits = 2
""")
    r = load_recipe(str(f))
    assert r.name == "mine"
    assert r.spec_for(f"{L0}.mlp.switch_mlp.up_proj") == Spec(4, 32)
    assert r.spec_for("language_model.model.layers.1.mlp.switch_mlp.up_proj") == Spec(2, 64)
    assert r.spec_for("language_model.lm_head") is None  # first match: float
    assert r.spec_for(f"{L0}.mlp.gate") == Spec(8, 64)  # from the base recipe
    spec, note = r.resolve(f"{L0}.mlp.switch_mlp.down_proj", 48)
    assert spec is None and "not a multiple" in note


@pytest.mark.parametrize("text,msg", [
    ("[[rules]\nglob='x'", "not valid TOML"),
    ("[[rules]]\nglob='*'\nbits=7", "bits must be one of"),
    ("[[rules]]\nbits=4", "exactly one of glob or regex"),
    ("[[rules]]\nregex='('\nbits=4", "bad regex"),
    ("colour = 3", "unknown key"),
    ("base = 'nope'", "unknown base"),
    ("name = 'empty'", "quantize nothing"),
])
def test_malformed_recipes(text, msg):
    with pytest.raises(PocketError, match=msg):
        parse_recipe(text, "r")


def test_unknown_recipe():
    with pytest.raises(PocketError, match="unknown recipe"):
        load_recipe("uniform-7")


# ---- conversions -------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,layout", [("pocket-2bit", "fused"), ("user", "per_expert")])
def test_converted_model_loads_in_pocket_and_mlx_lm_with_equal_logits(tmp_path, make_ckpt,
                                                                       recipe, layout):
    from mlx_lm.utils import load_model as lm_load

    src = make_ckpt("src", layout=layout, wrapped=layout == "per_expert")
    if recipe == "user":
        recipe = str(tmp_path / "u.toml")
        Path(recipe).write_text('base = "pocket-3bit"\n[[rules]]\nglob = "*lm_head"\n'
                                'float = true\n[[rules]]\nglob = "*.switch_mlp.down_proj"\n'
                                'bits = 4\ngroup_size = 128\n[[rules]]\n'
                                'glob = "*.switch_mlp.up_proj"\nbits = 2\ngroup_size = 128\n')
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--recipe", recipe, "--shard-size-gb",
                 "0.0003"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert cfg["model_type"] == "qwen3_5_moe" and q == cfg["quantization_config"]
    assert q[f"{L0}.mlp.gate"] == {"group_size": 64, "bits": 8}
    info = json.loads((out / "pocket.json").read_text())
    assert info["bits"]["router"] == [8]
    if recipe == "pocket-2bit":
        assert q[f"{L0}.mlp.switch_mlp.up_proj"]["bits"] == 2
        assert info["bits"]["experts"] == [2] and info["bits"]["embed_tokens"] == [6]
    else:
        assert q["language_model.lm_head"] is False
        # down_proj's input (moe_intermediate 64) is not a multiple of 128: float, with a note.
        assert q[f"{L0}.mlp.switch_mlp.down_proj"] is False
        assert any("down_proj" in n for n in info["notes"])
        assert info["bits"]["experts"] == [2, 3, "float"]
        # 2-bit in groups of 128 (a width --target-size hands out) loads in both.
        assert q[f"{L0}.mlp.switch_mlp.up_proj"] == {"group_size": 128, "bits": 2}
        assert info["widths"]["experts"] == ["2-bit g128", "3-bit g64"]
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded
    assert not list(out.glob(".shard-*"))
    for key in ("bits_per_weight", "bytes_per_token", "size_on_disk"):
        assert info["stats"][key] > 0
    ours, theirs = load_model(out), lm_load(out)[0]
    a, b = logits(ours), logits(theirs)
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
    # The same as quantizing the float model in memory with MLX, module by module.
    ref = load_model(src)
    nn.quantize(ref, class_predicate=lambda p, m: hasattr(m, "to_quantized") and q.get(p, False))
    np.testing.assert_allclose(a, logits(ref), atol=1e-5, rtol=1e-5)


def test_float_recipe_keeps_weights_exactly_and_casts_dtype(tmp_path, make_ckpt):
    src = make_ckpt("src")
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--recipe", "float", "--dtype", "float16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg
    m = load_model(out)
    assert m.language_model.lm_head.weight.dtype == mx.float16
    assert m.layers[0].input_layernorm.weight.dtype == mx.float32  # (1 + w) norms stay float32
    ref = load_model(src)
    np.testing.assert_array_equal(
        np.array(m.layers[1].mlp.switch_mlp.up_proj.weight),
        np.array(ref.layers[1].mlp.switch_mlp.up_proj.weight.astype(mx.float16)))


def test_requantizing_a_quantized_source(tmp_path, make_ckpt):
    """A quantized MLX checkpoint converts again (dequantize -> other bits), and loads."""
    src = make_ckpt("src", layout="fused")
    q2 = tmp_path / "q2"
    assert main(["convert", str(src), str(q2), "--recipe", "pocket-2bit"]) == 0
    q4 = tmp_path / "q4"
    assert main(["convert", str(q2), str(q4), "--recipe", "uniform-4"]) == 0
    m = load_model(q4)
    assert m.layers[0].mlp.gate.bits == 4 and m.layers[0].mlp.switch_mlp.up_proj.bits == 4
    assert np.isfinite(logits(m)).all()


# ---- the shard writer --------------------------------------------------------------------------
BUNDLED = ROOT / "assets" / "pocket-tiny"


def _written() -> int | None:
    """Bytes this process has passed to write() so far (Linux), None where unknown."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return None
    return next((int(x.split()[1]) for x in lines if x.startswith("wchar:")), None)


def _check_loads(file: Path, expect: dict[str, mx.array]) -> None:
    """The same tensors through mx.load, the safetensors package and pocket's header reader."""
    from safetensors import safe_open

    n, header = safetensors_header(file)
    assert set(header) - {"__metadata__"} == set(expect)
    loaded = mx.load(str(file))
    with safe_open(str(file), "numpy") as st:
        assert set(st.keys()) == set(expect)
        for k, v in expect.items():
            assert loaded[k].dtype == v.dtype and mx.array_equal(loaded[k], v).item(), k
            if v.dtype != mx.bfloat16:  # numpy has no bfloat16
                np.testing.assert_array_equal(st.get_tensor(k), np.array(v))


@pytest.mark.parametrize("reserve", [64 << 10, 16, None])
def test_save_model_writes_each_byte_once_and_loads_everywhere(tmp_path, monkeypatch, reserve):
    """A shard whose header fits its room is written in place (the header padded with spaces
    into the reserved room); a header that does not fit (reserve 16) takes the copy path. All
    load in mx.load, safetensors, pocket-mlx and mlx-lm with the logits of the model saved.
    None: the room sized by the build (~9 MB here, not the 5 GB shard limit): the reference's
    header (~45 KB) outgrows it, so the shard carries an exact header and no padding."""
    from mlx_lm.utils import load_model as lm_load

    from pocket_mlx.models.fusion import unfused_parameters

    if reserve is not None:
        monkeypatch.setattr(writer, "header_reserve_for", lambda shard_bytes: reserve)
        monkeypatch.setattr(writer, "MAX_PADDING", 64 << 10)
    model = load_model(BUNDLED)
    config = json.loads((BUNDLED / "config.json").read_text())
    out = tmp_path / "out"
    before = _written()
    writer.save_model(model, config, out, src=BUNDLED,
                      quantization=config.get("quantization"))
    after = _written()
    files = sorted(out.iterdir())
    assert [f.name for f in files if f.name.startswith(".")] == []
    shard = out / "model.safetensors"
    n = int.from_bytes(shard.read_bytes()[:8], "little")
    raw = shard.read_bytes()[8:8 + n]
    entries = len(raw.rstrip(b" "))
    if reserve == 64 << 10:
        assert n == reserve - 8 > entries
        if before is not None:  # every byte on disk written once (the copy path: twice)
            on_disk = sum(f.stat().st_size for f in files)
            assert on_disk <= after - before <= on_disk + (64 << 10), (after - before, on_disk)
    else:  # exact, 8-aligned: the file is the tensors and their header, no room to spare
        assert n - entries < 8 and (8 + n) % 8 == 0
        data = sum(v.nbytes for _, v in unfused_parameters(model))
        assert shard.stat().st_size == 8 + n + data
    if reserve is None:
        assert n < 64 << 10  # the bound on a reference build's header room
    _check_loads(shard, dict(unfused_parameters(model)))
    a = logits(model)
    np.testing.assert_array_equal(logits(load_model(out)), a)
    np.testing.assert_allclose(logits(lm_load(out)[0]), a, atol=1e-4 * max(1.0, np.abs(a).max()))


def test_shard_writer_falls_back_per_shard(tmp_path):
    """A shard whose header fits is written in place, the next one (many entries) is copied:
    each still holds its own tensors, named and indexed as mlx-lm names them."""
    big = {"big": mx.arange(64, dtype=mx.float32)}  # 256 bytes: a shard of its own
    small = {f"s{i:02d}": (mx.arange(4) + i).astype(mx.bfloat16 if i % 2 else mx.int32)
             for i in range(20)}
    w = writer.ShardWriter(tmp_path, shard_bytes=256, header_reserve=256)
    for k, v in {**big, **small}.items():
        w.add(k, v)
    wmap = w.close()
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert wmap == {"big": one, **dict.fromkeys(small, two)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [one, two,
                                                          "model.safetensors.index.json"]
    assert int.from_bytes((tmp_path / one).read_bytes()[:8], "little") == 256 - 8  # in place
    assert (tmp_path / one).stat().st_size == 256 + 256
    n = int.from_bytes((tmp_path / two).read_bytes()[:8], "little")
    assert n > 256 - 8 and (tmp_path / two).stat().st_size == 8 + n + 20 * 4 * 4 - 10 * 4 * 2
    _check_loads(tmp_path / one, big)
    _check_loads(tmp_path / two, small)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 256 + 10 * 16 + 10 * 8
    with pytest.raises(ValueError, match="multiple of 8"):
        writer.ShardWriter(tmp_path, header_reserve=100)
    # Less data than padding: copied too, so a small shard carries no padding.
    (tmp_path / "s").mkdir()
    w = writer.ShardWriter(tmp_path / "s", header_reserve=4096)
    w.add("x", mx.ones((8,)))
    w.close()
    n = int.from_bytes((tmp_path / "s" / "model.safetensors").read_bytes()[:8], "little")
    assert n < 200 and (tmp_path / "s" / "model.safetensors").stat().st_size == 8 + n + 32
    _check_loads(tmp_path / "s" / "model.safetensors", {"x": mx.ones((8,))})


@pytest.mark.parametrize("shard_gb", [None, 0.003])
def test_reference_build_has_at_most_64_kib_of_header_room_per_shard(tmp_path, shard_gb):
    """Issue 29: a build of the reference (the bundled bf16 model, converted as the bundled
    build's recipe) spends no more than 64 KiB per shard on header room: the 8-byte length,
    the JSON and its padding. In one shard (the default limit) and in several (4 of ~3 MB)."""
    out = tmp_path / "out"
    extra = ["--shard-size-gb", str(shard_gb)] if shard_gb else []
    assert main(["convert", str(ROOT / "assets" / "pocket-tiny-bf16"), str(out),
                 "--recipe", "pocket-3bit", *extra]) == 0
    shards = sorted(out.glob("*.safetensors"))
    assert (len(shards) == 1) == (shard_gb is None), shards
    for shard in shards:
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n)
        header = json.loads(raw)
        data = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        assert shard.stat().st_size == 8 + n + data and (8 + n) % 8 == 0
        assert 8 + n <= 64 << 10, (shard.name, 8 + n)  # length + JSON + padding
        assert n - len(raw.rstrip(b" ")) <= max(4096, data // writer.PAD_RATIO)


# ---- bad inputs: real subprocesses, one line, exit 2 -------------------------------------------
def test_bad_inputs_are_one_line_errors(tmp_path, make_ckpt):
    src = str(make_ckpt("src"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rules]\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    exists = tmp_path / "exists"
    exists.mkdir()
    cases = {
        "unknown recipe": ["--recipe", "mystery"],
        "not valid TOML": ["--recipe", str(bad)],
        "must be below": ["--prune-to", "8", "--calib", str(empty)],
        "below num_experts_per_tok": ["--prune-to", "1", "--calib", str(empty)],
        "is empty": ["--prune-to", "4", "--calib", str(empty)],
        "does not exist": ["--prune-to", "4", "--calib", str(tmp_path / "nope.txt")],
        "needs calibration": ["--prune-to", "4"],
        "needs --target-bpw": ["--recipe", "auto"],
        "--recipe auto needs calibration": ["--recipe", "auto", "--target-bpw", "4"],
    }
    procs = {}
    for i, (msg, extra) in enumerate(cases.items()):
        procs[msg] = subprocess.Popen(
            [sys.executable, "-m", "pocket_mlx", "convert", src, str(tmp_path / f"o{i}"), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    procs["already exists"] = subprocess.Popen(
        [sys.executable, "-m", "pocket_mlx", "convert", src, str(exists)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for msg, p in procs.items():
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2, (msg, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pocket-mlx convert: error:"), err
        assert msg in lines[0], (msg, err)
    assert not any(tmp_path.glob("o*")) and not any(exists.iterdir())


def _big_ckpt(tmp_path: Path) -> Path:
    """Large enough (~200 MB float32) that writing takes a moment to interrupt."""
    cfg = tiny_config(hidden_size=512, moe_intermediate_size=512, num_experts=16)
    rng = np.random.default_rng(0)
    from conftest import hf_weights

    w = hf_weights(tiny_config(hidden_size=512, moe_intermediate_size=64, num_experts=16), 0,
                   "fused")
    for k in list(w):
        if k.endswith("experts.gate_up_proj"):
            w[k] = rng.standard_normal((16, 1024, 512), np.float32) * 0.04
        elif k.endswith("experts.down_proj"):
            w[k] = rng.standard_normal((16, 512, 512), np.float32) * 0.04
    return write_checkpoint(tmp_path / "big", cfg, w)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_conversion_leaves_no_out(tmp_path, sig):
    src = _big_ckpt(tmp_path)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "pocket_mlx", "convert", str(src), str(out),
                          "--recipe", "uniform-4", "--shard-size-gb", "0.01"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    deadline = time.time() + 60
    caught = False
    while time.time() < deadline and p.poll() is None:
        if any(tmp_path.glob(".out.tmp-*/.shard-*")):
            os.kill(p.pid, sig)
            caught = True
            break
        time.sleep(0.005)
    p.communicate(timeout=60)
    assert caught, "the conversion finished before it could be interrupted"
    assert not out.exists()
    if sig == signal.SIGTERM:
        assert p.returncode == 128 + signal.SIGTERM
        assert not list(tmp_path.glob(".out.tmp-*"))  # cleaned up on the way out


def test_auto_recipe_meets_its_budget(tmp_path, make_ckpt):
    src = make_ckpt("src", vocab_size=8192)
    out = tmp_path / "auto"
    calib = str(ROOT / "assets" / "text" / "en.calib.txt")
    assert main(["convert", str(src), str(out), "--recipe", "auto", "--target-bpw", "4",
                 "--calib", calib, "--calib-tokens", "64"]) == 0
    info = json.loads((out / "pocket.json").read_text())
    groups = info["auto"]["groups"]
    assert {g["bits"] for g in groups.values()} <= {2, 3, 4, 6}
    assert info["bits"]["router"] == [8]
    assert 3.0 < info["stats"]["bits_per_weight"] <= 4.05  # budget (norms add a little)
    assert np.isfinite(logits(load_model(out))).all()
