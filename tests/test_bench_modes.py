"""`pocket-mlx bench MODE` (cli/bench_modes.py, the measuring in pocket_mlx/analysis/): --help
lists the modes; `bench` without one is the pp/tg table as before; the speculative and
prefix-cache modes run on a tiny synthetic model; a bad value is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

MODES = ("kernels", "prefix-cache", "speculative")


def cli(*args: str, tmp_path=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if tmp_path is not None:
        env.update(POCKET_MLX_HOME=str(tmp_path / "home"), POCKET_MLX_CACHE=str(tmp_path / "c"))
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "bench", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_help_lists_the_modes():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    modes = r.stdout[r.stdout.index("modes:"):]
    for mode in MODES:
        assert f"    {mode} " in modes, (mode, modes)
        h = cli(mode, "--help")
        assert h.returncode == 0 and f"pocket-mlx bench {mode}" in h.stdout, h.stderr


def test_without_a_mode_the_table_as_before(tiny_ckpt):
    r = cli("-m", str(tiny_ckpt), "-p", "0", "-n", "2", "-r", "1", "-q", "-o", "json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["rows"]
    assert row["test"] == "tg2"


def test_speculative_mode_on_a_tiny_model(tiny_ckpt, tmp_path):
    r = cli("speculative", "-m", str(tiny_ckpt), "-n", "8", "--reps", "1", "--k", "2",
            tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert [ln.split("|")[1].strip() for ln in rows] == ["method", "off", "lookup", "auto"]
    assert "| lookup | 2 |" in r.stdout and "kernels " in r.stdout


def test_prefix_cache_mode_in_process(tiny_ckpt, tmp_path):
    r = cli("prefix-cache", "-m", str(tiny_ckpt), "--session-identity", "4", "--rules", "8",
            tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "greedy token ids identical with and without the store: yes" in r.stdout


def test_bad_values_are_one_line_exit_2(tiny_ckpt):
    for args, text in ((("speculative", "--ordinary", "--methods", "off,fast"), "--methods"),
                       (("speculative", "--k", "0"), "--k"),
                       (("prefix-cache", "--rules", "0"), "--rules"),
                       (("kernels", "--threads", "0"), "--threads"),
                       (("nonsense",), "invalid choice")):
        r = cli(*args, "-m", str(tiny_ckpt)) if args[0] == "speculative" else cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert text in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
