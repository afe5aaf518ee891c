"""Python face of the optional C++ CPU kernels (`pocket_mlx._qkernels`).

`pocket_mlx.kernels.ops` calls these on the CPU device. Every entry point has the semantics of the MLX op
it replaces and falls back to that op for anything the extension does not handle.

Environment:
  POCKET_MLX_KERNELS=0        disable the extension (MLX's own kernels are used)
  POCKET_MLX_THREADS=N        worker threads (default: physical cores)
  POCKET_MLX_KERNEL_MODE=exact|fast  start mode (default: fast; see set_mode)
  POCKET_MLX_ISA=avx2|scalar|neon-dotprod|...  force an instruction set (testing; see set_isa)
  POCKET_MLX_PANELS=0|1       the CPU panel layout off / on (default: on where the panel kernels
                              are x86's, see PANELS_BY_DEFAULT): models loaded for the CPU
                              keep their 2/4/6/8-bit matrices packed in it, one copy
  POCKET_MLX_REQUIRE_KERNELS=1  CI: a failed build of the extension fails `pip install`, and the
                              kernel tests fail instead of skipping when it is missing (required())
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx

try:
    from pocket_mlx import _qkernels as _ext

    _import_error: str | None = None
except ImportError as e:  # not built (no compiler at install time) or ABI mismatch
    _ext = None
    if "_qkernels" in str(e) and ("cannot import name" in str(e) or "No module named" in str(e)):
        _import_error = ("C++ extension pocket_mlx._qkernels is not built (installing it needs a "
                         "C++17 compiler and CMake; see the pip install log)")
    else:
        _import_error = f"C++ extension pocket_mlx._qkernels failed to load: {e}"

_SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
_SUPPORTED_GROUPS = (32, 64, 128)
_FLOAT_TYPES = (mx.float32, mx.float16, mx.bfloat16)
_MODES = {"exact": 0, "fast": 1}
_user_enabled = True

# FAST is the default: on the pocket-2bit reference model its perplexity is within 0.5% of EXACT
# in every domain (docs/BENCHMARKS.md) and the 2-bit MoE matvec does ~4x less work per weight.
DEFAULT_MODE = "fast"
if _ext is not None:
    _env_mode = os.environ.get("POCKET_MLX_KERNEL_MODE", "").strip().lower()
    _ext.set_mode(_MODES[_env_mode if _env_mode in _MODES else DEFAULT_MODE])


def required() -> bool:
    """POCKET_MLX_REQUIRE_KERNELS=1 (CI): a missing extension is an error, not a fallback."""
    return os.environ.get("POCKET_MLX_REQUIRE_KERNELS", "").strip().lower() in ("1", "true", "yes",
                                                                               "on")


def load_error() -> str | None:
    """Why the extension is not loaded (not built, or failed to import), or None when it is."""
    return _import_error if _ext is None else None


def _env_disabled() -> bool:
    return os.environ.get("POCKET_MLX_KERNELS", "1").strip().lower() in ("0", "false", "off", "no")


_pin = threading.local()


def enabled() -> bool:
    """True when the extension is importable and not disabled (env or set_enabled(False))."""
    pinned = getattr(_pin, "value", None)
    if pinned is not None:
        return pinned
    return _ext is not None and _user_enabled and not _env_disabled()


@contextmanager
def pinned() -> Iterator[None]:
    """`enabled()` read once for a whole graph built in this thread (the verify pass asks ~120
    times per pass, and reading the environment each time was a fifth of building its graph)."""
    prev = getattr(_pin, "value", None)
    _pin.value = enabled()
    try:
        yield
    finally:
        _pin.value = prev


_disable_hooks: list = []


def on_disable(hook) -> None:
    """`hook()` runs when `set_enabled(False)` turns the extension off: engine/panels.py unpacks
    the packed models then, since MLX's own ops cannot read the panel layout."""
    _disable_hooks.append(hook)


def set_enabled(flag: bool) -> None:
    global _user_enabled
    was = enabled()
    _user_enabled = bool(flag)
    if was and not _user_enabled:
        for hook in _disable_hooks:
            hook()


def keep_rows_independent(rows: int) -> None:
    """Keep products of up to `rows` activation rows on the row kernels (not the GEMM).

    The GEMM sums in another order, so a row's bits would depend on how many rows shared its
    matrix; batched decode of `rows` sequences must give each the bits it gets alone."""
    if _ext is not None and hasattr(_ext, "gemm_min_rows") and _ext.gemm_min_rows() <= rows:
        _ext.set_gemm_min_rows(rows + 1)


