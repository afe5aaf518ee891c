"""`pocket-mlx bench kernels`: the project's CPU quantized kernels against MLX's own CPU ops.

GB/s of quantized weights read (packed words + scales + biases of the rows a call touches) for
- the decode MoE matvecs of the POCKET-35B shape: 8 of 128 experts, gate/up K=2048 -> N=512
  and down K=512 -> N=2048, 2-bit, group 64, bf16 scales (float32 activations), and the whole
  block (gate + up + down);
- 4- and 6-bit 2048 -> 4096 matvecs;
- a prefill-size matmul (M=512) on the 4-bit 2048 x 4096 weight and a prefill MoE (64 tokens x
  top-8, sorted as mlx-lm's SwitchGLU sorts them);
- 1-bit against 2-bit decode (the same weights quantized both ways, interleaved, best of each):
  how much of halving the bytes the kernels turn into speed.
Random weights of these shapes, no model needed. (scripts/bench_kernels.py keeps the per-shape
kernel table against llama.cpp, a developer's tool.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from pocket_mlx import kernels

Say = Callable[[str], None]


def timeit(fn, min_time: float = 0.5, max_iters: int = 2000) -> float:
    """Seconds per call of `fn` (evaluated), after one warm-up, over at least `min_time`."""
    mx.eval(fn())
    n, t0 = 0, time.perf_counter()
    while True:
        mx.eval(fn())
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_time or n >= max_iters:
            return dt / n


def qbytes(w, s, b, frac: float = 1.0) -> float:
    """Bytes of a quantized matrix a call reads (`frac`: the share of experts it touches)."""
    return (w.nbytes + s.nbytes + b.nbytes) * frac


def line(name: str, nbytes: float, t_ours: float, t_mlx: float, flops: float | None = None) -> str:
    """One result: time and GB/s of ours and MLX's, the speed-up (and GFLOP/s for prefill)."""
    gb_o, gb_m = nbytes / t_ours / 1e9, nbytes / t_mlx / 1e9
    extra = f"  {flops / t_ours / 1e9:7.1f} vs {flops / t_mlx / 1e9:5.1f} GFLOP/s" if flops else ""
    return (f"{name:48s} ours {t_ours * 1e3:8.3f} ms {gb_o:7.2f} GB/s | mlx {t_mlx * 1e3:9.3f} ms "
            f"{gb_m:6.2f} GB/s | x{t_mlx / t_ours:6.1f}{extra}")


class MoEShape:
    """The 35B decode MoE's experts (128 of them, 2048 <-> 512, 2-bit g64, bf16 scales), a
    token's activation and its 8 routed experts."""

    E, D, I, K = 128, 2048, 512, 8
    GS, BITS = 64, 2

    def __init__(self) -> None:
        mx.random.seed(0)
        self.Wg = mx.random.normal((self.E, self.I, self.D)).astype(mx.bfloat16) * 0.02
        self.Wd = mx.random.normal((self.E, self.D, self.I)).astype(mx.bfloat16) * 0.02
        self.g = mx.quantize(self.Wg, self.GS, self.BITS)
        self.d = mx.quantize(self.Wd, self.GS, self.BITS)
        mx.eval(*self.g, *self.d)
        self.x = mx.random.normal((1, 1, 1, 1, self.D))
        self.h = mx.random.normal((1, 1, self.K, 1, self.I))
        self.idx = mx.array([[[3, 17, 25, 40, 64, 77, 99, 120]]], dtype=mx.uint32)
        self.frac = self.K / self.E

    def ours(self, x, w, s, b, bits: int | None = None):
        return kernels.gather_qmm(x, w, s, b, self.idx, group_size=self.GS,
                                  bits=bits or self.BITS)

    def mlx(self, x, w, s, b):
        return mx.gather_qmm(x, w, s, b, rhs_indices=self.idx, transpose=True,
                             group_size=self.GS, bits=self.BITS)

    def block(self, gq):
        """The whole decode MoE block: gate, up (the same weight here), SwiGLU, down."""
        g = gq(self.x, *self.g)
        u = gq(self.x, *self.g)
        return gq(g * mx.sigmoid(g) * u, *self.d)


def decode_moe(m: MoEShape, mt: float, say: Say) -> None:
    for name, x, (w, s, b) in (("moe gate/up 2048->512 x8 of 128 (2b g64)", m.x, m.g),
                               ("moe down 512->2048 x8 of 128 (2b g64)", m.h, m.d)):
        t_o = timeit(lambda x=x, w=w, s=s, b=b: m.ours(x, w, s, b), mt)
        t_m = timeit(lambda x=x, w=w, s=s, b=b: m.mlx(x, w, s, b), mt)
        say(line(name, qbytes(w, s, b, m.frac), t_o, t_m))
    nbytes = qbytes(*m.g, m.frac) * 2 + qbytes(*m.d, m.frac)
    say(line("moe block gate+up+down (8 experts)", nbytes,
             timeit(lambda: m.block(m.ours), mt), timeit(lambda: m.block(m.mlx), mt)))


