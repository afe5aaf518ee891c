"""pocket-mlx bench: formatting, the bytes-per-token accounting, the synthetic builder, the CLI.

Nothing here is timed: throughput numbers are only checked to be positive.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

from pocket_mlx.analysis import bench
from pocket_mlx.convert import synthetic
from pocket_mlx.models.accounting import weight_stats

ROOT = Path(__file__).resolve().parent.parent


def _row(test: str, **over) -> bench.Row:
    base = dict(model="tiny", size_bytes=3 << 20, params_total=4_112_248,
                params_active=2_932_600, recipe="pocket-2bit", dtype="float32", device="cpu",
                threads=1, kernels="mlx", test=test, tps_mean=100.0, tps_sd=2.5,
                bytes_per_token=1_000_000, gbps=None, roofline_fraction=None, runs=[100.0])
    base.update(over)
    return bench.Row(**base)


ROWS = [
    _row("pp512", mlx_lm_tps_mean=50.0, mlx_lm_tps_sd=1.0, ratio_vs_mlx_lm=2.0),
    _row("tg128", tps_mean=20.0, tps_sd=0.5, gbps=0.02, roofline_fraction=0.001,
         mlx_lm_tps_mean=10.0, mlx_lm_tps_sd=0.1, ratio_vs_mlx_lm=2.0),
]


def test_markdown_table():
    text = bench.format_markdown(ROWS)
    lines = text.splitlines()
    assert lines[0].startswith("| model | size | params (total / active) | recipe |")
    assert "mlx-lm t/s" in lines[0] and "vs mlx-lm" in lines[0]
    assert len(lines) == 4 and all(l.count("|") == lines[0].count("|") for l in lines)
    assert "| pp512 | 100.00 ± 2.50 |" in lines[2]
    assert "| tiny | 3.00 MiB | 4.11M / 2.93M | pocket-2bit | float32 | cpu |" in lines[2]
    # pp rows have no bandwidth figures; tg rows do.
    assert "| 0.02 | 0.1% | 10.00 ± 0.10 | 2.00x |" in lines[3]
    plain = bench.format_markdown([_row("tg8")])
    assert "mlx-lm" not in plain


def test_json_and_csv():
    machine = {"cpu": "x", "cores": 2, "ram_bytes": 1, "os": "Linux", "mlx": "0.32.4",
               "mlx_lm": "0.32.2", "bandwidth_gbps": 12.5}
    data = json.loads(bench.to_json(ROWS, machine))
    assert data["machine"]["bandwidth_gbps"] == 12.5
    for key in ("model", "device", "threads", "test", "tps_mean", "tps_sd", "bytes_per_token",
                "gbps", "roofline_fraction", "mlx_lm_tps_mean", "ratio_vs_mlx_lm"):
        assert key in data["rows"][0]
    assert data["rows"][1]["roofline_fraction"] == 0.001
    rows = list(csv.DictReader(io.StringIO(bench.to_csv(ROWS))))
    assert [r["test"] for r in rows] == ["pp512", "tg128"]
    assert rows[0]["gbps"] == "" and float(rows[1]["gbps"]) == 0.02
    assert float(rows[1]["ratio_vs_mlx_lm"]) == 2.0


def test_make_rows_roofline():
    meta = dict(model="m", size_bytes=1, params_total=1, params_active=1, recipe="r",
                dtype="float32", device="cpu", threads=1, kernels="mlx",
                bytes_per_token=2_000_000_000)
    results = {"pp4": {"pocket-mlx": [10.0, 12.0], "mlx-lm": [5.0, 5.0]},
               "tg4": {"pocket-mlx": [1.0, 3.0], "mlx-lm": [1.0, 1.0]}}
    pp, tg = bench.make_rows(results, meta, bandwidth_gbps=8.0)
    assert pp.tps_mean == 11.0 and pp.gbps is None and pp.ratio_vs_mlx_lm == 2.2
    assert tg.tps_mean == 2.0 and tg.gbps == 4.0 and tg.roofline_fraction == 0.5
    assert tg.tps_sd == pytest.approx(1.4142, abs=1e-3)


def test_roofline_uses_bandwidth_probed_around_each_run():
    """run_tests probes before and after each of our tg runs (not mlx-lm's, not pp); make_rows
    then divides each run's GB/s by its own bandwidth instead of the start-of-bench figure."""
    probes = iter([10.0, 30.0, 4.0, 4.0])  # run 1: mean 20 GB/s; run 2: 4 GB/s
    calls = []

    def runner(name, tps):
        def tg(ids, n, cache=None):
            calls.append(name)
            return tps.pop(0)
        return bench.Runner(name, pp=lambda ids, cache=None: 1.0, tg=tg)

    ours = runner("pocket-mlx", [0.0, 2.0, 1.0])  # warm-up, run 1, run 2
    theirs = runner("mlx-lm", [0.0, 1.0, 1.0])
    results = bench.run_tests([ours, theirs], vocab=100, p=0, n=4, repeats=2,
                              probe=lambda: next(probes))
    assert results["tg4"][bench.BANDWIDTH_KEY] == [20.0, 4.0]
    meta = dict(model="m", size_bytes=1, params_total=1, params_active=1, recipe="r",
                dtype="float32", device="cpu", threads=1, kernels="mlx",
                bytes_per_token=2_000_000_000)
    (tg,) = bench.make_rows(results, meta, bandwidth_gbps=100.0)
    # run 1: 4 GB/s of 20 = 0.2; run 2: 2 GB/s of 4 = 0.5
    assert tg.roofline_fraction == pytest.approx(0.35)
    assert tg.bandwidth_runs == [20.0, 4.0] and tg.ratio_vs_mlx_lm == 1.5


def _qbytes(out_dim: int, in_dim: int, bits: int, gs: int = 64, scale_bytes: int = 2) -> int:
    """Packed weight + scales + biases of one quantized [out, in] matrix, by hand."""
    return out_dim * in_dim * bits // 8 + 2 * out_dim * (in_dim // gs) * scale_bytes


def test_bytes_per_token_by_hand(tiny_ckpt):
    """pocket-2bit tiny: experts 2-bit, router/shared gate 8, rest 4, embed/lm_head 6, bf16."""
    from pocket_mlx.engine.loader import load

    model, _ = load(tiny_ckpt, dtype="bfloat16")  # as stored (the CPU policy is float32)
    H, V, E, k, I, S = 128, 8192, 16, 4, 64, 64
    kh, vh, kd, vd, conv_k = 2, 4, 32, 32, 4
    nh, nkv, hd = 4, 2, 64
    bf16 = 2
    conv_dim = 2 * kh * kd + vh * vd
    linear = (_qbytes(conv_dim, H, 4) + _qbytes(vh * vd, H, 4) + 2 * _qbytes(vh, H, 4)
              + _qbytes(H, vh * vd, 4)
              + conv_dim * conv_k * bf16 + 2 * vh * bf16 + vd * bf16)  # conv, dt/A_log, norm
    full = (_qbytes(2 * nh * hd, H, 4) + 2 * _qbytes(nkv * hd, H, 4) + _qbytes(H, nh * hd, 4)
            + 2 * hd * bf16)  # q_norm, k_norm
    experts_all = E * (2 * _qbytes(I, H, 2) + _qbytes(H, I, 2))
    moe_dense = (_qbytes(E, H, 8) + _qbytes(1, H, 8)  # router, shared-expert gate
                 + 2 * _qbytes(S, H, 4) + _qbytes(H, S, 4))  # shared expert
    per_layer_norms = 2 * H * bf16
    embed_table = _qbytes(V, H, 6)
    lm_head = _qbytes(V, H, 6)
    dense = 3 * linear + full + 4 * (moe_dense + per_layer_norms) + H * bf16 + lm_head
    per_token = dense + 4 * experts_all * k // E + embed_table // V
    total = dense + 4 * experts_all + embed_table
    stats = weight_stats(model)
    assert stats.bytes_per_token == per_token
    assert stats.bytes_total == total
    assert stats.experts_per_layer == E and stats.top_k == k


def test_synthetic_checkpoint_loads_everywhere(tiny_ckpt, exact_kernels):
    from mlx_lm.utils import load_model as mlx_lm_load

    from pocket_mlx.engine.loader import load

    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    q = cfg["quantization"]
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["quantization_config"] == q
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
    p = "language_model.model.layers.0.mlp"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert q[f"{p}.switch_mlp.{proj}"] == {"group_size": 64, "bits": 2}
    assert q[f"{p}.gate"]["bits"] == 8 and q[f"{p}.shared_expert_gate"]["bits"] == 8
    assert q["language_model.model.embed_tokens"]["bits"] == 6
    assert q["language_model.lm_head"]["bits"] == 6
    assert f"{p}.shared_expert.up_proj" not in q  # the default 4 bits

    ours, tok = load(tiny_ckpt, dtype="bfloat16")  # as stored, as mlx-lm loads it
    theirs, _ = mlx_lm_load(tiny_ckpt)
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert set(a) == set(b)
    assert all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a)
    w = a[f"{p}.switch_mlp.gate_proj.weight"]
    assert w.shape == (16, 64, 128 * 2 // 32) and w.dtype == mx.uint32
    assert a[f"{p}.switch_mlp.gate_proj.scales"].shape == (16, 64, 2)
    # Same weights, same logits (in float32: bf16 rounding differs between MLX's kernels and
    # ours, and a flipped top-k routing choice then amplifies it); finite, not degenerate.
    ours, _ = load(tiny_ckpt, dtype="float32")
    theirs.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating)
                           else v, theirs.parameters()))
    x = mx.array([[1, 2, 3, 4, 5]])
    lo, lt = ours(x), theirs(x)
    assert mx.allclose(lo, lt, atol=1e-3).item()
    assert mx.all(mx.isfinite(lo)).item() and lo.astype(mx.float32).std().item() > 1e-3
    # Reused, not rebuilt.
    stamp = (tiny_ckpt / "model.safetensors").stat().st_mtime_ns
    synthetic.build("tiny", "pocket-2bit", out=tiny_ckpt, progress=False)
    assert (tiny_ckpt / "model.safetensors").stat().st_mtime_ns == stamp


