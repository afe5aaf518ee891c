"""`pocket-mlx bench -d` (llama-bench's --n-depth): pp and tg after N tokens in the cache.

Why: agents work at 10-30k tokens of context, where every decode step also reads the
attention's cache; a benchmark at depth 0 alone says nothing of that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

from pocket_mlx.analysis import bench
from pocket_mlx.engine.loader import load


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "bench", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_depth_rows_in_json():
    proc = cli("-p", "16", "-n", "4", "-r", "1", "-d", "0,64", "-q", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["test"], r["depth"]) for r in rows] == [
        ("pp16", 0), ("tg4", 0), ("pp16 @ d64", 64), ("tg4 @ d64", 64)]
    assert all(r["tps_mean"] > 0 for r in rows)


def test_primed_cache_holds_the_depth():
    """The timed tokens go after exactly `depth` tokens already in the cache."""
    model, _ = load(ROOT / "assets" / "pocket-tiny", device="cpu", fuse=True)
    runner = bench.pocket_runner(model, "cpu")
    assert runner.prime([]) is None
    cache = runner.prime(bench.random_ids(model.args.vocab_size, 40, 1))
    offsets = {c.offset for c in cache if hasattr(c, "offset")}
    assert offsets == {40}
    assert runner.pp(bench.random_ids(model.args.vocab_size, 16, 2), cache) > 0
    assert {c.offset for c in cache if hasattr(c, "offset")} == {56}


def test_bad_depths_are_one_line_errors():
    for args, said in ((["-d", "x"], "token counts >= 0"), (["-d", "-5"], "token counts"),
                       (["-d", "4000"], "needs 4512 tokens of context"),
                       (["-d", "64", "--parallel", "1,2"], "--parallel does not run with -d")):
        proc = cli(*args, "-q")
        assert proc.returncode == 2, (args, proc.stderr)
        assert said in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 3  # argparse adds its usage line


def test_tg_rows_at_depth_count_the_kv_bytes_in_the_cache_type():
    """A tg row at depth reads the weights and the KV cache's positions: --cache-type-k/-v f16
    (llama.cpp's flags) halves the latter and is named in the row's dtype."""
    rows = {}
    for kind in ("f32", "f16"):
        proc = cli("-p", "0", "-n", "4", "-r", "1", "-d", "64", "--cache-type-k", kind,
                   "--cache-type-v", kind, "-q", "-o", "json")
        assert proc.returncode == 0, proc.stderr
        rows[kind] = json.loads(proc.stdout)["rows"][-1]
    f32, f16 = rows["f32"], rows["f16"]
    assert f32["depth"] == f16["depth"] == 64 and f32["kv_bytes_per_token"] > 0
    assert f16["kv_bytes_per_token"] * 2 == f32["kv_bytes_per_token"]
    assert "KV f16" in f16["dtype"] and "KV" not in f32["dtype"]
    proc = cli("-d", "64", "--cache-type-k", "f16", "-q")
    assert proc.returncode == 2 and "--cache-type-v f32" in proc.stderr
    assert "Traceback" not in proc.stderr