def dense(m: MoEShape, mt: float, say: Say) -> None:
    """4- and 6-bit decode matvecs, a 512-row prefill matmul, a prefill MoE (sorted rows)."""
    K, N = 2048, 4096
    W = mx.random.normal((N, K)) * 0.02
    xv = mx.random.normal((1, K))
    for bits in (4, 6):
        w, s, b = mx.quantize(W, 64, bits)
        mx.eval(w, s, b)
        t_o = timeit(lambda w=w, s=s, b=b, bits=bits: kernels.quantized_matmul(
            xv, w, s, b, group_size=64, bits=bits), mt)
        t_m = timeit(lambda w=w, s=s, b=b, bits=bits: mx.quantized_matmul(
            xv, w, s, b, transpose=True, group_size=64, bits=bits), mt)
        say(line(f"matvec 2048->4096 {bits}b g64 (f32 scales)", qbytes(w, s, b), t_o, t_m))
    w, s, b = mx.quantize(W, 64, 4)
    xm = mx.random.normal((512, K))
    mx.eval(w, s, b, xm)
    say(line("prefill M=512 2048->4096 4b g64", qbytes(w, s, b),
             timeit(lambda: kernels.quantized_matmul(xm, w, s, b, group_size=64, bits=4), mt, 50),
             timeit(lambda: mx.quantized_matmul(xm, w, s, b, transpose=True, group_size=64,
                                                bits=4), mt, 5),
             flops=2 * 512 * K * N))
    T = 64
    flat = mx.random.randint(0, m.E, (T, m.K)).astype(mx.uint32).flatten()
    order = mx.argsort(flat)
    xs = mx.random.normal((T, 1, 1, m.D)).flatten(0, -3)[order // m.K]
    si = flat[order]
    mx.eval(xs, si)
    wg, sg, bg = m.g
    say(line(f"prefill MoE {T} tok x8, sorted, 2048->512 2b", qbytes(wg, sg, bg),
             timeit(lambda: kernels.gather_qmm(xs, wg, sg, bg, si, group_size=m.GS, bits=m.BITS,
                                               sorted_indices=True), mt, 50),
             timeit(lambda: mx.gather_qmm(xs, wg, sg, bg, rhs_indices=si, transpose=True,
                                          group_size=m.GS, bits=m.BITS, sorted_indices=True),
                    mt, 5),
             flops=2 * T * m.K * m.D * m.I))


def one_vs_two_bits(m: MoEShape, mt: float, say: Say, rounds: int = 5) -> None:
    """Decode GEMVs with the same weights at 1 and 2 bits (group 64), interleaved `rounds`
    times, best of each: how much of halving the bytes the kernels turn into speed."""
    gs, K, N = 64, 2048, 4096
    W = mx.random.normal((N, K)) * 0.02
    xv = mx.random.normal((1, K))
    cases = []
    for name, src, x, gathered in (("moe gate/up 2048->512 x8 of 128", m.Wg, m.x, True),
                                   ("moe down 512->2048 x8 of 128", m.Wd, m.h, True),
                                   ("matvec 2048->4096 (f32 scales)", W, xv, False)):
        fns = {}
        for bits in (1, 2):
            w, s, b = mx.quantize(src, gs, bits)
            mx.eval(w, s, b)
            if gathered:
                f = lambda x=x, w=w, s=s, b=b, bits=bits: m.ours(x, w, s, b, bits)  # noqa: E731
            else:
                f = lambda x=x, w=w, s=s, b=b, bits=bits: kernels.quantized_matmul(  # noqa: E731
                    x, w, s, b, group_size=gs, bits=bits)
            fns[bits] = (f, qbytes(w, s, b, m.frac if gathered else 1.0))
        cases.append((name, fns))
    say(f"1-bit vs 2-bit decode, g{gs}, {kernels.label()} ({kernels.info().get('variant')}), "
        f"best of {rounds} interleaved rounds")
    for name, fns in cases:
        best = {1: float("inf"), 2: float("inf")}
        for _ in range(rounds):
            for bits in (2, 1):
                best[bits] = min(best[bits], timeit(fns[bits][0], mt / 2))
        gb = {b: fns[b][1] / best[b] / 1e9 for b in (1, 2)}
        say(f"{name:36s} 1-bit {best[1] * 1e6:8.1f} us {gb[1]:6.2f} GB/s | 2-bit "
            f"{best[2] * 1e6:8.1f} us {gb[2]:6.2f} GB/s | 1-bit x{best[2] / best[1]:5.2f} faster, "
            f"bytes x{fns[2][1] / fns[1][1]:4.2f} fewer")


def run(*, threads: int | None = None, mode: str = "exact", quick: bool = False,
        only_1bit: bool = False, say: Say = print) -> bool:
    """Every section above on the CPU (`quick`: shorter timings); False where the extension is
    not active (nothing to compare)."""
    mx.set_default_device(mx.cpu)
    if not kernels.enabled():
        say(f"kernels: {kernels.info()}: the extension is not active, nothing to compare")
        return False
    kernels.set_threads(threads or None)
    kernels.set_mode(mode)
    say(f"kernels: {kernels.label()} ({kernels.info().get('variant')})")
    mt = 0.2 if quick else 0.5
    m = MoEShape()
    if not only_1bit:
        decode_moe(m, mt, say)
        dense(m, mt, say)
    one_vs_two_bits(m, mt, say)
    return True
