"""The kernel table: GB/s of weights per core, the 35B model's real shapes.

The latest run is named in docs/BENCHMARKS.md; its JSON is in docs/bench-log/.

Run through `python scripts/bench_kernels.py --table` (see there). For each shape, B = 1, 2, 4,
8 token rows, one and two threads, the project's CPU kernels (kernels.gather_qmm /
kernels.quantized_matmul, whatever they are today) on
  - hot weights: the same matrix call after call (in cache where it fits: the compute speed),
  - DRAM: one copy per call, rotated over >= 1 GiB of copies (each call a different "layer",
    as a decode step reads them; this machine's last-level cache is listed in the JSON),
beside a one-thread read probe over the same arrays in the same pieces (numpy max over each
used expert's packed words, scales and biases, or over the whole matrix's), hot and from DRAM,
and llama.cpp's `test-backend-ops perf` of MUL_MAT / MUL_MAT_ID at the same sizes (Q2_K for
the 2-bit experts, Q4_K for the 4-bit matrices, Q6_K for the 6-bit lm_head; see llamacpp_ops).
GB/s counts the bytes of weights a call reads: the used experts' (distinct among the B tokens'
top-8) or the matrix's packed words + scales + biases (ours: bf16 scale and bias per 64
weights; llama.cpp: its block format's bytes).
Calls are timed in batches (several calls in one evaluation) so MLX's per-evaluation overhead
stays out of the kernel's time; best of a few rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from pocket_mlx import kernels

GS = 64
TOP_K = 8
DRAM_BYTES = 1 << 30  # copies rotated per pass: >= this many bytes of weights
WIDTHS = (1, 2, 4, 8)
THREADS = (1, 2)


@dataclass(frozen=True)
class Shape:
    name: str
    bits: int
    N: int  # output features
    K: int  # input features
    experts: int = 0  # routed experts of the layer (0: a dense matrix)
    shared_x: bool = True  # routed: all 8 experts of a token read the token's row (gate/up)


# Qwen3.5-35B-A3B after pruning to 128 experts (convert/synthetic.py pocket-35b-e128).
SHAPES = (
    Shape("expert gate/up 2048->512 x8/128", 2, 512, 2048, 128, True),
    Shape("expert down 512->2048 x8/128", 2, 2048, 512, 128, False),
    Shape("attn in_proj_qkv 2048->8192", 4, 8192, 2048),
    Shape("shared expert gate+up 2048->1024", 4, 1024, 2048),
    Shape("shared expert down 512->2048", 4, 2048, 512),
    Shape("lm_head 2048->248320", 6, 248320, 2048),
)


def _weights(s: Shape, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """Random packed words and bf16 scales/biases of the shape (the kernels' speed does not
    depend on the values; mx.quantize of a 248320 x 2048 float matrix would need 2 GB)."""
    lead = (s.experts,) if s.experts else ()
    key = mx.random.key(seed)
    w = mx.random.randint(0, 2**31 - 1, (*lead, s.N, s.K * s.bits // 32), key=key)
    w = w.astype(mx.uint32) * 2 + 1  # the top bit too
    sc = (mx.random.uniform(0.001, 0.01, (*lead, s.N, s.K // GS), key=key)).astype(mx.bfloat16)
    bi = (-64 * sc).astype(mx.bfloat16)
    mx.eval(w, sc, bi)
    return w, sc, bi


def _nbytes(arrs) -> int:
    return sum(a.nbytes for a in arrs)


def routing(b: int, experts: int, seed: int = 0) -> np.ndarray:
    """[b, 8] expert ids: each token 8 distinct ones, tokens independent (random routing)."""
    rng = np.random.default_rng(seed + b)
    return np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(b)])


def _call(s: Shape, b: int, ids: mx.array | None):
    """f(w, sc, bi) -> lazy output for B rows."""
    if s.experts:
        x = (mx.random.normal((b, 1, 1, 1, s.K)) if s.shared_x
             else mx.random.normal((b, 1, TOP_K, 1, s.K)))
        mx.eval(x)
        return lambda w, sc, bi: kernels.gather_qmm(x, w, sc, bi, ids, group_size=GS,
                                                    bits=s.bits)
    x = mx.random.normal((b, s.K))
    mx.eval(x)
    return lambda w, sc, bi: kernels.quantized_matmul(x, w, sc, bi, group_size=GS, bits=s.bits)


def _best_per_call(run, calls: int, min_time: float, rounds: int = 3) -> float:
    """Best over `rounds` of the seconds per call; `run()` makes `calls` calls."""
    run()  # warm-up (and page-in)
    best = float("inf")
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while True:
            run()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        best = min(best, dt / (n * calls))
    return best


def _probe(arrays: list[np.ndarray], used: list[int] | None):
    """One thread, np.max over each used expert's slice of each array (or whole arrays)."""
    if used is None:
        return lambda: [a.max() for a in arrays]
    return lambda: [a[e].max() for e in used for a in arrays]


