"""Convert's float32 forward passes on the CPU, with their matmuls in numpy's BLAS.

Why: MLX's CPU wheel bundles the reference (netlib) BLAS, so a float32 GEMM runs at 2-4 GFLOP/s
on the machines we measure on, where the OpenBLAS that numpy ships runs the same GEMM at ~120
GFLOP/s on two cores. Calibration (REAP statistics), the GPTQ/AWQ input capture and the auto
search run the float model over thousands of tokens: at the 35B shape one layer took ~50 s for
512 tokens, nearly all of it in `Linear` and `gather_mm`. No new dependency: numpy is already
one of MLX's.

Threads: numpy's OpenBLAS splits each GEMM over its threads with a static split, and a core
held by another process stalls the whole call: an expert's GEMM (8-64 rows) ran 4-7x slower
with two OpenBLAS threads than with one while another job used a core. So OpenBLAS gets one
thread (pocket_mlx/__init__.py sets OPENBLAS_NUM_THREADS=1 unless the user set it) and the
work is split here: the output columns (the weight's rows) or the experts into chunks that a
small pool claims as it goes, so a busy core only slows its own chunks.

`numpy_matmuls(module)` swaps the float32 `Linear` and `SwitchLinear` modules inside `module`
for ones that evaluate their input and multiply in numpy, for the length of a with-block, and
puts the originals back after it. The results differ from MLX's only in the order float32
products are summed. A no-op off the CPU (Metal, CUDA: their GEMMs are fast), for other
dtypes, and with POCKET_MLX_NUMPY_BLAS=0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from pocket_mlx.models.layers import SwitchLinear


def enabled() -> bool:
    return (os.environ.get("POCKET_MLX_NUMPY_BLAS", "1") != "0"
            and mx.default_device() == mx.cpu)


@cache
def _pool() -> ThreadPoolExecutor | None:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ThreadPoolExecutor(n, thread_name_prefix="pocket-blas") if (n or 1) > 1 else None


def _run(tasks: list[Callable[[], None]]) -> None:
    """Run the tasks on the pool (claimed in order as threads free up), or inline."""
    pool = _pool()
    if pool is None or len(tasks) < 2:
        for t in tasks:
            t()
        return
    for f in [pool.submit(t) for t in tasks]:
        f.result()


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    step = max(1, -(-n // parts))
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _np(x: mx.array) -> np.ndarray:
    """A float32 numpy view of `x` (evaluated; no copy when it is float32 already)."""
    return np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    @property
    def weight(self) -> mx.array:  # what observers wrapped around it read
        return self.module.weight


class NumpyLinear(_Wrapper):
    """A float32 `nn.Linear` (bias or not) computed by numpy's BLAS."""

    def __call__(self, x: mx.array) -> mx.array:
        m = self.module
        w = _np(m.weight)
        xs = _np(x).reshape(-1, w.shape[1])
        y = np.empty((xs.shape[0], w.shape[0]), np.float32)

        def part(a: int, b: int) -> None:
            np.matmul(xs, w[a:b].T, out=y[:, a:b])
        # Column blocks of >= 64 outputs (4 per thread: claimed as threads free up).
        _run([lambda a=a, b=b: part(a, b)
              for a, b in _chunks(w.shape[0], max(1, min(8, w.shape[0] // 64)))])
        if "bias" in m:
            y += _np(m.bias)
        return mx.array(y).reshape(*x.shape[:-1], w.shape[0])


def _experts(w: mx.array) -> Callable[[int], np.ndarray]:
    """Expert e's weights [out, in] in float32: a view of a float32 stack; of a bf16 or fp16
    stack (`narrow_experts`), widened when asked for, exactly (each value is exact in
    float32), so no float32 copy of the whole stack is made."""
    if w.dtype == mx.float32:
        a = np.asarray(w)
        return lambda e: a[e]
    if w.dtype == mx.float16:
        a = np.asarray(w)
        return lambda e: a[e].astype(np.float32)
    a = np.asarray(w.view(mx.uint16))  # bfloat16: the high half of a float32
    return lambda e: (a[e].astype(np.uint32) << 16).view(np.float32)


_NARROW = (mx.bfloat16, mx.float16)


def narrow_experts(model: nn.Module) -> nn.Module:
    """`model` (cast to float32, lazily loaded) with its routed experts back in the float dtype
    the checkpoint stored (bf16, fp16), where numpy multiplies them (`enabled()`): each
    expert's GEMM widens that expert alone (`_experts`), with the same float32 values, so a
    35B layer holds 1.6 GB of experts instead of 3.2 GB. Elsewhere a no-op."""
    if not enabled():
        return model
    stored = getattr(model, "stored_dtypes", {})
    narrowed = []
    for path, m in model.named_modules():
        if type(m) is SwitchLinear and m["weight"].dtype == mx.float32:
            d = stored.get(f"{path}.weight", (None,))[0]
            if d in _NARROW:
                narrowed.append((f"{path}.weight", m["weight"].astype(d)))
    if narrowed:
        model.update(tree_unflatten(narrowed))
    return model


class NumpySwitchLinear(_Wrapper):
    """A float32 `SwitchLinear` (what `mx.gather_mm` computes for one-row left operands, as
    SwitchGLU calls it): the rows grouped by expert, one GEMM per expert with rows. Its
    stack may be bf16 or fp16 (`narrow_experts`): each expert is widened for its GEMM."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False
                 ) -> mx.array:
        w = self.module.weight  # [E, out, in]
        if x.shape[-2] != 1:  # SwitchGLU passes one row per (token, expert): keep MLX's op
            return self.module(x, indices, sorted_indices=sorted_indices)
        expert = _experts(w)
        batch = np.broadcast_shapes(x.shape[:-2], indices.shape)
        ids = np.broadcast_to(np.asarray(indices), batch).reshape(-1)
        order = np.argsort(ids, kind="stable")
        ids_sorted = ids[order]
        cuts = np.flatnonzero(np.diff(ids_sorted)) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [len(ids_sorted)]))
        # Each (token, expert) row's input gathered straight into expert order: broadcasting
        # x over the k experts first would copy it k times (268 MB for 4096 tokens at k=8).
        rows = np.broadcast_to(np.arange(math.prod(x.shape[:-2])).reshape(x.shape[:-2]),
                               batch).reshape(-1)
        xs = _np(x).reshape(-1, w.shape[2])[rows[order]]
        y = np.empty((len(ids_sorted), w.shape[1]), np.float32)
        segments = list(zip(starts.tolist(), ends.tolist()))

        def part(a: int, b: int) -> None:
            for s, e in segments[a:b]:
                np.matmul(xs[s:e], expert(ids_sorted[s]).T, out=y[s:e])
        _run([lambda a=a, b=b: part(a, b) for a, b in _chunks(len(segments), 8)])
        out = np.empty_like(y)
        out[order] = y
        return mx.array(out).reshape(*batch, 1, w.shape[1])


def _swappable(m: nn.Module) -> type[nn.Module] | None:
    if type(m) is not SwitchLinear and not (isinstance(m, nn.Linear) and "scales" not in m):
        return None
    if isinstance(m, SwitchLinear):
        return NumpySwitchLinear if m["weight"].dtype in (mx.float32, *_NARROW) else None
    return NumpyLinear if m["weight"].dtype == mx.float32 else None


def numpy_matmul(m: nn.Module) -> nn.Module:
    """`m` itself as a numpy-BLAS module where `numpy_matmuls` would swap it, else `m`."""
    wrapper = _swappable(m) if enabled() else None
    return wrapper(m) if wrapper is not None else m


def materialize(module: nn.Module) -> None:
    """Read a lazily loaded module's parameters one tensor at a time: a tensor's source copy
    (bf16, or a 35B layer's 256 per-expert tensors before they are stacked) is freed before
    the next is read. Left to the first forward, a 35B layer's three expert stacks were read
    in one graph: 6.6 GB at its peak for a layer that holds 3.4 GB (MLX's peak memory)."""
    for _, v in tree_flatten(module.parameters()):
        mx.eval(v)


@contextmanager
def numpy_matmuls(module: nn.Module) -> Iterator[None]:
    """Inside the block, `module`'s float32 matmuls run in numpy's BLAS (CPU only). Its
    parameters are read first, a tensor at a time (`materialize`)."""
    materialize(module)
    if not enabled():
        yield
        return
    swaps = []
    for path, m in module.named_modules():
        wrapper = _swappable(m)
        if wrapper is not None and path:
            swaps.append((path, m, wrapper(m)))
    if swaps:
        module.update_modules(tree_unflatten([(p, w) for p, _, w in swaps]))
    try:
        yield
    finally:
        if swaps:
            module.update_modules(tree_unflatten([(p, m) for p, m, _ in swaps]))


# Calibration windows stacked into one batch per layer call, up to this many tokens: each
# call reads the layer's weights once (a 35B layer's experts are 1 GB a matrix in float32), so
# more rows per expert per read. Bounded so the batch's intermediates stay near 1 GB.
BATCH_TOKENS = 4096


def forward_windows(layer: nn.Module, hs: list[mx.array], keys: list | None = None,
                    before: Callable[[int], None] | None = None) -> list[mx.array]:
    """[layer(h) for h in hs] (each window [1, T, H]), with consecutive windows of the same
    length and the same key (the calibration file, for per-file statistics) run as one batch
    of up to BATCH_TOKENS tokens; `before(i)` is called ahead of the batch that starts at
    window i. The matmuls run in numpy's BLAS (`numpy_matmuls`)."""
    out: list[mx.array] = []
    with numpy_matmuls(layer):
        i = 0
        while i < len(hs):
            j = i + 1
            while (j < len(hs) and hs[j].shape == hs[i].shape
                   and (keys is None or keys[j] == keys[i])
                   and (j + 1 - i) * hs[i].shape[1] <= BATCH_TOKENS):
                j += 1
            if before is not None:
                before(i)
            y = layer(mx.concatenate(hs[i:j]) if j - i > 1 else hs[i])
            mx.eval(y)
            out += [y[k:k + 1] for k in range(j - i)] if j - i > 1 else [y]
            i = j
    return out
