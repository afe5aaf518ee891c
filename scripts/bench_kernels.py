#!/usr/bin/env python
"""Micro benchmark: pocket-mlx CPU quantized kernels vs MLX's own CPU ops.

Reports GB/s of quantized weights (packed words + scales + biases actually read) for
  - decode MoE matvec of the POCKET-35B shape: 8 of 128 experts, gate/up K=2048 -> N=512 and
    down K=512 -> N=2048, 2-bit, group 64, bf16 scales (float32 activations),
  - a 4-bit 2048x4096 matvec (K=2048 -> N=4096, g64),
  - a prefill-size matmul (M=512) on the 4-bit 2048x4096 weight and a prefill MoE (sorted),
  - 1-bit vs 2-bit decode (same weights quantized both ways, interleaved, best of each): the
    MoE gate/up and down matvecs and a 2048->4096 matvec; the ratio is the 1-bit speed-up.
Usage: python scripts/bench_kernels.py [--threads N] [--mode exact|fast] [--quick] [--only-1bit]

`--table` instead runs the kernel table (scripts/kernel_table.py; docs/BENCHMARKS.md names the
latest run): GB/s of weights per core for every real shape of the 35B model (2-bit experts,
4-bit attention and shared expert, 6-bit lm_head), B = 1, 2, 4, 8, one and two threads, hot and
from DRAM, a one-thread read probe beside it, and llama.cpp's `test-backend-ops perf` at the
same sizes (from the anchor build, --llamacpp; `none` skips it). It writes the JSON (--out) and
prints the table:
    python scripts/bench_kernels.py --table [--mode fast] [--llamacpp ~/.cache/llamacpp-anchor]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mlx.core as mx

from pocket_mlx import kernels


def timeit(fn, min_time=0.5, max_iters=2000):
    mx.eval(fn())  # warm-up
    n, t0 = 0, time.perf_counter()
    while True:
        mx.eval(fn())
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_time or n >= max_iters:
            return dt / n


def qbytes(w, s, b, frac=1.0):
    return (w.nbytes + s.nbytes + b.nbytes) * frac


def report(name, nbytes, t_ours, t_mlx, flops=None):
    gb_o, gb_m = nbytes / t_ours / 1e9, nbytes / t_mlx / 1e9
    extra = ""
    if flops:
        extra = f"  {flops / t_ours / 1e9:7.1f} vs {flops / t_mlx / 1e9:5.1f} GFLOP/s"
    print(f"{name:48s} ours {t_ours * 1e3:8.3f} ms {gb_o:7.2f} GB/s | mlx {t_mlx * 1e3:9.3f} ms "
          f"{gb_m:6.2f} GB/s | x{t_mlx / t_ours:6.1f}{extra}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--mode", default=None, help="exact (default) or fast (--table's default: "
                    "the mode the model runs in)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-1bit", action="store_true", help="only the 1-bit vs 2-bit section")
    ap.add_argument("--table", action="store_true",
                    help="the per-shape kernel table (see the docstring)")
    ap.add_argument("--out", default=None,
                    help="--table's JSON (default: "
                         "docs/bench-log/bench-kernels-table-<variant>.json)")
    ap.add_argument("--llamacpp", default="~/.cache/llamacpp-anchor",
                    help="--table: the llama.cpp anchor (src/ and build/bin/), or none")
    ap.add_argument("--only", default=None, help="--table: shapes whose name contains this")
    ap.add_argument("--part", choices=["all", "ours", "llamacpp"], default="all",
                    help="--table: run one side only and merge it into the JSON --out already "
                         "holds (two shorter runs under the machine lock)")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    if args.table:
        args.mode = args.mode or "fast"
        table(args)
        return
    args.mode = args.mode or "exact"
    print("kernels:", kernels.info())
    if not kernels.enabled():
        print("extension not active; nothing to compare")
        return
    kernels.set_threads(args.threads or None)
    kernels.set_mode(args.mode)
    print("kernels:", kernels.info())
    mt = 0.2 if args.quick else 0.5

    # --- decode MoE, 35B shape (128 experts kept, top-8), 2-bit g64, bf16 scales
    E, D, I, k = 128, 2048, 512, 8
    gs, bits = 64, 2
    mx.random.seed(0)
    Wg = mx.random.normal((E, I, D)).astype(mx.bfloat16) * 0.02
    Wd = mx.random.normal((E, D, I)).astype(mx.bfloat16) * 0.02
    wg, sg, bg = mx.quantize(Wg, gs, bits)
    wd, sd, bd = mx.quantize(Wd, gs, bits)
    mx.eval(wg, sg, bg, wd, sd, bd)
    x = mx.random.normal((1, 1, 1, 1, D))
    idx = mx.array([[[3, 17, 25, 40, 64, 77, 99, 120]]], dtype=mx.uint32)
    h = mx.random.normal((1, 1, k, 1, I))
    frac = k / E
    if args.only_1bit:
        one_vs_two_bits(Wg, Wd, x, h, idx, frac, mt)
        return
    for name, xx, w, s, b in (("moe gate/up 2048->512 x8 of 128 (2b g64)", x, wg, sg, bg),
                              ("moe down 512->2048 x8 of 128 (2b g64)", h, wd, sd, bd)):
        f_o = lambda xx=xx, w=w, s=s, b=b: kernels.gather_qmm(xx, w, s, b, idx, group_size=gs,  # noqa: E731
                                                               bits=bits)
        f_m = lambda xx=xx, w=w, s=s, b=b: mx.gather_qmm(xx, w, s, b, rhs_indices=idx,  # noqa: E731
                                                          transpose=True, group_size=gs, bits=bits)
        report(name, qbytes(w, s, b, frac), timeit(f_o, mt), timeit(f_m, mt))

    # Whole decode MoE block (gate + up + down = 3 matmuls), ours only vs mlx.
    def moe_block(gq):
        g = gq(x, wg, sg, bg)
        u = gq(x, wg, sg, bg)
        a = g * mx.sigmoid(g) * u
        return gq(a, wd, sd, bd)

    ours_g = lambda xx, w, s, b: kernels.gather_qmm(xx, w, s, b, idx, group_size=gs, bits=bits)  # noqa: E731
    mlx_g = lambda xx, w, s, b: mx.gather_qmm(xx, w, s, b, rhs_indices=idx, transpose=True,  # noqa: E731
                                              group_size=gs, bits=bits)
    report("moe block gate+up+down (8 experts)", qbytes(wg, sg, bg, frac) * 2 + qbytes(wd, sd, bd, frac),
           timeit(lambda: moe_block(ours_g), mt), timeit(lambda: moe_block(mlx_g), mt))

    # --- 4-bit 2048 x 4096 matvec (and a 2-bit / 6-bit variant)
    K, N = 2048, 4096
    W = mx.random.normal((N, K)) * 0.02
    for b_, name in ((4, "matvec 2048->4096 4b g64 (f32 scales)"),
                     (6, "matvec 2048->4096 6b g64 (f32 scales)")):
        w, s, b = mx.quantize(W, 64, b_)
        mx.eval(w, s, b)
        xv = mx.random.normal((1, K))
        f_o = lambda xv=xv, w=w, s=s, b=b, b_=b_: kernels.quantized_matmul(  # noqa: E731
            xv, w, s, b, group_size=64, bits=b_)
        f_m = lambda xv=xv, w=w, s=s, b=b, b_=b_: mx.quantized_matmul(  # noqa: E731
            xv, w, s, b, transpose=True, group_size=64, bits=b_)
        report(name, qbytes(w, s, b), timeit(f_o, mt), timeit(f_m, mt))

    # --- prefill M=512 on the 4-bit 2048x4096 weight
    w, s, b = mx.quantize(W, 64, 4)
    xm = mx.random.normal((512, K))
    mx.eval(w, s, b, xm)
    fl = 2 * 512 * K * N
    report("prefill M=512 2048->4096 4b g64", qbytes(w, s, b),
           timeit(lambda: kernels.quantized_matmul(xm, w, s, b, group_size=64, bits=4), mt, 50),
           timeit(lambda: mx.quantized_matmul(xm, w, s, b, transpose=True, group_size=64, bits=4),
                  mt, 5), flops=fl)

    # --- prefill MoE: 64 tokens x top-8, sorted like mlx-lm's SwitchGLU (gate/up shape)
    T = 64
    ind = mx.random.randint(0, E, (T, k)).astype(mx.uint32)
    flat = ind.flatten()
    order = mx.argsort(flat)
    xs = mx.random.normal((T, 1, 1, D)).flatten(0, -3)[order // k]
    si = flat[order]
    mx.eval(xs, si)
    fl = 2 * T * k * D * I
    report(f"prefill MoE {T} tok x8, sorted, 2048->512 2b", qbytes(wg, sg, bg),
           timeit(lambda: kernels.gather_qmm(xs, wg, sg, bg, si, group_size=gs, bits=bits,
                                             sorted_indices=True), mt, 50),
           timeit(lambda: mx.gather_qmm(xs, wg, sg, bg, rhs_indices=si, transpose=True,
                                        group_size=gs, bits=bits, sorted_indices=True), mt, 5),
           flops=fl)

    one_vs_two_bits(Wg, Wd, x, h, idx, frac, mt)


def table(args) -> None:
    """--table: ours (and llama.cpp's) per shape, B and thread count; JSON written, then the
    markdown printed."""
    import kernel_table as kt  # scripts/ (this script's folder is on sys.path)

    if not kernels.enabled():
        raise SystemExit("the CPU kernels are not active: nothing to measure")
    kernels.set_mode(args.mode)
    info = kt.machine()
    print("machine:", json.dumps(info), flush=True)
    shapes = [s for s in kt.SHAPES if not args.only or args.only in s.name]
    out = Path(args.out or Path(__file__).resolve().parents[1] / "docs" / "bench-log" /
               f"bench-kernels-table-{info['kernels'].get('variant', 'none')}.json")
    old = json.loads(out.read_text()) if args.part != "all" and out.is_file() else {}
    ours, theirs, exe = old.get("ours", []), old.get("llamacpp", []), old.get("llamacpp_binary")
    if args.part in ("all", "ours"):
        ours = []
        for s in shapes:
            ours += kt.measure_shape(s, min_time=0.15 if args.quick else 0.3)
    if args.llamacpp != "none" and args.part in ("all", "llamacpp"):
        anchor = Path(args.llamacpp).expanduser()
        exe = kt.build_llamacpp_perf(anchor, Path.home() / ".cache" / "pocket-mlx" / "llamacpp-perf")
        theirs = [r for r in kt.llamacpp_rows(exe) if any(s.name == r["shape"] for s in shapes)]
    info["load_average_after"] = os.getloadavg()
    runs = old.get("runs", []) + [{"part": args.part, "load_average_before":
                                   info["load_average_before"], "load_average_after":
                                   info["load_average_after"], "utc": time.strftime(
                                       "%Y-%m-%d %H:%M:%S", time.gmtime())}]
    doc = {"machine": info, "runs": runs, "mode": args.mode, "command": "python scripts/bench_kernels.py --table "
           f"--mode {args.mode}", "llamacpp_binary": str(exe) if exe else None,
           "ours": ours, "llamacpp": theirs}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}\n")
    print(kt.markdown(ours, theirs))


def one_vs_two_bits(Wg, Wd, x, h, idx, frac, mt, rounds=5):
    """Decode GEMVs with the same weights at 1 and 2 bits (group 64), interleaved `rounds` times,
    best of each: how much of halving the bytes the kernels turn into speed."""
    gs = 64
    K, N = 2048, 4096
    W = mx.random.normal((N, K)) * 0.02
    xv = mx.random.normal((1, K))
    cases = []
    for name, src, xx, gathered in (("moe gate/up 2048->512 x8 of 128", Wg, x, True),
                                    ("moe down 512->2048 x8 of 128", Wd, h, True),
                                    ("matvec 2048->4096 (f32 scales)", W, xv, False)):
        fns = {}
        for bits in (1, 2):
            w, s, b = mx.quantize(src, gs, bits)
            mx.eval(w, s, b)
            nb = qbytes(w, s, b, frac if gathered else 1.0)
            if gathered:
                f = lambda xx=xx, w=w, s=s, b=b, bits=bits: kernels.gather_qmm(  # noqa: E731
                    xx, w, s, b, idx, group_size=gs, bits=bits)
            else:
                f = lambda xx=xx, w=w, s=s, b=b, bits=bits: kernels.quantized_matmul(  # noqa: E731
                    xx, w, s, b, group_size=gs, bits=bits)
            fns[bits] = (f, nb)
        cases.append((name, fns))
    print(f"1-bit vs 2-bit decode, g{gs}, {kernels.label()} ({kernels.info().get('variant')}), "
          f"best of {rounds} interleaved rounds", flush=True)
    for name, fns in cases:
        best = {1: float("inf"), 2: float("inf")}
        for _ in range(rounds):
            for bits in (2, 1):
                best[bits] = min(best[bits], timeit(fns[bits][0], mt / 2))
        gb = {b_: fns[b_][1] / best[b_] / 1e9 for b_ in (1, 2)}
        print(f"{name:36s} 1-bit {best[1] * 1e6:8.1f} us {gb[1]:6.2f} GB/s | 2-bit "
              f"{best[2] * 1e6:8.1f} us {gb[2]:6.2f} GB/s | 1-bit x{best[2] / best[1]:5.2f} faster, "
              f"bytes x{fns[2][1] / fns[1][1]:4.2f} fewer", flush=True)


if __name__ == "__main__":
    main()