def measure_shape(s: Shape, widths=WIDTHS, threads=THREADS, min_time: float = 0.3,
                  log=print) -> list[dict]:
    """Rows {shape, B, threads, ours/probe GB/s hot and DRAM} for one shape."""
    one = _weights(s, 0)
    size = _nbytes(one)
    copies = max(2, -(-DRAM_BYTES // size))
    stack = [one] + [_weights(s, i) for i in range(1, copies)]
    np_stack = [[np.asarray(w), np.asarray(sc.view(mx.uint16)), np.asarray(bi.view(mx.uint16))]
                for w, sc, bi in stack]
    rows = []
    for b in widths:
        ids_np = routing(b, s.experts) if s.experts else None
        used = sorted(set(ids_np.ravel().tolist())) if s.experts else None
        ids = mx.array(ids_np[:, None, :].astype(np.uint32)) if s.experts else None
        nbytes = size * len(used) / s.experts if s.experts else size
        f = _call(s, b, ids)
        hot_calls = max(1, min(32, int(2e6 // max(1, nbytes))))  # small shapes: more per eval
        hot_args, probes = [one] * hot_calls, [_probe(a, used) for a in np_stack]
        ph = nbytes / _best_per_call(_run_all([probes[0]] * hot_calls), hot_calls,
                                     min_time) / 1e9
        pd = nbytes / _best_per_call(_run_all(probes), copies, min_time) / 1e9
        for t in threads:
            kernels.set_threads(t)
            h = nbytes / _best_per_call(_eval_all(f, hot_args), hot_calls, min_time) / 1e9
            d = nbytes / _best_per_call(_eval_all(f, stack), copies, min_time) / 1e9
            row = {"shape": s.name, "bits": s.bits, "N": s.N, "K": s.K, "experts": s.experts,
                   "B": b, "threads": t, "distinct_experts": len(used) if used else None,
                   "weight_bytes": round(nbytes), "hot_gbps": round(h, 2),
                   "dram_gbps": round(d, 2), "hot_gbps_per_core": round(h / t, 2),
                   "dram_gbps_per_core": round(d / t, 2), "probe_hot_gbps": round(ph, 2),
                   "probe_dram_gbps": round(pd, 2), "dram_copies": copies}
            rows.append(row)
            log(f"{s.name:34s} B={b} t={t}  hot {h:6.2f} GB/s  DRAM {d:6.2f} GB/s  | probe "
                f"(1 thread) hot {ph:6.2f} DRAM {pd:6.2f}")
    kernels.set_threads(None)
    return rows


def _eval_all(f, args):
    """One evaluation of f on every (w, scales, biases) of `args`."""
    return lambda: mx.eval([f(*a) for a in args])


def _run_all(fns):
    return lambda: [fn() for fn in fns]


def machine() -> dict:
    import os
    import subprocess

    from pocket_mlx.analysis.bench import cpu_model

    def lscpu(field: str) -> str | None:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                     if ln.startswith(field)), None)

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
                       "avx512vbmi", "amx_int8", "asimd", "asimddp", "sve")
           if f in flags.split()]
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "isa_flags": isa,
            "l2": lscpu("L2 cache"), "l3": lscpu("L3 cache"), "kernels": kernels.info(),
            "load_average_before": os.getloadavg()}


# -- llama.cpp's test-backend-ops perf at the same sizes ---------------------------------------
# ggml's block formats: bytes per 256 weights (scales included).
GGML_BLOCK_BYTES = {2: ("q2_K", 84), 4: ("q4_K", 144), 6: ("q6_K", 210)}
GGML_TYPE_ENUM = {"q2_K": "GGML_TYPE_Q2_K", "q4_K": "GGML_TYPE_Q4_K", "q6_K": "GGML_TYPE_Q6_K"}

# Cases injected into a private copy of the anchor's tests/test-backend-ops.cpp (its own perf
# list has no 128-expert 512x2048 case); threads from POCKET_PERF_THREADS (it uses cores / 2).
_INJECT_MARK = "static std::vector<std::unique_ptr<test_case>> make_test_cases_perf() {"
_THREADS_LINE = "ggml_backend_set_n_threads_fn(backend.get(), std::max<int>(1, N_THREADS/2));"


def _cases_cpp(widths) -> str:
    lines = []
    for s in SHAPES:
        t = GGML_TYPE_ENUM[GGML_BLOCK_BYTES[s.bits][0]]
        for b in widths:
            if s.experts:
                lines.append(f"    t.emplace_back(new test_mul_mat_id({t}, GGML_TYPE_F32, "
                             f"{s.experts}, {TOP_K}, {'true' if s.shared_x else 'false'}, "
                             f"{s.N}, {b}, {s.K}));")
            else:
                lines.append(f"    t.emplace_back(new test_mul_mat({t}, GGML_TYPE_F32, {s.N}, "
                             f"{b}, {s.K}, {{1, 1}}, {{1, 1}}));")
    return ("static std::vector<std::unique_ptr<test_case>> pocket_perf_cases() {\n"
            "    std::vector<std::unique_ptr<test_case>> t;\n" + "\n".join(lines) +
            "\n    return t;\n}\n\n")


