"""Device selection: one generation stream per device, created on demand.

mlx-lm creates its generation stream once, at import time, on whatever device was default then;
a later `mx.set_default_device(mx.cpu)` does not move it (seen on an H200 with MLX's CUDA
backend: mlx-lm still decoded on the GPU). Here each device gets its own stream and callers
pass the device explicitly, so one loaded model can switch device between two generations.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NoReturn

import mlx.core as mx

from pocket_mlx.errors import PocketError

# MLX streams belong to the thread that created them, so the cache is per thread (the chat app
# generates on a worker thread, scripts on the main one).
_LOCAL = threading.local()


def gpu_available() -> bool:
    """True when MLX has a GPU backend here (Metal on a Mac, CUDA where built with it)."""
    try:
        return bool(mx.is_available(mx.gpu))
    except Exception:
        return False


def gpu_backend_name() -> str:
    if not gpu_available():
        return "none"
    try:
        if mx.metal.is_available():
            return "Metal"
    except Exception:
        pass
    try:
        if mx.cuda.is_available():
            return "CUDA"
    except Exception:
        pass
    return "GPU"


def resolve_device(name: str | None) -> str:
    """Map a user's device name to "gpu" or "cpu"; None means the best available."""
    if name is None or name == "auto":
        return "gpu" if gpu_available() else "cpu"
    name = name.lower()
    if name in ("metal", "cuda"):
        name = "gpu"
    if name not in ("gpu", "cpu"):
        raise PocketError(f"unknown device {name!r}: use --device gpu or --device cpu")
    if name == "gpu" and not gpu_available():
        raise PocketError("no GPU is available to MLX on this machine: use --device cpu")
    return name


def policy_dtype(name: str) -> str | None:
    """The dtype policy of every entry point (load, generate, chat, eval-ppl, bench): float32
    activations on the CPU, where MLX's bf16/fp16 arithmetic is 5-40x slower and the extension's
    decode nodes take float32 only (quantized scales stay as stored: the kernels read them in
    16 bits); on the GPU the checkpoint's own dtype (None). `engine.loader` applies it."""
    return "float32" if resolve_device(name) == "cpu" else None


def mx_device(name: str) -> mx.Device:
    return mx.gpu if name == "gpu" else mx.cpu


# MLX's CPU allocator keeps freed buffers for reuse only up to its cache limit, 32 MiB by default
# on Linux (on a Mac the Metal allocator serves the CPU stream too, with a limit near the memory
# limit). Past it, freed buffers go back to malloc, which hands big ones back to the kernel, and
# the next allocation of that size page-faults its pages in again, zeroed. A verify pass of
# speculative decoding frees L linear-attention states per layer (2 MiB each on the 35B shape,
# 30 layers) and allocates them again on the next pass: 34,000 page faults a 4-row pass, which
# took 275 ms with them and 194 ms without (docs/SPECULATIVE.md).
CPU_BUFFER_CACHE_MAX = 1 << 30


def cpu_buffer_cache_bytes() -> int:
    """The buffer cache the CPU path wants: 1/32 of the machine's memory, at most 1 GiB."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return min(CPU_BUFFER_CACHE_MAX, ram // 32)


def keep_cpu_buffers() -> int:
    """Raise MLX's buffer cache limit to `cpu_buffer_cache_bytes()` (never lower it: a user's
    or the platform's larger limit stays). Returns the limit in force."""
    want = cpu_buffer_cache_bytes()
    old = mx.set_cache_limit(want)
    if old > want:
        mx.set_cache_limit(old)
        return old
    return want


def stream_for(name: str) -> mx.Stream:
    """The generation stream of a device, created once per device."""
    name = resolve_device(name)
    streams = _LOCAL.__dict__.setdefault("streams", {})
    if name not in streams:
        streams[name] = mx.new_stream(mx_device(name))
    return streams[name]


def describe(name: str) -> str:
    """Human label for a resolved device: 'GPU (Metal)', 'GPU (CUDA)' or 'CPU'."""
    return f"GPU ({gpu_backend_name()})" if name == "gpu" else "CPU"


def exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown. Workaround: after MLX ran on a
    worker thread (the chat app's engine, the server's), the normal exit often aborts in MLX's
    C++ destructors ("terminate called without an active exception", SIGABRT, exit 134). Call
    it only when everything is saved (atomic writes) and the terminal restored."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
