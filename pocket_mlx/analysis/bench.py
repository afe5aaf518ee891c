"""Throughput benchmark in the manner of llama-bench: pp (prefill) and tg (decode) tok/s.

Decode is bound by memory bandwidth, so each tg row also reports the bytes of weights read per
token, the GB/s that implies, and the fraction of this machine's measured read bandwidth (the
roofline; the bandwidth is probed right before and after each tg run, see run_tests). pp rows leave those blank: prefill reads each weight once per batch, so a per-token
bandwidth figure would be meaningless there.

Semantics (as llama-bench): `ppP` prefills P random tokens into an empty cache; `tgN` decodes N
tokens after a 4-token prompt, timed from the first decoded token. With a depth D (`-d`,
llama-bench's `--n-depth`) both run after D random tokens already in the cache (prefilled
untimed), named `ppP @ dD` / `tgN @ dD`: agents keep 10-30k tokens of context, and every step
then also reads the attention's cache. Each test runs once as a
warm-up (at reduced size), then `repeats` times; with the mlx-lm comparison the runs interleave
(ours, theirs, ours, ...), so machine noise hits both alike.
"""

from __future__ import annotations

import csv
import importlib
import importlib.metadata as md
import io
import json
import os
import platform as pyplatform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from pocket_mlx import kernels, units
from pocket_mlx.engine import devices, prompt_cache
from pocket_mlx.engine.drafters import DEFAULT_NUM_DRAFT_TOKENS
from pocket_mlx.engine.generation import stream_generate
from pocket_mlx.models.fusion import unfused_parameters
from pocket_mlx.system.host import get_platform, total_ram_bytes

TG_PROMPT = 4  # tokens before a tg test, as llama-bench's short prompt
WARMUP_PP = 8  # warm-up sizes: enough to touch every code path, cheap on a slow CPU
WARMUP_TG = 2


# -- kernels and machine -----------------------------------------------------------------------
def set_threads(n: int | None) -> int:
    """Apply a thread count to what the project controls; return the effective count.

    Without the kernels module, MLX runs CPU ops on a single worker thread: the count is 1.
    """
    if not kernels.info()["active"]:
        return 1
    if n:
        kernels.set_threads(n)
    return int(kernels.info().get("threads", n or 1))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    brand = get_platform().sysctl_read("machdep.cpu.brand_string")
    return brand or pyplatform.processor() or pyplatform.machine()


def machine_info(bandwidth_gbps: float | None) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": total_ram_bytes(),
        "os": get_platform().os_label(),
        "gpu": devices.gpu_backend_name(),
        "mlx": getattr(mx, "__version__", None) or version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "kernels": kernels.label(),
        "bandwidth_gbps": round(bandwidth_gbps, 2) if bandwidth_gbps else None,
    }


