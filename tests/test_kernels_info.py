"""kernels.info() reports what actually runs: the instruction set variant the extension dispatched
to (checked against the CPU's own flags) and the mode per instruction set (plain NEON without the
dot-product instructions and scalar have no FAST kernels, so a requested "fast" runs and is
reported as "exact")."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from pocket_mlx import kernels


@pytest.fixture
def restore():
    old_mode, old_isa, old_dev = kernels.get_mode(), kernels.info().get("isa", "auto"), mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old_dev)
    kernels.set_mode(old_mode)
    kernels.set_isa(old_isa)
    kernels.set_threads(None)


def _arm_features() -> set[str] | None:
    """The CPU's dot-product features under /proc/cpuinfo's names (asimddp, i8mm): from Linux's
    "Features" line, or macOS's hw.optional.arm.FEAT_* sysctls; None when neither is readable."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for ln in cpuinfo.read_text().splitlines():
            if ln.lower().startswith("features"):
                return set(ln.split(":", 1)[1].split())
        return None
    feats = set()
    for name, flag in (("FEAT_DotProd", "asimddp"), ("FEAT_I8MM", "i8mm")):
        try:
            out = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{name}"], capture_output=True,
                                 text=True, timeout=10)
        except OSError:
            return None
        if out.stdout.strip() == "1":
            feats.add(flag)
    return feats


def _expected_x86_variant(flags: set[str]) -> str:
    """What csrc/core/qkernels.cpp's isa_by_name picks, from /proc/cpuinfo's flag names."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        if "avx512_vnni" not in flags:
            return "avx512"
        return "avx512-vbmi" if "avx512vbmi" in flags else "avx512-vnni"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "scalar"


def test_neon_requested_fast_runs_and_reports_exact():
    """An arm64 CPU without dotprod (plain NEON has no FAST kernels): "fast" asked, "exact" runs;
    with dotprod FAST runs for 1/2/4/6/8 bits."""
    got = kernels.active_info("neon", "neon", [], "fast", 8)
    assert got == {"active": True, "isa": "neon", "variant": "neon", "threads": 8,
                   "mode": "exact", "fast_bits": []}
    assert kernels.active_info("scalar", "scalar", [], "fast", 1)["mode"] == "exact"
    dot = kernels.active_info("neon", "neon-dotprod", [8, 1, 2, 4, 6], "fast", 8)
    assert (dot["mode"], dot["fast_bits"]) == ("fast", [1, 2, 4, 6, 8])
    avx2 = kernels.active_info("avx2", "avx2", [6, 2, 4], "fast", 2)
    assert (avx2["mode"], avx2["fast_bits"]) == ("fast", [2, 4, 6])
    assert kernels.active_info("avx2", "avx2", [2, 4, 6], "exact", 2)["mode"] == "exact"


def test_isa_matches_cpuinfo(kernels_ext, restore):
    assert kernels.set_isa("auto")
    info = kernels.info()
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        feats = _arm_features()
        if feats is None:
            pytest.skip("no CPU feature list to compare with on this arm64 system")
        variant = ("neon-i8mm" if {"asimddp", "i8mm"} <= feats
                   else "neon-dotprod" if "asimddp" in feats else "neon")
        want = [] if variant == "neon" else [1, 2, 4, 6, 8]
        assert (info["isa"], info["variant"], info["fast_bits"]) == ("neon", variant, want)
        return
    cpuinfo = Path("/proc/cpuinfo")
    if machine not in ("x86_64", "amd64") or not cpuinfo.is_file():
        pytest.skip(f"no CPU flags to compare with on {machine}")
    line = next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags"))
    variant = _expected_x86_variant(set(line.split(":", 1)[1].split()))
    assert info["variant"] == variant
    assert info["isa"] == variant.split("-")[0]
    want_bits = {"scalar": [], "avx2": [1, 2, 4, 6], "avx512": [1, 2, 4, 6]}.get(variant,
                                                                            [1, 2, 4, 6, 8])
    assert info["fast_bits"] == want_bits


def _qmm(bits: int, mode: str):
    rng = np.random.default_rng(bits)
    w = mx.array(rng.standard_normal((24, 256)).astype(np.float32) * 0.05)
    wq, s, b = mx.quantize(w, 64, bits)
    x = mx.array(rng.standard_normal((2, 256)).astype(np.float32))
    kernels.set_mode(mode)
    return np.array(kernels.quantized_matmul(x, wq, s, b, group_size=64, bits=bits))


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar", "neon", "neon-dotprod", "neon-base"])
def test_reported_mode_is_the_one_that_runs(isa, kernels_ext, restore):
    """FAST asked: where info() says a bit width runs EXACT, the output equals EXACT's bit for
    bit; where it says FAST, the int8 activations show."""
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available on this CPU")
    kernels.set_threads(1)  # one summation order
    kernels.set_mode("fast")
    info = kernels.info()
    for bits in (1, 2, 3, 4, 8):
        exact, fast = _qmm(bits, "exact"), _qmm(bits, "fast")
        runs_fast = info["mode"] == "fast" and bits in info["fast_bits"]
        assert np.array_equal(exact, fast) != runs_fast, (info, bits)
