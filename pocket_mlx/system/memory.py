"""In-process GPU wired memory: keep the model resident while generating on the GPU.

Why not mlx-lm's `wired_limit`: it asks `mx.device_info()` about the *default* device. When the
CPU is the default (pocket-mlx keeps a stream per device), that dict has no
`max_recommended_working_set_size` and the helper fails. Here the GPU is asked explicitly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx

from pocket_mlx.system.host import get_platform, gpu_device_info
from pocket_mlx.system.wired import FIX_COMMAND, find_key, read_limit
from pocket_mlx.units import MiB, size

_warned = False


def recommended_working_set(device_info: dict | None = None) -> int | None:
    """The GPU's `max_recommended_working_set_size` in bytes, or None where it has none."""
    info = gpu_device_info() if device_info is None else device_info
    value = info.get("max_recommended_working_set_size")
    return int(value) if value else None


@contextmanager
def wired_limit(
    model_bytes: int,
    device: str,
    *,
    device_info: dict | None = None,
    warn: Callable[[str], object] = print,
    setter: Callable[[int], int] | None = None,
    streams: Sequence[object] | None = None,
) -> Iterator[None]:
    """Wire up to the GPU's recommended working set for the duration of a GPU generation.

    No-op for device "cpu" or when the GPU reports no recommended size. Warns once per process
    when the model is over 90% of it, naming the fix. `setter` defaults to `mx.set_wired_limit`
    (returns the previous limit, restored on exit after synchronizing `streams`).
    """
    global _warned
    if device == "cpu":
        yield
        return
    max_rec = recommended_working_set(device_info)
    if max_rec is None:
        yield
        return
    if model_bytes > 0.9 * max_rec and not _warned:
        _warned = True
        warn(
            f"[pocket-mlx] warning: the model needs {size(model_bytes)}, close to the GPU's "
            f"recommended working set of {size(max_rec)}: generation may be slow. "
            f"On macOS raise the wired limit: {FIX_COMMAND}"
        )
    real = setter is None
    if real:
        setter = mx.set_wired_limit
    try:
        old = setter(max_rec)
    except Exception as e:  # noqa: BLE001 - e.g. above the system limit: run unwired
        warn(f"[pocket-mlx] warning: could not set the wired limit ({e}); continuing without")
        yield
        return
    try:
        yield
    finally:
        if real:
            if streams:
                for s in streams:
                    mx.synchronize(s)
            else:
                mx.synchronize()
        setter(old)


def reset_warning() -> None:
    """Forget that the 90% warning was shown (tests)."""
    global _warned
    _warned = False


def wired_limit_status(platform=None) -> str | None:
    """Short label for the TUI: "wired 24.0 GiB (iogpu.wired_limit_mb)", "wired default (...)",
    or None where the platform has no such setting. Runs `sysctl`: call once, not per frame."""
    platform = platform or get_platform()
    key = find_key(platform)
    if key is None:
        return None
    raw = read_limit(platform, key)
    if raw is None:
        return None
    if raw == 0:
        return f"wired default ({key.name})"
    return f"wired {size(key.to_mb(raw) * MiB)} ({key.name})"


def _libc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim, or None (macOS, musl: nothing to call)."""
    try:
        import ctypes

        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


_TRIM = _libc_trim()


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc: `malloc_trim(0)`; elsewhere nothing).
    Why: on Linux, MLX's CPU buffers and the extension's scratch come from malloc, whose
    per-thread arenas keep freed chunks mapped, so a long prefill's transient buffers (tens of
    MiB per node, a chunk at a time) would stay in the server's RSS beyond what the memory
    planner counts (live arrays). Called by `serve` after each prefill chunk; a few ms."""
    if _TRIM is not None:
        _TRIM()


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux: /proc/self/statm), else its peak so far
    (`getrusage`, bytes on macOS); None where neither is known. Why: what the process holds
    besides its arrays (Python, MLX, the tokenizer, the web server) is measured, not guessed,
    when `serve` reports its planned memory."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return None
    return peak if sys.platform == "darwin" else peak * 1024
