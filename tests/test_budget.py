"""`convert --recipe auto --target-size`: sizes, the budget kept, 1-bit builds in pocket and mlx-lm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import ROOT

from pocket_mlx.cli.main import main
from pocket_mlx.config import module_quantization, read_config, weights_bytes
from pocket_mlx.convert.budget import (
    BUDGET_SPECS,
    Sizer,
    _allocate,
    _Editor,
    options,
    spec_bytes,
)
from pocket_mlx.convert.pipeline import ConvertOptions, inputs_for, quantizer_for
from pocket_mlx.convert.recipes import Spec, load_recipe
from pocket_mlx.engine.loader import load_model
from pocket_mlx.kernels import ops
from pocket_mlx.units import parse_size

CALIB = [str(ROOT / "assets" / "text" / f"{d}.calib.txt") for d in ("en", "code")]
PROMPT = mx.array([[5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 1, 2]])

pytestmark = pytest.mark.usefixtures("exact_kernels")


def logits(model) -> np.ndarray:
    return np.array(model(PROMPT).astype(mx.float32))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("800MB") == 800 * 10**6
    assert parse_size("5GiB") == 5 << 30 and parse_size("1.5 kb") == 1500
    assert parse_size("8400000") == 8400000 and parse_size("2MiB") == 2 << 20
    for bad in ("0", "-5MB", "abc", "5XB", "", "MB"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("spec", BUDGET_SPECS, ids=Spec.label)
def test_spec_bytes_match_mlx_quantize(spec):
    w = mx.zeros((3, 16, 256), mx.bfloat16)
    q, s, b = mx.quantize(w, spec.group_size, spec.bits)
    assert spec_bytes(w.shape, spec, 2) == q.nbytes + s.nbytes + b.nbytes
    assert spec_bytes(w.shape, None, 2) == w.nbytes


def test_allocation_uses_groups_of_128_between_the_bit_widths():
    """At ~2.3 bits per weight, 2-bit in groups of 128 (2.25) fits where 2-bit g64 (2.5) does
    not, and beats 1-bit; a module whose input dim (192) is no multiple of 128 gets only the
    g64 widths."""
    shapes = {"a.w": (64, 256), "b.w": (64, 256), "c.w": (64, 192)}
    sizer = Sizer(shapes, {p: 2 for p in shapes}, other=0, num_experts=1)
    assert options(sizer, "c.w") == [s for s in BUDGET_SPECS if s.group_size == 64]
    units = ["a.w", "b.w"]
    # KL halves with every bit; g128 a little worse than g64 at the same bits.
    kl = {(u, s): 2.0 ** -s.bits * (1.1 if s.group_size == 128 else 1.0)
          for u in units for s in BUDGET_SPECS}
    target = int(2.3 * 64 * 512 / 8)
    specs, spent = _allocate(units, {u: 1.0 for u in units}, {u: u for u in units}, kl, sizer,
                             1, {}, target)
    assert spent == sum(sizer.module(u, s, 1) for u, s in specs.items()) <= target
    assert specs == {"a.w": Spec(2, 128), "b.w": Spec(2, 128)}
    # With room for g64 in one of them, the search takes it.
    specs, _ = _allocate(units, {u: 1.0 for u in units}, {u: u for u in units}, kl, sizer, 1,
                         {}, int(2.4 * 64 * 512 / 8))
    assert sorted(s.group_size for s in specs.values()) == [64, 128]


def test_one_bit_recipe_loads_in_pocket_and_mlx_lm(tmp_path, make_ckpt):
    """1-bit experts run through stock MLX (our kernels fall back for widths they lack) and
    load unchanged in mlx-lm."""
    from mlx_lm.utils import load_model as lm_load

    src = make_ckpt("src", layout="fused")
    out = tmp_path / "one"
    assert main(["convert", str(src), str(out), "--recipe", "pocket-1bit"]) == 0
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["language_model.model.layers.0.mlp.switch_mlp.up_proj"]["bits"] == 1
    ours, theirs = load_model(out), lm_load(out)[0]
    a, b = logits(ours), logits(theirs)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))
    ref = load_model(src)
    nn.quantize(ref, class_predicate=lambda p, m: hasattr(m, "to_quantized") and q.get(p, False))
    np.testing.assert_allclose(a, logits(ref), atol=1e-5, rtol=1e-5)
    # Decode-sized inputs go through the fused MoE path when the extension has it: with 1-bit
    # experts it must hand over to MLX and give the same numbers.
    one = PROMPT[:, :1]
    np.testing.assert_allclose(np.array(ours(one)), np.array(ref(one)), atol=1e-5, rtol=1e-5)
    # Our dispatch on 1-bit weights: the extension when it takes the width (EXACT mode here),
    # else MLX; the same numbers either way.
    w = mx.random.normal((64, 128), key=mx.random.key(1))
    qw, qs, qb = mx.quantize(w, 64, 1)
    x = mx.random.normal((3, 128), key=mx.random.key(2))
    for got in (ops.quantized_matmul(x, qw, qs, qb, group_size=64, bits=1),
                ops.gather_qmm(x[:, None, None], qw[None], qs[None], qb[None],
                               mx.zeros((3, 1), mx.uint32), group_size=64, bits=1)[:, 0, 0]):
        np.testing.assert_allclose(
            np.array(got), np.array(mx.quantized_matmul(x, qw, qs, qb, group_size=64, bits=1)),
            rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fraction", [0.4, 0.15])
def test_target_size_meets_the_budget_exactly(tmp_path, make_ckpt, fraction):
    src = make_ckpt("src", vocab_size=8192)
    full = weights_bytes(src) // 2  # float32 source, written as bfloat16
    target = int(full * fraction)
    out = tmp_path / "b"
    assert main(["convert", str(src), str(out), "--recipe", "auto", "--target-size",
                 str(target), "--calib", CALIB[0], "--calib", CALIB[1],
                 "--calib-tokens", "96", "--dtype", "bfloat16",
                 # one build with each rounding: rtn is the fast one
                 "--rounding", "rtn" if fraction == 0.4 else "gptq"]) == 0
    got = weights_bytes(out)
    info = json.loads((out / "pocket.json").read_text())
    assert info["rounding"] == ("rtn" if fraction == 0.4 else {"method": "gptq", "max_bits": 3})
    assert got == info["auto"]["bytes"]  # the search's accounting is the written size
    assert 0.98 * target <= got <= target, (got, target)
    assert info["bits"]["router"] == [8]
    used = {b for v in info["bits"].values() for b in v}
    assert used <= {1, 2, 3, 4, 6, 8}
    cands = info["auto"]["candidates"]
    assert cands and all(c["bytes"] <= target for c in cands)
    # Two calibration files: each pruned size is tried with reap-sum and reap-max experts, and
    # the build whose worst file fares best against its KL in the least pruned build wins.
    assert {c["criterion"] for c in cands if c["experts"] < 8} == {"reap-sum", "reap-max"}
    assert all(c["kl_worst_source"] >= c["kl_measured"] - 1e-5 for c in cands)
    ref = max(cands, key=lambda c: (c["experts"], c["criterion"] == cands[0]["criterion"]))
    assert ref["kl_worst_relative"] == 1.0
    for c in cands:
        assert len(c["kl_by_source"]) == 2 and max(c["kl_by_source"]) == c["kl_worst_source"]
        rel = max(a / b for a, b in zip(c["kl_by_source"], ref["kl_by_source"]))
        assert c["kl_worst_relative"] == pytest.approx(rel, abs=1e-5)
    best = min(cands, key=lambda c: (c["kl_worst_relative"], c["kl_measured"]))
    assert (info["auto"]["experts"], info["auto"]["criterion"]) == (best["experts"],
                                                                    best["criterion"])
    if info["auto"]["experts"] < 8:
        assert info["num_experts"] == info["auto"]["experts"] and info["kept_experts"]
        assert info["criterion"] == info["auto"]["criterion"]
    if fraction == 0.15:  # 2.4 bits per weight: 1-bit parts or pruning needed
        assert 1 in used or info["num_experts"] < 8
        search_rounds_as_written(src, out, info)
    assert np.isfinite(logits(load_model(out))).all()


def test_a_model_past_the_whole_search_limit_is_searched_layer_by_layer(tmp_path, make_ckpt,
                                                                        monkeypatch, capsys):
    """Past SEARCH_WHOLE_MAX (the 35B's float32 weights: 139 GB) the search reads the model a
    layer at a time (budget_stream): it measures rounding to nearest, says so in one line, the
    build meets the budget, and the writing still rounds with GPTQ (streamed)."""
    from pocket_mlx.convert import pipeline

    monkeypatch.setenv("POCKET_MLX_SEARCH_WHOLE_MAX", "0")
    monkeypatch.setattr(pipeline, "inputs_for", None)  # never called
    monkeypatch.setattr(pipeline, "budget_recipe", None)  # the in-memory search: not called
    src = make_ckpt("src", vocab_size=8192)
    out = tmp_path / "b"
    target = int(weights_bytes(src) // 2 * 0.3)
    assert main(["convert", str(src), str(out), "--recipe", "auto", "--target-size",
                 str(target), "--calib", CALIB[0], "--calib", CALIB[1], "--calib-tokens", "96",
                 "--dtype", "bfloat16"]) == 0
    info = json.loads((out / "pocket.json").read_text())
    assert info["rounding"] == {"method": "gptq", "max_bits": 3}
    assert info["auto"]["search_rounding"] == "rtn"
    note = capsys.readouterr().out
    assert "reads the model one layer at a time" in note
    assert "are past 0.0 GB" in note  # the limit in force (the override), not the default
    got = weights_bytes(out)
    assert got == info["auto"]["bytes"] and 0.98 * target <= got <= target
    assert {c["criterion"] for c in info["auto"]["candidates"] if c["experts"] < 8} == \
        {"reap-sum", "reap-max"}
    assert np.isfinite(logits(load_model(out))).all()


def search_rounds_as_written(src, out, info):
    """The search's in-memory build of the chosen candidate (float32 model, GPTQ from the
    same captured inputs) holds exactly the written tensors: it rounds from the weights in the
    output dtype (bfloat16 here, from a float32 source), so it judges the build it writes."""
    config = read_config(out)
    model = load_model(src, dtype="float32")
    paths = [p for p, m in model.named_modules() if hasattr(m, "to_quantized")]
    specs = {p: Spec(*module_quantization(config["quantization"], p)) for p in paths}
    inputs = inputs_for(src, read_config(src), ConvertOptions(
        recipe=None, calib=[Path(c) for c in CALIB], calib_tokens=96))
    edit = _Editor(model, quantizer_for("gptq", inputs), {p: mx.bfloat16 for p in paths})
    if info["pruning"]:
        edit.prune([info["kept_experts"][str(i)] for i in range(len(info["kept_experts"]))])
    edit.quantize(specs)
    mine, written = dict(model.named_modules()), dict(load_model(out).named_modules())
    assert any(s.bits <= 3 for s in specs.values())  # some modules went through GPTQ
    for p in paths:
        for name in ("weight", "scales", "biases"):
            a, b = getattr(mine[p], name), getattr(written[p], name)
            assert a.dtype == b.dtype and mx.array_equal(a, b).item(), (p, name)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "convert", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=180)


def test_bad_target_sizes_are_one_line_errors(tmp_path, make_ckpt):
    src = str(make_ckpt("src", vocab_size=8192))
    out = str(tmp_path / "o")
    base = ("--recipe", "auto", "--calib", CALIB[0], "--calib-tokens", "64")
    for extra, msg in (
        (("--target-size", "0"), "must be positive"),
        (("--target-size=-3MB",), "is not a size"),
        (("--target-size", "lots"), "is not a size"),
        (("--target-size", "10KB"), "below the smallest build"),
        (("--target-size", "1GB"), "above the largest build"),
        (("--target-size", "1MB", "--target-bpw", "3"), "not both"),
        (("--target-size", "1MB", "--prune-to", "4"), "leave out --prune-to"),
    ):
        p = cli(src, out, *base, *extra)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert msg in p.stderr, p.stderr
    p = cli(src, out, "--target-size", "1MB")
    assert p.returncode == 2 and "goes with --recipe auto" in p.stderr
    quantized = tmp_path / "q"
    assert main(["convert", src, str(quantized), "--recipe", "uniform-4"]) == 0
    p = cli(str(quantized), out, *base, "--target-size", "1MB")
    assert p.returncode == 2 and "needs a float source" in p.stderr
    assert load_recipe("uniform-1").default == Spec(1)


def test_streamed_search_log_probabilities_and_kl_block_by_block(make_ckpt, monkeypatch):
    """The layer-by-layer search's log-probabilities and KL, made ROWS tokens at a time (no
    whole-window logits: the 35B's are 250 MB a 512-token window), equal a whole-window
    computation, for windows that are not a multiple of ROWS."""
    from pocket_mlx.convert import budget_stream

    monkeypatch.setattr(budget_stream, "ROWS", 5)
    lm = load_model(make_ckpt("src", vocab_size=8192), dtype="float32").language_model
    h = mx.random.normal((1, 12, lm.args.hidden_size), key=mx.random.key(1))
    h2 = h + 0.05 * mx.random.normal(h.shape, key=mx.random.key(2))

    def whole(x):
        lg = np.array(lm.lm_head(lm.model.norm(x)).astype(mx.float32))[0].astype(np.float64)
        return lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - lg.max(-1, keepdims=True)

    p, q = whole(h), whole(h2)
    got = budget_stream.logp(lm, h)
    assert got.shape == p.shape and np.allclose(got, p, atol=2e-5)
    kl = float((np.exp(p) * (p - q)).sum())
    assert kl > 0
    assert budget_stream.Base(got).kl_sum(lm, h2) == pytest.approx(kl, rel=1e-4)
