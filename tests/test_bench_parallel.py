"""`pocket-mlx bench --parallel`: rows per B, and a bytes bound that follows the run's routing.

Nothing here is timed: throughput numbers are only checked to be positive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from pocket_mlx.analysis import parallel
from pocket_mlx.engine.loader import load

ROOT = Path(__file__).resolve().parent.parent


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "bench", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "POCKET_MLX_CACHE": str(tmp_path)})


def test_cli_parallel_rows(tmp_path):
    proc = _bench(tmp_path, "--synthetic", "tiny", "-p", "0", "-n", "4", "-r", "1",
                  "--parallel", "1,3", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["test"], r["parallel"]) for r in rows] == [("tg4", 1), ("tg4", 3)]
    one, three = rows
    assert one["tps_mean"] > 0 and three["tps_mean"] > 0
    # tiny: 16 experts, top-4. One token reads exactly its 4; three read 4..12 distinct ones.
    assert one["distinct_experts_per_layer"] == 4.0 and one["bytes_bound_x"] == 1.0
    assert 4.0 <= three["distinct_experts_per_layer"] <= 12.0
    assert 1.0 < three["bytes_bound_x"] < 3.0
    # The bound is B x the one-sequence step's bytes over the B-step's (the sequences' state
    # differs a little: the first ones decode while the later ones prefill).
    ratio = 3 * one["step_bytes"] / three["step_bytes"]
    assert three["bytes_bound_x"] == pytest.approx(ratio, rel=0.02)
    assert three["bytes_per_token"] == pytest.approx(three["step_bytes"] / 3, abs=1)
    assert three["speedup_x"] == pytest.approx(three["tps_mean"] / one["tps_mean"])
    assert three["vs_bound"] == pytest.approx(three["speedup_x"] / three["bytes_bound_x"])


@pytest.mark.parametrize("value", ["0", "a", "1,1", "", "2,-1", "4,"])
def test_cli_parallel_bad_values(tmp_path, value):
    proc = _bench(tmp_path, "--synthetic", "tiny", "--parallel", value)
    assert proc.returncode == 2
    assert "--parallel" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_parallel_refuses_other_modes(tmp_path):
    proc = _bench(tmp_path, "--synthetic", "tiny", "--parallel", "2", "--vs-mlx-lm")
    assert proc.returncode == 2 and "--vs-mlx-lm" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bound_follows_the_routing(tiny_ckpt, monkeypatch):
    """With the routers zeroed every token picks the same experts: the B-step reads top-k
    experts per layer, as one token does, and the bound rises. A bound that did not come from
    the run's routing (say, B x top-k assumed distinct) would not move. (The MLX layout: the
    test replaces router weights, which packed matrices refuse.)"""
    monkeypatch.setenv("POCKET_MLX_PANELS", "0")
    model, _ = load(tiny_ckpt, device="cpu")
    split = parallel.weight_split(model)
    vocab, b, k = model.args.vocab_size, 3, model.args.num_experts_per_tok
    with mx.stream(mx.cpu):
        routed = parallel.run_parallel(model, "cpu", vocab, b, 2, 7, route_steps=3)
        assert len(routed.distinct) == len(model.layers)
        assert all(k <= d <= b * k for d in routed.distinct)
        assert max(routed.distinct) > k  # three random sequences do not agree everywhere
        for layer in model.layers:
            gate = layer.mlp.gate
            gate.scales, gate.biases = mx.zeros_like(gate.scales), mx.zeros_like(gate.biases)
        same = parallel.run_parallel(model, "cpu", vocab, b, 2, 7, route_steps=3)
    assert same.distinct == [float(k)] * len(model.layers)
    assert routed.state > 0 and same.state == pytest.approx(routed.state)
    assert (parallel.bound_x(split, same.distinct, b, same.state)
            > parallel.bound_x(split, routed.distinct, b, routed.state) > 1.0)