def supports(x, bits: int, group_size: int) -> bool:
    """Whether the extension handles activations `x` with this quantization."""
    return (
        _ext is not None
        and bits in _SUPPORTED_BITS
        and group_size in _SUPPORTED_GROUPS
        and x.dtype in _FLOAT_TYPES
        and x.ndim >= 1
        and x.shape[-1] > 0
        and x.shape[-1] % group_size == 0
    )


def _weights_ok(x, w, scales, biases, w_ndim: int, bits: int, group_size: int) -> bool:
    return (
        biases is not None
        and w.ndim == w_ndim
        and w.dtype == mx.uint32
        and scales.dtype in _FLOAT_TYPES
        and biases.dtype == scales.dtype
        and scales.shape == biases.shape
        and w.shape[-1] * 32 == x.shape[-1] * bits
        and scales.shape[-1] * group_size == x.shape[-1]
    )


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int):
    """Same as mx.quantized_matmul(x, w, scales, biases, transpose=True, ...) (CPU)."""
    if enabled() and supports(x, bits, group_size) and _weights_ok(x, w, scales, biases, 2,
                                                                     bits, group_size):
        try:
            return _ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
        except (ValueError, TypeError):
            pass
    check_mlx_layout(w)
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                               bits=bits)


def gather_qmm(x, w, scales, biases, indices, *, group_size: int, bits: int,
               sorted_indices: bool = False):
    """Same as mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, ...)."""
    if (enabled() and supports(x, bits, group_size) and x.ndim >= 2 and indices is not None
            and mx.issubdtype(indices.dtype, mx.integer)
            and _weights_ok(x, w, scales, biases, 3, bits, group_size)):
        try:
            return _ext.gather_qmm(x, w, scales, biases, indices, group_size=group_size,
                                   bits=bits)
        except (ValueError, TypeError):
            pass
    check_mlx_layout(w)
    return mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True,
                         group_size=group_size, bits=bits, sorted_indices=sorted_indices)


def gated_delta(q, k, v, g, beta, state):
    """The gated delta rule over a sequence (see models/qwen3_5_moe.py) on the CPU, float32:
    returns (y, new_state), or None when the extension cannot run it."""
    if not enabled() or not hasattr(_ext, "gated_delta"):
        return None
    f32 = mx.float32
    B, _, _, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), f32)
    # No mx.contiguous: the primitive reads strided inputs itself, and every extra node costs
    # ~10 us per layer per decoded token on the CPU.
    args = [a if a.dtype == f32 else a.astype(f32) for a in (q, k, v, g, beta, state)]
    try:
        return tuple(_ext.gated_delta(*args))
    except (ValueError, TypeError):
        return None


def decode_op(name: str, *args, **kwargs):
    """One of the extension's small float32 ops (rms_norm, causal_conv_silu, rope, moe_route), or
    None when the extension cannot run it (the caller then uses MLX's composed form)."""
    if not enabled() or not hasattr(_ext, name) or any(
            isinstance(a, mx.array) and a.dtype != mx.float32 for a in args):
        return None
    try:
        return getattr(_ext, name)(*args, **kwargs)
    except (ValueError, TypeError):
        return None


def moe_block(x, mats: list, k: int, normalize: bool):
    """A whole sparse-MoE block as one node (see `_qkernels.moe_block`), or None when the
    extension cannot run it (the caller then builds the block from separate ops)."""
    if not enabled() or not hasattr(_ext, "moe_block") or x.dtype != mx.float32:
        return None
    try:  # unsupported bits / group sizes / shapes raise ValueError in the extension
        return _ext.moe_block(x, mats, k=k, normalize=normalize)
    except (ValueError, TypeError):
        return None


def moe_block_parts(x, mats: list, k: int, normalize: bool, expert_lo: int, with_shared: bool):
    """Expert parallelism: the MoE block's parts for the experts held here (see
    `_qkernels.moe_block_parts`): (parts [..., k + 1, D], scores [..., k]), or None exactly
    where `moe_block` would be None (the caller then builds the block from separate ops)."""
    if not enabled() or not hasattr(_ext, "moe_block_parts") or x.dtype != mx.float32:
        return None
    try:
        return tuple(_ext.moe_block_parts(x, mats, k=k, normalize=normalize, expert_lo=expert_lo,
                                          with_shared=with_shared))
    except (ValueError, TypeError):
        return None


