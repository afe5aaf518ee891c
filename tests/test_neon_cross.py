"""The plain C++ core's own parity program (csrc/tests/test_core.cpp), built natively and
cross-built for arm64 (NEON) and run under qemu-aarch64, via scripts/check_neon.sh.
Under qemu it runs on three emulated CPUs: `-cpu max` (dotprod + i8mm: the NEON FAST variants
neon-i8mm and neon-dotprod and plain NEON EXACT, all forced in turn), `-cpu cortex-a76` (dotprod
only: the run-time pick must be neon-dotprod) and `-cpu cortex-a53` (neither: plain NEON, FAST
requests run EXACT). FAST results are checked against FAST's own int8-activation result.
Skips with the reason when a compiler / the cross tools are missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_neon.sh"


def _run(which: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), which], capture_output=True, text=True, timeout=900,
        env={**__import__("os").environ, "QK_BUILD_DIR": str(tmp_path)},
    )


def _verdict(p: subprocess.CompletedProcess):
    out = p.stdout + p.stderr
    if p.returncode == 77:
        pytest.skip(p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "tools missing")
    # The program's verdict (its FAIL lines, the seed to rerun with) is on stdout; the compiler's
    # warnings on stderr would otherwise fill the message and hide it.
    fails = [ln for ln in p.stdout.splitlines() if "FAIL" in ln or ln.startswith("seed ")]
    assert p.returncode == 0, "\n".join(fails[:20]) + "\n" + p.stdout[-2000:] + p.stderr[-1500:]
    assert "cases passed" in out


def test_core_native(tmp_path):
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no native C++ compiler (g++)")
    _verdict(_run("native", tmp_path))


def test_core_neon_under_qemu(tmp_path):
    if not shutil.which("aarch64-linux-gnu-g++"):
        pytest.skip("aarch64-linux-gnu-g++ not installed (apt-get install -y g++-aarch64-linux-gnu)")
    if not shutil.which("qemu-aarch64"):
        pytest.skip("qemu-aarch64 not installed (apt-get install -y qemu-user)")
    p = _run("neon", tmp_path)
    _verdict(p)
    out = p.stdout
    # Every NEON variant ran, each with its FAST bit widths (mask 0x156: 1/2/4/6/8 bits).
    for variant, mask in (("neon-i8mm", "0x156"), ("neon-dotprod", "0x156"), ("neon", "0x0")):
        assert f"(variant {variant}, FAST bits mask {mask})" in out, out[-3000:]
    assert out.count("cases passed") >= 3  # 5 with the optional Clang build
