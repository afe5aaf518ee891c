"""The plain C++ core's own parity program (csrc/core/test_core.cpp), built natively and
cross-built for arm64 (NEON) and run under qemu-aarch64, via scripts/check_neon.sh.
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
        pytest.skip(out.strip().splitlines()[-1] if out.strip() else "tools missing")
    assert p.returncode == 0, out[-4000:]
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
    _verdict(_run("neon", tmp_path))