def moe_combine(parts, scores):
    """The MoE block's output from its parts (summed over the ranks) and scores."""
    return _ext.moe_combine(parts, scores)


def linear_attn_step(*arrays, **dims):
    """One decode token of a Gated DeltaNet layer after its projections as one node (see
    `_qkernels.linear_attn_step`), or None when the extension cannot run it."""
    if not enabled() or not hasattr(_ext, "linear_attn_step") or any(
            a.dtype != mx.float32 for a in arrays):
        return None
    try:
        return tuple(_ext.linear_attn_step(*arrays, **dims))
    except (ValueError, TypeError):
        return None


def linear_attn_rows(*arrays, **dims):
    """L decode tokens of a Gated DeltaNet layer in one node, each with `linear_attn_step`'s
    bits, and the caches after each row (see `_qkernels.linear_attn_rows`), or None when the
    extension cannot run it."""
    if not enabled() or not hasattr(_ext, "linear_attn_rows") or any(
            a.dtype != mx.float32 for a in arrays):
        return None
    try:
        return tuple(_ext.linear_attn_rows(*arrays, **dims))
    except (ValueError, TypeError):
        return None


def set_threads(n: int | None) -> None:
    """Worker threads for the kernels (None or <= 0: physical cores)."""
    if _ext is not None:
        _ext.set_threads(0 if n is None else int(n))


def get_threads() -> int:
    return _ext.get_threads() if _ext is not None else 0


def set_mode(mode: str) -> None:
    """'fast' (default: activations as int8 per group, integer dot products, for the bit widths
    the instruction set has FAST kernels for, info()["fast_bits"]: 1/2/4/6 on AVX2 and AVX-512, 8
    too with VNNI, 1/2/4/6/8 on NEON with dotprod (sdot; i8mm's usdot where present), none on
    NEON without dotprod or scalar; the rest runs EXACT) or 'exact' (float32 products,
    MLX's result up to summation order)."""
    m = mode.lower()
    if m not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    if _ext is not None:
        _ext.set_mode(_MODES[m])


def get_mode() -> str:
    """The mode asked for (set_mode / POCKET_MLX_KERNEL_MODE); info()["mode"] is the one that runs."""
    if _ext is None:
        return "exact"  # MLX's own ops
    return {v: k for k, v in _MODES.items()}[_ext.get_mode()]


def set_isa(name: str) -> bool:
    """Force 'avx512' | 'avx512-novnni' (AVX-512BW kernels on a VNNI CPU, for tests) | 'avx2' | 'neon' (the best NEON variant) | 'neon-i8mm' | 'neon-dotprod' |
    'neon-base' (NEON without FAST) | 'scalar' | 'auto'; False if this CPU cannot."""
    return bool(_ext is not None and _ext.force_isa(name))


def active_info(isa: str, variant: str, fast_bits: Sequence[int], requested: str,
                threads: int) -> dict:
    """info() of an active extension from the facts it reports. "mode" is the mode that runs:
    "fast" only where the instruction set has FAST kernels (NEON without dotprod and scalar have
    none, so a requested "fast" runs, and is reported, as "exact"); "fast_bits" are the bit widths the
    instruction set has FAST kernels for (the others run EXACT in either mode)."""
    return {
        "active": True,
        "isa": isa,
        "variant": variant,
        "threads": threads,
        "mode": "fast" if requested == "fast" and len(fast_bits) > 0 else "exact",
        "fast_bits": sorted(fast_bits),
    }


def info() -> dict:
    """What runs the CPU quantized matmuls, for the TUI / `info` / `bench`: the extension itself
    says which instruction set variant it dispatched to and which bit widths FAST covers there."""
    if _ext is None:
        return {"active": False, "reason": _import_error}
    if _env_disabled():
        return {"active": False, "reason": "disabled by POCKET_MLX_KERNELS=0"}
    if not _user_enabled:
        return {"active": False, "reason": "disabled by set_enabled(False)"}
    return active_info(_ext.isa(), _ext.isa_variant(), _ext.fast_bits(), get_mode(),
                       _ext.get_threads())


def label(status: dict | None = None) -> str:
    """`info()` in a few words, as `info`, `bench` and the chat panel show it: the extension's
    instruction set, threads and mode ("avx2 ×4, fast") when it computes the quantized matmuls,
    else "mlx" (MLX's own kernels). Short: it fits the chat panel's 16-character value column."""
    status = info() if status is None else status
    if not status.get("active"):
        return "mlx"
    text = str(status.get("isa") or "?")
    if status.get("threads"):
        text += f" ×{status['threads']}"
    if status.get("mode"):
        text += f", {status['mode']}"
    return text