def test_recipes_and_names():
    model = synthetic.build_model(synthetic.config_for("tiny"))
    q = synthetic.quantization_for(model, "uniform-4")
    assert q == {"group_size": 64, "bits": 4, "mode": "affine"}
    with pytest.raises(Exception, match="unknown recipe"):
        synthetic.quantization_for(model, "nope")
    with pytest.raises(Exception, match="unknown synthetic model"):
        synthetic.config_for("pocket-1t")
    big = synthetic.config_for("pocket-35b-e128")
    assert big["num_experts"] == 128 and big["vocab_size"] == 248320
    assert big["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]


def test_bandwidth_probe_positive():
    assert bench.probe_bandwidth("cpu", threads=1, quick=True) > 0.1


def test_cli_bench_json(tmp_path):
    env = {**os.environ, "POCKET_MLX_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pocket_mlx", "bench", "--synthetic", "tiny", "-p", "16",
         "-n", "8", "-r", "1", "-o", "json"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["machine"]["mlx"] and data["machine"]["bandwidth_gbps"] > 0
    assert [r["test"] for r in data["rows"]] == ["pp16", "tg8"]
    pp, tg = data["rows"]
    assert pp["tps_mean"] > 0 and tg["tps_mean"] > 0
    assert tg["gbps"] > 0 and 0 < tg["roofline_fraction"]
    assert pp["kernels"] and pp["model"] == "tiny" and pp["recipe"] == "pocket-2bit"
    assert (tmp_path / "synthetic" / "tiny-pocket-2bit" / "config.json").is_file()


def test_cli_bench_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pocket_mlx", "bench", "--synthetic", "nope"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "POCKET_MLX_CACHE": str(tmp_path)})
    assert proc.returncode == 2 and "unknown synthetic model" in proc.stderr