def build_llamacpp_perf(anchor, out_dir, widths=WIDTHS, log=print):
    """A test-backend-ops binary with our cases, built from the anchor's source into `out_dir`
    (the anchor's tree is not touched; linked against its built ggml libraries)."""
    import hashlib
    import subprocess
    from pathlib import Path

    anchor, out_dir = Path(anchor), Path(out_dir)
    src = (anchor / "src" / "tests" / "test-backend-ops.cpp").read_text()
    if _INJECT_MARK not in src or _THREADS_LINE not in src:
        raise SystemExit("the anchor's test-backend-ops.cpp changed: update kernel_table.py")
    src = src.replace(_INJECT_MARK, _cases_cpp(widths) + _INJECT_MARK +
                      '\n    if (getenv("POCKET_PERF_CASES")) { return pocket_perf_cases(); }', 1)
    src = src.replace(_THREADS_LINE, "ggml_backend_set_n_threads_fn(backend.get(), "
                      'getenv("POCKET_PERF_THREADS") ? atoi(getenv("POCKET_PERF_THREADS")) : '
                      "std::max<int>(1, N_THREADS/2));", 1)
    tag = hashlib.sha256(src.encode()).hexdigest()[:12]
    exe = out_dir / f"test-backend-ops-pocket-{tag}"
    if exe.is_file():
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    cpp = out_dir / f"test-backend-ops-pocket-{tag}.cpp"
    cpp.write_text(src)
    lib = anchor / "build" / "bin"
    cmd = ["g++", "-O2", "-std=c++17", "-DNDEBUG", "-I", str(anchor / "src" / "ggml" / "include"),
           str(cpp), "-o", str(exe) + ".tmp", "-L", str(lib), "-lggml", "-lggml-base",
           f"-Wl,-rpath,{lib}", "-lpthread"]
    log("building " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    Path(str(exe) + ".tmp").rename(exe)
    return exe


def llamacpp_rows(exe, widths=WIDTHS, threads=THREADS, log=print) -> list[dict]:
    """test-backend-ops perf -b CPU of our cases, per thread count: weight GB/s per call
    (MUL_MAT_ID: ids reshuffled every run, so the expected distinct experts of B random
    tokens' top-8 are counted)."""
    import os
    import re
    import subprocess

    line = re.compile(r"(MUL_MAT(?:_ID)?)\(([^)]*)\):\s+(\d+) runs -\s+([\d.]+) us/run")
    out = []
    for t in threads:
        env = {**os.environ, "POCKET_PERF_CASES": "1", "POCKET_PERF_THREADS": str(t)}
        proc = subprocess.run([str(exe), "perf", "-b", "CPU"], env=env, capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{exe} failed: {proc.stderr.strip()[-500:]}")
        for op, params, _, us in line.findall(proc.stdout):
            p = dict(kv.split("=", 1) for kv in re.findall(r"(\w+=[^,\[]+|\w+=\[[^]]*\])",
                                                            params))
            b, m, k = int(p["n"]), int(p["m"]), int(p["k"])
            if b not in widths:
                continue
            shape = next(s for s in SHAPES if s.N == m and s.K == k
                         and bool(s.experts) == (op == "MUL_MAT_ID"))
            per_matrix = m * k * GGML_BLOCK_BYTES[shape.bits][1] / 256
            distinct = (shape.experts * (1 - (1 - TOP_K / shape.experts) ** b)
                        if shape.experts else None)
            nbytes = per_matrix * (distinct or 1)
            us = float(us)
            out.append({"shape": shape.name, "B": b, "threads": t,
                        "type": GGML_BLOCK_BYTES[shape.bits][0], "time_us": us,
                        "expected_distinct_experts": distinct, "weight_bytes": round(nbytes),
                        "hot_gbps": round(nbytes / us / 1e3, 2),
                        "hot_gbps_per_core": round(nbytes / us / 1e3 / t, 2)})
            log(f"llama.cpp {op} {shape.name:34s} B={b} t={t} {us:9.1f} us "
                f"{nbytes / us / 1e3:6.2f} GB/s")
    return out


def markdown(ours: list[dict], theirs: list[dict]) -> str:
    """One line per shape, B and thread count: GB/s of weights per core."""
    key = {(r["shape"], r["B"], r["threads"]): r for r in theirs}
    head = ("| shape | B | thr | ours hot | ours DRAM | probe hot (1 thr) | probe DRAM (1 thr) "
            "| llama.cpp hot | ours / llama.cpp (hot) |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ours:
        t = key.get((r["shape"], r["B"], r["threads"]))
        lc = f"{t['hot_gbps_per_core']:.2f}" if t else ""
        ratio = f"{r['hot_gbps_per_core'] / t['hot_gbps_per_core']:.2f}x" if t else ""
        lines.append(f"| {r['shape']} | {r['B']} | {r['threads']} | {r['hot_gbps_per_core']:.2f} "
                     f"| {r['dram_gbps_per_core']:.2f} | {r['probe_hot_gbps']:.2f} "
                     f"| {r['probe_dram_gbps']:.2f} | {lc} | {ratio} |")
    return "\n".join(lines)