# Panel kernel variants on which the panel layout is the default, by end-to-end measurement
# (docs/BENCHMARKS.md, 2026-12-05): AVX-512 VNNI on a quiet AMD Zen 4, decode 0.84x -> 0.99x
# llama.cpp, `bench --parallel` B=4 72% -> 91% of the bytes bound, a 4-row verify pass 2.31x ->
# 1.78x a step. AVX2 and AVX-512 without VNNI since their int16 partial sums (qk_panel.inc's
# C16), on the same CPU with those kernels forced, against the row kernels: decode 12.0 -> 16.5
# and 12.2 -> 16.2 tok/s, B=4 72% -> 83% and 72% -> 93% of the bytes bound. The NEON builds
# (speed on Apple silicon not measurable here) keep the MLX layout unless POCKET_MLX_PANELS=1.
PANELS_BY_DEFAULT = ("avx512-vnni", "avx512", "avx2")


def panels_available() -> bool:
    """Whether this CPU has panel kernels (x86-64 AVX2 / AVX-512, arm64 with sdot or usdot; not
    plain NEON, not scalar)."""
    return (_ext is not None and hasattr(_ext, "panel_variant")
            and _ext.panel_variant() != "portable")


def panels_wanted() -> bool:
    """Models loaded for the CPU keep their quantized matrices in the panel layout: by default
    where the panel kernels are PANELS_BY_DEFAULT's; POCKET_MLX_PANELS=1 asks for the layout on
    any CPU with panel kernels, POCKET_MLX_PANELS=0 keeps the MLX layout everywhere."""
    if not (panels_available() and enabled()):
        return False
    env = os.environ.get("POCKET_MLX_PANELS", "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    return _ext.panel_variant() in PANELS_BY_DEFAULT


def layout_label() -> str:
    """The weight layout a model loaded for the CPU gets, for `info`: "panels" or "mlx", with
    the switch that changes it."""
    if not panels_available():
        return "mlx (no panel kernels on this CPU)"
    if panels_wanted():
        return f"panels ({_ext.panel_variant()}; POCKET_MLX_PANELS=0 for the MLX layout)"
    return f"mlx (POCKET_MLX_PANELS=1 for the {_ext.panel_variant()} panel layout)"


_packed_count = 0  # matrices packed now (pack_matrix / unpack_matrix): the guard's fast path


class PanelLayoutError(RuntimeError):
    """MLX's own op was about to read a matrix packed into the panel layout (whose MLX pages
    were handed back: it would read zeros and answer garbage without a word)."""


def packed(w) -> bool:
    """Whether `w` (or the matrix it is a view of) is packed into the panel layout."""
    return _packed_count > 0 and isinstance(w, mx.array) and _ext.panel_packed(w)


def check_mlx_layout(w) -> None:
    """Raises PanelLayoutError when `w` is packed: called before MLX's own quantized ops run on
    a weight (the GPU, the extension disabled behind the loader's back, a shape it refuses)."""
    if packed(w):
        raise PanelLayoutError(
            "a quantized matrix is in the CPU panel layout, which only the CPU extension reads; "
            "switch the model with engine.loader.use_device(model, device) (it unpacks), or load "
            "it with POCKET_MLX_PANELS=0")


def pack_matrix(w, scales, biases, *, bits: int, group_size: int) -> int:
    """Packs one evaluated quantized matrix into the CPU panel layout (csrc/core/qk_panel.h) and
    hands its MLX arrays' pages back to the OS: the kernels then read the panels for every call
    with this `w` (which must not be read any other way until `unpack_matrix`). Returns the bytes
    of the panels, 0 when not packed (bits 1/3/5, or no panel kernels on this CPU)."""
    global _packed_count
    n = int(_ext.panel_pack(w, scales, biases, bits=bits, group_size=group_size, release=True))
    if n > 0:
        _packed_count += 1
    return n


def release_matrix(w) -> None:
    """Frees the panels of a packed `w` without rebuilding its MLX arrays (its model is gone)."""
    global _packed_count
    if _ext is not None and _ext.panel_release(w):
        _packed_count -= 1


def unpack_matrix(w):
    """(w, scales, biases) in the MLX layout, from the panels of `w`, written back into the
    packed arrays themselves (so graphs built while packed still read the right bytes); frees
    the panels."""
    global _packed_count
    out = tuple(_ext.panel_unpack(w))
    _packed_count -= 1
    return out
