"""Loading a model for the CPU keeps MLX's freed buffers for reuse (engine/devices.py,
`keep_cpu_buffers`): a step that frees and allocates again a few hundred MB (a speculative
verify pass's linear-attention tapes on the 35B shape) must not page-fault it all back in."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest

from pocket_mlx.engine import devices

# In a fresh process: the cache limit is process-wide and other tests may have raised it.
SCRIPT = r"""
import resource, sys
import mlx.core as mx
from pocket_mlx.engine.loader import load
if sys.argv[1] == "load":
    load(None, device="cpu")
MB = 4
def churn():
    xs = [mx.full((MB << 18,), float(i)) for i in range(48)]  # 48 x 4 MiB
    mx.eval(xs)
    del xs
churn()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""

PAGES = 48 * (4 << 20) // 4096


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_loading_for_the_cpu_keeps_freed_buffers():
    # 192 MiB freed and allocated again: with the buffers kept, next to no page faults.
    assert _faults("load") < PAGES // 10


def test_without_it_the_same_churn_faults_here():
    # What the test above guards against, on this platform's default MLX allocator (on a Mac the
    # Metal allocator keeps buffers by default, so there is nothing to show).
    if sys.platform == "darwin":
        pytest.skip("the Metal allocator keeps freed buffers by default")
    assert _faults("plain") > PAGES // 2


def test_never_lowers_a_larger_limit():
    old = mx.set_cache_limit(8 << 30)
    try:
        assert devices.keep_cpu_buffers() == 8 << 30
        assert mx.set_cache_limit(8 << 30) == 8 << 30
    finally:
        mx.set_cache_limit(old)


def test_cache_size_is_bounded():
    assert 0 < devices.cpu_buffer_cache_bytes() <= devices.CPU_BUFFER_CACHE_MAX