# -- bandwidth probe ---------------------------------------------------------------------------
def probe_bandwidth(device: str = "cpu", threads: int = 1, quick: bool = True) -> float:
    """Memory read bandwidth in GB/s: best of a few reductions over an array far above cache.

    CPU: numpy max over int64 in `threads` threads (numpy releases the GIL), which ran closest
    to the copy bandwidth here. GPU: an MLX sum on the device.
    """
    nbytes = (256 if quick else 1024) << 20
    reps = 3 if quick else 7
    if device == "gpu":
        a = mx.ones((nbytes // 4,), mx.float32, stream=devices.stream_for("gpu"))
        mx.eval(a)
        best = float("inf")
        with mx.stream(devices.stream_for("gpu")):
            for _ in range(reps):
                t = time.perf_counter()
                mx.eval(a.sum())
                best = min(best, time.perf_counter() - t)
        return units.gbps(nbytes, best)
    a = np.ones(nbytes // 8, np.int64)
    parts = np.array_split(a, max(1, threads))
    best = float("inf")
    with ThreadPoolExecutor(max(1, threads)) as ex:
        for _ in range(reps):
            t = time.perf_counter()
            list(ex.map(np.max, parts))
            best = min(best, time.perf_counter() - t)
    return units.gbps(nbytes, best)


# -- runners -----------------------------------------------------------------------------------
class _NullDetokenizer:
    def add(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class NullTokenizer:
    """Token ids only: no EOS (decode always runs the full N tokens), no text."""

    eos_token_ids: list[int] = []

    def detokenizer(self) -> _NullDetokenizer:
        return _NullDetokenizer()


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


@dataclass
class Runner:
    """One implementation: `pp(ids, cache) -> tok/s` and `tg(ids, n, cache) -> tok/s`, and
    `prime(ids) -> cache`: a cache holding `ids` (None for no ids), made untimed."""

    name: str
    pp: Callable[..., float]
    tg: Callable[..., float]
    prime: Callable[[list[int]], object] = lambda ids: None


def pocket_runner(model, device: str, prefill_step: int = 512, speculative: str = "off",
                  num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS) -> Runner:
    """`speculative` (bench --speculative) applies to tg: random prompt tokens give lookup
    little to match, so measure it on a copy-heavy prompt (scripts/bench_speculative.py)."""
    tok = NullTokenizer()
    primed: dict[tuple[int, ...], list] = {}  # the last primed ids -> a detached snapshot

    def prime(ids: list[int]) -> list | None:
        """A fresh cache holding `ids`. The same ids again (every run at one depth) restore a
        snapshot of the first prefill instead of prefilling again: at depth 16k that prefill
        takes minutes on a 2-core CPU, and each run then starts from the same state."""
        if not ids:
            return None
        key = tuple(ids)
        if key not in primed:
            primed.clear()  # one depth at a time: its snapshot is the cache's size
            cache = model.make_cache()
            for _ in stream_generate(model, tok, ids, max_tokens=1, device=device,
                                     prefill_step=prefill_step, cache=cache):
                pass
            primed[key] = prompt_cache.capture(cache, detach=True)
            del cache
        return prompt_cache.restore(model.make_cache(), primed[key])

    def pp(ids: list[int], cache=None) -> float:
        *_, last = stream_generate(model, tok, ids, max_tokens=1, device=device,
                                   prefill_step=prefill_step, cache=cache)
        return last.stats.prompt_tps

    def tg(ids: list[int], n: int, cache=None) -> float:
        *_, last = stream_generate(model, tok, ids, max_tokens=n + 1, device=device,
                                   prefill_step=prefill_step, speculative=speculative,
                                   num_draft_tokens=num_draft_tokens, cache=cache)
        return last.stats.generation_tps

    return Runner("pocket-mlx", pp, tg, prime)


def mlx_lm_generate_module(device: str):
    """mlx-lm's generate module with its generation stream on `device`.

    mlx-lm creates `generation_stream` at import time on the then-default device, and a later
    `mx.set_default_device` does not move it (see engine/devices.py). So we set the default
    device first and, if the module was already imported (a test or script did), point its
    module-level stream at the right device: `generate_step` reads that global at call time.
    """
    dev = devices.mx_device(device)
    mx.set_default_device(dev)
    gen = importlib.import_module("mlx_lm.generate")
    if gen.generation_stream.device != dev:
        gen.generation_stream = mx.new_stream(dev)
    return gen


def mlx_lm_model(path, ours):
    """Stock mlx-lm's model of the same checkpoint, sharing our loaded arrays.

    `mlx_lm.utils.load_model(lazy=True)` builds and validates mlx-lm's module tree from the
    checkpoint (strict names and shapes); its lazily mapped arrays are then replaced by the very
    arrays our model holds (same names, same values: mlx-lm's sanitize is the identity on an MLX
    checkpoint), so both run the same weights in the same dtype and RAM holds one copy.
    """
    # Lazy: importing mlx_lm imports transformers (0.9-2.3 s); only --vs-mlx-lm needs it.
    from mlx_lm.utils import load_model

    theirs, _ = load_model(path, lazy=True)
    mine = dict(unfused_parameters(ours))  # views of our fused projections, if any
    want = dict(tree_flatten(theirs.parameters()))
    # A multi-token-prediction head (models/qwen3_5_moe.py `mtp`, for speculative decoding)
    # is not part of mlx-lm's model: its weights are left out of the comparison.
    mine = {k: v for k, v in mine.items() if not k.startswith("mtp.") or k in want}
    if set(mine) != set(want):
        diff = sorted(set(mine) ^ set(want))
        raise RuntimeError(f"mlx-lm's module tree differs from ours: {diff[:3]}")
    for k, v in want.items():
        if tuple(v.shape) != tuple(mine[k].shape):
            raise RuntimeError(f"mlx-lm shape differs for {k}: {v.shape} vs {mine[k].shape}")
    theirs.update(tree_unflatten(list(mine.items())))
    theirs.eval()
    return theirs


def mlx_lm_runner(model, device: str, prefill_step: int = 512) -> Runner:
    gen = mlx_lm_generate_module(device)

    def prime(ids: list[int]):
        if not ids:
            return None
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        steps = gen.generate_step(mx.array(ids, mx.uint32), model, max_tokens=1,
                                  prefill_step_size=prefill_step, prompt_cache=cache)
        next(steps)
        steps.close()
        return cache

    def pp(ids: list[int], cache=None) -> float:
        t0 = time.perf_counter()
        steps = gen.generate_step(mx.array(ids, mx.uint32), model, max_tokens=1,
                                  prefill_step_size=prefill_step, prompt_cache=cache)
        next(steps)
        dt = time.perf_counter() - t0
        steps.close()
        return len(ids) / dt

    def tg(ids: list[int], n: int, cache=None) -> float:
        steps = gen.generate_step(mx.array(ids, mx.uint32), model, max_tokens=n + 1,
                                  prefill_step_size=prefill_step, prompt_cache=cache)
        next(steps)
        t0 = time.perf_counter()
        count = sum(1 for _ in steps)
        return count / (time.perf_counter() - t0)

    return Runner("mlx-lm", pp, tg, prime)


# -- the benchmark -----------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    size_bytes: int
    params_total: int
    params_active: int
    recipe: str
    dtype: str
    device: str
    threads: int
    kernels: str
    test: str
    tps_mean: float
    tps_sd: float
    bytes_per_token: int
    gbps: float | None
    roofline_fraction: float | None
    runs: list[float] = field(default_factory=list)
    mlx_lm_tps_mean: float | None = None
    mlx_lm_tps_sd: float | None = None
    ratio_vs_mlx_lm: float | None = None
    mlx_lm_runs: list[float] | None = None
    bandwidth_runs: list[float] | None = None  # GB/s probed around each tg run (see run_tests)
    speculative: str = "off"  # bench --speculative (and K) the tg runs decoded with
    # bench --parallel (analysis/parallel.py): B sequences decoded together, tps_mean is the
    # aggregate; bytes_per_token is the B-step's bytes / B.
    parallel: int | None = None
    bytes_bound_x: float | None = None  # B x bytes(one sequence's step) / bytes(B-step)
    distinct_experts_per_layer: float | None = None  # routed experts a B-step reads, per layer
    step_bytes: int | None = None  # bytes of one B-step
    speedup_x: float | None = None  # tps_mean / the B=1 row's (when B=1 ran)
    vs_bound: float | None = None  # speedup_x / bytes_bound_x
    depth: int = 0  # tokens already in the cache when the test ran (bench -d)
    # Of a tg row's bytes_per_token: the KV cache's positions a step reads (at the run's mean
    # position: depth + the prompt + half the tokens), beside the weights.
    kv_bytes_per_token: int = 0


def kv_bytes_per_position(model) -> int:
    """Bytes of keys and values one position holds in the full-attention layers' caches (what a
    decode step reads per token of context), in the cache's storage type."""
    a = model.args
    n = sum(1 for layer in model.layers if not layer.is_linear)
    item = model.kv_cache_dtype.size if getattr(model, "kv_cache_dtype", None) else 4
    return n * a.num_key_value_heads * 2 * a.head_dim * item


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def test_name(kind: str, size: int, depth: int) -> str:
    """llama-bench's names: pp512, tg128, pp512 @ d4096."""
    return f"{kind}{size}" + (f" @ d{depth}" if depth else "")


def test_depth(test: str) -> int:
    return int(test.rpartition(" @ d")[2]) if " @ d" in test else 0


def run_tests(runners: list[Runner], *, vocab: int, p: int, n: int, repeats: int,
              log: Callable[[str], None] = lambda s: None,
              probe: Callable[[], float] | None = None,
              depths: tuple[int, ...] = (0,)) -> dict[str, dict[str, list[float]]]:
    """tok/s of every run: {test: {runner name: [runs]}}, runs interleaved across runners;
    each test once per depth in `depths` (the cache primed with that many tokens, untimed).

    With `probe`, the memory bandwidth is measured right before and right after each of the
    first runner's tg runs, and their mean is kept under {test: {BANDWIDTH_KEY: [...]}}: on a
    shared machine (a VM) the bandwidth moves by tens of percent within minutes, so a roofline
    fraction is only meaningful against the bandwidth of the same minutes.
    """
    out: dict[str, dict[str, list[float]]] = {}
    for r in runners:
        log(f"warm-up {r.name}")
        if p:
            r.pp(random_ids(vocab, min(p, WARMUP_PP), 1))
        if n:
            r.tg(random_ids(vocab, TG_PROMPT, 2), min(n, WARMUP_TG))
    tests = [(test_name(kind, size, d), kind, d) for d in depths
             for kind, size in (("pp", p), ("tg", n)) if size]
    for test, kind, depth in tests:
        out[test] = {r.name: [] for r in runners}
        for i in range(repeats):
            for j, r in enumerate(runners):
                cache = r.prime(random_ids(vocab, depth, 300)) if depth else None
                probed = probe is not None and kind == "tg" and j == 0
                before = probe() if probed else 0.0
                if kind == "pp":
                    tps = r.pp(random_ids(vocab, p, 100 + i), cache)
                else:
                    tps = r.tg(random_ids(vocab, TG_PROMPT, 200 + i), n, cache)
                out[test][r.name].append(tps)
                note = ""
                if probed:
                    bw = (before + probe()) / 2
                    out[test].setdefault(BANDWIDTH_KEY, []).append(bw)
                    note = f" (read bandwidth around it: {bw:.1f} GB/s)"
                log(f"{test} {r.name} run {i + 1}/{repeats}: {tps:.3f} tok/s{note}")
    return out


BANDWIDTH_KEY = "bandwidth_gbps"


def make_rows(results: dict, meta: dict, bandwidth_gbps: float | None) -> list[Row]:
    """One row per test. The roofline fraction of a tg row uses the bandwidth probed around its
    runs when run_tests measured it (per run, then averaged), else `bandwidth_gbps`."""
    rows = []
    meta = dict(meta)
    per_position = meta.pop("kv_bytes_per_position", 0)
    for test, by_runner in results.items():
        ours = by_runner["pocket-mlx"]
        m, sd = mean_sd(ours)
        gbps = frac = None
        around = by_runner.get(BANDWIDTH_KEY)
        depth, kv = test_depth(test), 0
        row_meta = meta
        if test.startswith("tg"):
            n = int(test[2:].partition(" ")[0])
            kv = int(per_position * (depth + TG_PROMPT + n / 2))
            row_meta = {**meta, "bytes_per_token": meta["bytes_per_token"] + kv}
            gbps = row_meta["bytes_per_token"] * m / units.GB
            if around:
                frac = statistics.fmean(row_meta["bytes_per_token"] * t / units.GB / bw
                                        for t, bw in zip(ours, around))
            elif bandwidth_gbps:
                frac = gbps / bandwidth_gbps
        row = Row(test=test, tps_mean=m, tps_sd=sd, gbps=gbps, roofline_fraction=frac,
                  runs=ours, bandwidth_runs=around, depth=depth, kv_bytes_per_token=kv,
                  **row_meta)
        if "mlx-lm" in by_runner:
            tm, tsd = mean_sd(by_runner["mlx-lm"])
            row.mlx_lm_tps_mean, row.mlx_lm_tps_sd = tm, tsd
            row.ratio_vs_mlx_lm = m / tm if tm else None
            row.mlx_lm_runs = by_runner["mlx-lm"]
        rows.append(row)
    return rows


# -- formatting --------------------------------------------------------------------------------
def _tps(m: float | None, sd: float | None) -> str:
    if m is None:
        return ""
    prec = 2 if m >= 1 else 3
    return f"{m:.{prec}f} ± {sd or 0:.{prec}f}"


def format_markdown(rows: list[Row]) -> str:
    compare = any(r.mlx_lm_tps_mean is not None for r in rows)
    head = ["model", "size", "params (total / active)", "recipe", "dtype", "device", "threads",
            "kernels", "test", "t/s", "bytes/token", "GB/s", "roofline"]
    if compare:
        head += ["mlx-lm t/s", "vs mlx-lm"]
    par = any(r.parallel is not None for r in rows)
    if par:
        head += ["B", "distinct experts", "bytes bound", "vs B=1", "of bound"]
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join("---:" if h in ("t/s", "mlx-lm t/s", "GB/s", "roofline",
                                             "bytes/token", "vs mlx-lm", "threads", "size",
                                             "B", "distinct experts", "bytes bound", "vs B=1",
                                             "of bound")
                              else "---" for h in head) + " |"]
    for r in rows:
        cells = [r.model, units.size(r.size_bytes),
                 f"{units.count(r.params_total)} / {units.count(r.params_active)}",
                 r.recipe, r.dtype, r.device, str(r.threads), r.kernels,
                 r.test + (f" ({r.speculative})" if r.speculative != "off" else ""),
                 _tps(r.tps_mean, r.tps_sd), units.size(r.bytes_per_token),
                 f"{r.gbps:.2f}" if r.gbps is not None else "",
                 f"{100 * r.roofline_fraction:.1f}%" if r.roofline_fraction is not None else ""]
        if compare:
            cells += [_tps(r.mlx_lm_tps_mean, r.mlx_lm_tps_sd),
                      f"{r.ratio_vs_mlx_lm:.2f}x" if r.ratio_vs_mlx_lm is not None else ""]
        if par:
            cells += [str(r.parallel or ""), _num(r.distinct_experts_per_layer, "{:.1f}"),
                      _num(r.bytes_bound_x, "{:.2f}x"), _num(r.speedup_x, "{:.2f}x"),
                      _num(r.vs_bound and 100 * r.vs_bound, "{:.0f}%")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(v: float | None, fmt: str) -> str:
    return "" if v is None else fmt.format(v)


def to_json(rows: list[Row], machine: dict) -> str:
    return json.dumps({"machine": machine, "rows": [asdict(r) for r in rows]}, indent=2)


CSV_FIELDS = ["model", "size_bytes", "params_total", "params_active", "recipe", "dtype", "device",
              "threads", "kernels", "test", "tps_mean", "tps_sd", "bytes_per_token", "gbps",
              "roofline_fraction", "mlx_lm_tps_mean", "mlx_lm_tps_sd", "ratio_vs_mlx_lm",
              "parallel", "bytes_bound_x", "distinct_experts_per_layer", "step_bytes",
              "speedup_x", "vs_bound", "depth", "kv_bytes_per_token"]


def to_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})
    return buf.getvalue()
