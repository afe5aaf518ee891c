"""`convert --resume`: a conversion killed with SIGKILL (real subprocess) in its search or in
its writing continues where it stopped, and writes what an uninterrupted run writes.

Slower than most (~30-60 s on 2 cores): six real conversions in subprocesses, four of them
killed with a real SIGKILL at a chosen step (resume.DIE_ENV), which is what is under test."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ROOT

from pocket_mlx.config import weights_bytes
from pocket_mlx.convert.budget_stream import JUDGE_STATE, MEASURE_STATE
from pocket_mlx.convert.resume import DIE_ENV, JOURNAL

CALIB = [str(ROOT / "assets" / "text" / f"{d}.calib.txt") for d in ("en", "zh", "code")]


def convert(src: Path, out: Path, *extra: str, die: str | None = None,
            env_extra: dict | None = None):
    env = {**os.environ, "POCKET_MLX_PROGRESS_INTERVAL": "0", **(env_extra or {})}
    env.pop(DIE_ENV, None)
    if die:
        env[DIE_ENV] = die
    return subprocess.run([sys.executable, "-m", "pocket_mlx", "convert", str(src), str(out),
                           *extra], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def tensors(folder: Path) -> dict[str, mx.array]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in sorted(set(index.values())):
        out.update(mx.load(str(folder / f)))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted auto --target-size build of a tiny checkpoint (3 domains, 2 shards)."""
    from conftest import hf_weights, tiny_config, write_checkpoint

    base = tmp_path_factory.mktemp("resume")
    cfg = tiny_config(vocab_size=8192, layer_types=["linear_attention", "full_attention"])
    src = write_checkpoint(base / "src", cfg, hf_weights(cfg, 0))
    target = str(int(weights_bytes(src) // 2 * 0.3))
    args = ("--recipe", "auto", "--target-size", target, "--calib", CALIB[0], "--calib",
            CALIB[1], "--calib", CALIB[2], "--calib-tokens", "48", "--dtype", "bfloat16",
            "--rounding", "rtn", "--shard-size-gb", str(0.5 / 1024))
    ref = base / "ref"
    r = convert(src, ref, *args)
    assert r.returncode == 0, r.stderr
    return src, args, ref


def kill_resume_and_compare(tmp_path, src, args, ref, dies, check, env=None):
    """Run `convert` killed at each of `dies` ("step:n", each run after the first with
    --resume), calling `check(step, n, stderr, left folder, journal)` after each kill, then
    resume it to the end: its files equal `ref`'s byte for byte (headers included), its
    candidates too, and one temporary folder was there all along and none is left."""
    out = tmp_path / "out"
    resume: tuple[str, ...] = ()
    for die in dies:
        r = convert(src, out, *args, *resume, die=die, env_extra=env)
        assert r.returncode == -signal.SIGKILL, r.stderr
        assert not out.exists()
        (left,) = tmp_path.glob(".out.tmp-*")
        step, n = die.split(":")
        check(step, int(n), r.stderr, left, json.loads((left / JOURNAL).read_text()))
        if resume:
            assert f"resuming {left.name}" in r.stdout
        resume = ("--resume",)
    r = convert(src, out, *args, "--resume", env_extra=env)
    assert r.returncode == 0, r.stderr
    assert f"resuming {left.name}" in r.stdout and "3 write units done" in r.stdout
    assert not list(tmp_path.glob(".out.tmp-*"))  # renamed into place, no second copy
    assert not (out / JOURNAL).exists()
    a, b = tensors(ref), tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k
    assert (json.loads((out / "pocket.json").read_text())["auto"]["candidates"]
            == json.loads((ref / "pocket.json").read_text())["auto"]["candidates"])
    shards = sorted(f.name for f in ref.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(f.name for f in out.glob("*.safetensors"))
    for name in shards:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


def written_units_kept(n, stderr, left, journal):
    assert journal["write"]["units"] == n
    assert list(left.glob(".shard-*.safetensors"))
    assert "measure:" not in stderr  # all came from the journal


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, reference):
    """Killed in the per-group measurements, resumed and killed again in the candidate
    builds, resumed and killed again in the writing, resumed to the end: the same safetensors
    files, byte for byte, as the uninterrupted run, and one temporary folder all along."""
    src, args, ref = reference
    groups = 0

    def check(step, n, stderr, left, journal):
        nonlocal groups
        budget = journal["budget"]
        if step == "measure":
            assert len(budget["kl"]) == n and not budget["tried"]
            groups = int(re.search(r"measure: 1/(\d+) group", stderr).group(1))
        elif step == "search":
            assert len(budget["tried"]) == n
            assert f"measure: 1/{groups - 7} group" in stderr  # the 7 done: from the journal
        else:
            written_units_kept(n, stderr, left, journal)

    kill_resume_and_compare(tmp_path, src, args, ref, ("measure:7", "search:2", "write:3"),
                            check)


STREAMED = {"POCKET_MLX_SEARCH_WHOLE_MAX": "0"}


@pytest.fixture(scope="module")
def streamed_reference(reference, tmp_path_factory):
    """The same build with the search forced layer by layer (budget_stream)."""
    src, args, _ = reference
    ref = tmp_path_factory.mktemp("streamed") / "ref"
    r = convert(src, ref, *args, env_extra=STREAMED)
    assert r.returncode == 0, r.stderr
    assert "reads the model one layer at a time" in r.stdout
    return src, args, ref


def test_streamed_search_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path,
                                                                        streamed_reference):
    """The layer-by-layer search (a model past SEARCH_WHOLE_MAX, forced here): killed in the
    per-layer measurements, resumed and killed again in the candidate builds' pass, resumed
    and killed again in the writing, resumed to the end: the same safetensors files, byte for
    byte, as the uninterrupted run, and one temporary folder all along."""
    src, args, ref = streamed_reference

    def check(step, n, stderr, left, journal):
        budget = journal["budget"]
        if step == "measure":  # one of the two layers measured, its streams kept
            assert budget["measure"]["layers"] == 1 and not budget["tried"]
            assert (left / MEASURE_STATE).exists()
        elif step == "search":  # only the second layer was measured again
            assert budget["judge"]["layers"] == 1 and budget["measured"]
            assert "measure: 1/1 layer" in stderr and (left / JUDGE_STATE).exists()
            assert not (left / MEASURE_STATE).exists()
        else:
            written_units_kept(n, stderr, left, journal)
            assert "search: 1/1 layer" in stderr and not (left / JUDGE_STATE).exists()

    kill_resume_and_compare(tmp_path, src, args, ref, ("measure:1", "search:1", "write:3"),
                            check, STREAMED)


def test_resume_ignores_a_run_of_other_options(tmp_path, reference):
    """The journal's fingerprint differs: the dead folder is not taken over, but cleared."""
    src = reference[0]
    out = tmp_path / "out"
    base = ("--recipe", "pocket-2bit", "--shard-size-gb", str(0.5 / 1024))
    assert convert(src, out, *base, die="write:2").returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob(".out.tmp-*"))) == 1
    r = convert(src, out, "--recipe", "uniform-4", "--resume")
    assert r.returncode == 0, r.stderr
    assert "no interrupted run of this command" in r.stdout
    assert not list(tmp_path.glob(".out.tmp-*"))
    assert json.loads((out / "pocket.json").read_text())["recipe"]["name"] == "uniform-4"
