"""Convert the bundled model with every recipe and several pruning settings; write docs/QUALITY.md.

Perplexity is measured like `pocket-mlx eval-ppl` (float32 activations on the CPU, 512-token
windows) on an evenly spaced sample of windows of each validation file in assets/text/, the same
windows for every build, so builds compare pairwise. Results are cached in a JSON file, so an
interrupted run resumes where it stopped.

    python scripts/quality_report.py [--windows 4] [--calib-tokens 8192] [--cache FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pocket_mlx.analysis.perplexity import perplexity  # noqa: E402
from pocket_mlx.analysis.routing import RouteRecorder, Routes, consistency  # noqa: E402
from pocket_mlx.config import read_config, weights_bytes  # noqa: E402
from pocket_mlx.convert.pipeline import ConvertOptions, collect_router_stats, convert  # noqa: E402
from pocket_mlx.convert.prune import ExpertStats  # noqa: E402
from pocket_mlx.convert.recipes import load_recipe  # noqa: E402
from pocket_mlx.corpus import read_documents, token_stream, windows  # noqa: E402
from pocket_mlx.engine.loader import load_model  # noqa: E402
from pocket_mlx.engine.tokenizer import load_tokenizer  # noqa: E402

SRC = ROOT / "assets" / "pocket-tiny-bf16"
TEXT = ROOT / "assets" / "text"
DOMAINS = ("en", "zh", "code")
WINDOW = 512

# llama.cpp on the same reference model, as measured by ../shared/anchors/llamacpp (2026-12-01,
# `llama-perplexity -c 256` on the validation texts, imatrix from the three calibration texts):
# bits per weight of the GGUF's tensors, PPL ratio to its own BF16 on en, zh, code, and the
# files' tensor bytes (its gguf_bytes_per_token.py). Cited, not re-measured here (the report must
# not depend on a llama.cpp build).
LLAMACPP = {
    "Q3_K_M": (4.42, (1.051, 1.056, 1.047), 10_929_088),
    "IQ3_XXS, imatrix": (3.80, (1.101, 1.147, 1.088), 9_398_592),
    "Q2_K, imatrix": (3.63, (1.135, 1.176, 1.198), 8_974_848),
    "IQ2_S, imatrix": (3.49, (1.177, 1.212, 1.167), 8_629_824),
    "IQ2_XS, imatrix": (3.40, (1.235, 1.300, 1.283), 8_398_400),
}
IQ2_XS = "IQ2_XS, imatrix"


def sample_ids(tokenizer, domain: str, n_windows: int) -> list[int]:
    """`n_windows` full windows spread evenly over the validation file, concatenated."""
    ids = token_stream(read_documents(TEXT / f"{domain}.val.txt"), tokenizer)
    full = [w for w in windows(ids, WINDOW) if len(w) == WINDOW]
    pick = np.linspace(0, len(full) - 1, min(n_windows, len(full))).round().astype(int)
    return [t for i in sorted(set(pick.tolist())) for t in full[i]]


def merged(parts: list[ExpertStats]) -> ExpertStats:
    out = ExpertStats(parts[0].num_layers, parts[0].num_experts)
    for p in parts:
        out.freq += p.freq
        out.reap_sum += p.reap_sum
        out.tokens += p.tokens
    if all(p.by_source is not None for p in parts):  # one calibration file each
        out.by_source = np.concatenate([p.by_source for p in parts])
    return out


class Report:
    def __init__(self, cache: Path, n_windows: int, calib_tokens: int):
        self.cache_path = cache
        self.cache = json.loads(cache.read_text()) if cache.exists() else {}
        self.tokenizer = load_tokenizer(SRC)
        self.config = read_config(SRC)
        self.ids = {d: sample_ids(self.tokenizer, d, n_windows) for d in DOMAINS}
        self.calib_tokens = calib_tokens
        self._stats: dict[str, tuple[ExpertStats, list[dict]]] = {}
        self._ref_routes: dict[str, Routes] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="pocket-quality-"))
        # The source's parameter count (bf16: 2 bytes each), for sizes given in bits per weight.
        self.params = weights_bytes(SRC) // 2

    def ref_routes(self, d: str) -> Routes:
        """The source model's routing on domain `d`'s windows (recorded during perplexity)."""
        if d not in self._ref_routes:
            model = load_model(SRC, dtype="float32")
            for dom in DOMAINS:
                with RouteRecorder(model, SRC) as rec:
                    perplexity(model, self.ids[dom], WINDOW)
                self._ref_routes[dom] = rec.routes()
            del model
        return self._ref_routes[d]

    def save(self) -> None:
        self.cache_path.write_text(json.dumps(self.cache, indent=1))

    def stats(self, calib: tuple[str, ...]) -> tuple[ExpertStats, list[dict]]:
        for d in calib:
            if d not in self._stats:
                t = time.perf_counter()
                self._stats[d] = collect_router_stats(SRC, self.config,
                                                      [TEXT / f"{d}.calib.txt"], WINDOW,
                                                      self.calib_tokens, progress=False)
                print(f"  calibrated on {d} in {time.perf_counter() - t:.0f} s", flush=True)
        parts = [self._stats[d] for d in calib]
        return merged([p[0] for p in parts]), [i for p in parts for i in p[1]]

    def build(self, key: str, recipe: str, prune: int | None = None,
              calib: tuple[str, ...] = (), criterion: str = "reap-sum", seed: int = 0,
              domains: tuple[str, ...] = DOMAINS) -> dict:
        """Convert, measure perplexity on `domains`, cache the row under `key`."""
        row = self.cache.get(key, {})
        if row and all(d in row.get("ppl", {}) and d in row.get("routing", {}) for d in domains):
            return row
        print(f"{key}: converting", flush=True)
        out = self.tmp / key
        stats, infos = (self.stats(calib) if calib and prune else (None, None))
        auto = float(recipe[5:]) if recipe.startswith("auto:") else None
        target = int(recipe[5:]) if recipe.startswith("size:") else None
        if target is not None:
            stats, infos = self.stats(calib)
        opts = ConvertOptions(recipe=None if auto or target else load_recipe(recipe),
                              auto_bpw=auto, target_size=target, prune_to=prune,
                              calib=[TEXT / f"{d}.calib.txt" for d in calib]
                              if prune or auto or target else [],
                              criterion=criterion, seed=seed, force=True, progress=False)
        info = convert(str(SRC), out, opts, log=lambda m: None, stats=stats,
                       calib_info=infos).info
        model = load_model(out, dtype="float32")
        row = {"recipe": recipe, "prune": prune, "calib": list(calib),
               "criterion": info.get("criterion", criterion),
               "seed": seed, **{k: info["stats"][k] for k in
                                ("bits_per_weight", "bytes_per_token", "size_on_disk")},
               "weights_bytes": weights_bytes(out), "target_bytes": target,
               "experts": info["num_experts"], "bits": info["bits"],
               "widths": info.get("widths"),
               "rounding": info.get("rounding"), "ppl": {}, "routing": {}}
        all_routes = []
        for d in domains:
            with RouteRecorder(model, out) as rec:
                r = perplexity(model, self.ids[d], WINDOW)
            row["ppl"][d] = round(r.ppl, 3)
            row.setdefault("tokens", {})[d] = r.tokens
            mine = rec.routes()
            all_routes.append((mine, self.ref_routes(d)))
            row["routing"][d] = round(consistency(mine, self.ref_routes(d)).overall, 4)
            print(f"  {d}: ppl {r.ppl:.2f} ({r.tokens} tokens, {r.seconds:.0f} s), routing "
                  f"{row['routing'][d]:.3f}", flush=True)
        if len(domains) == len(DOMAINS):
            joined = [Routes([np.concatenate(x) for x in zip(*(rt.per_layer for rt in side))],
                             side[0].num_experts, side[0].top_k)
                      for side in zip(*all_routes)]
            c = consistency(*joined)
            row["routing"]["all"] = round(c.overall, 4)
            row["routing"]["per_layer"] = [round(v, 3) for v in c.per_layer]
        del model
        mx.clear_cache()
        self.cache[key] = row
        self.save()
        return row


def fmt_row(name: str, r: dict, base: dict | None = None, size: bool = True) -> str:
    cells = [name]
    if size:
        cells += [f"{r['bits_per_weight']:.2f}", f"{r['bytes_per_token'] / 1e6:.2f}",
                  f"{r['size_on_disk'] / 1e6:.1f}"]
    for d in DOMAINS:
        p = r["ppl"].get(d)
        if p is None:
            cells.append("")
        elif base:
            cells.append(f"{p:.2f} ({p / base['ppl'][d]:.2f}x)")
        else:
            cells.append(f"{p:.2f}")
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4, help="512-token windows per domain")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens/domain")
    ap.add_argument("--cache", type=Path, default=ROOT / "build" / "quality_cache.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "QUALITY.md")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    a = ap.parse_args()
    a.cache.parent.mkdir(parents=True, exist_ok=True)
    rep = Report(a.cache, a.windows, a.calib_tokens)
    try:
        return run_all(a, rep)
    finally:
        shutil.rmtree(rep.tmp, ignore_errors=True)


def run_all(a, rep: Report) -> int:
    skip = set(filter(None, a.skip.split(",")))
    t0 = time.perf_counter()

    recipes = ["bf16", "uniform-8", "uniform-6", "uniform-4", "uniform-3", "uniform-2",
               "pocket-3bit", "pocket-2bit"]
    rows = {r: rep.build(r, r) for r in recipes}
    base = rows["bf16"]
    budget = {}
    if "budget" not in skip:
        # The bytes of llama.cpp's IQ2_XS file's tensors (its 3.40 bits per weight, rounded,
        # would give a budget 0.07% above the file).
        iq2 = LLAMACPP[IQ2_XS][2]
        for name, b in (("IQ2_XS bytes", iq2), ("75% of IQ2_XS bytes", int(0.75 * iq2))):
            budget[name] = rep.build(f"size-{b}", f"size:{b}", calib=DOMAINS)
    combined = {}
    if "combined" not in skip:
        for k in (24, 16):
            for r in ("pocket-3bit", "pocket-2bit"):
                combined[(k, r)] = rep.build(f"p{k}-all-{r}", r, k, DOMAINS)
    calibs = {"en": ("en",), "zh": ("zh",), "code": ("code",), "en+zh+code": DOMAINS}
    pruned = {}
    if "prune" not in skip:
        for name, c in calibs.items():
            pruned[name] = rep.build(f"p16-{name}", "bf16", 16, c)
        for s in range(3):
            pruned[f"random seed {s}"] = rep.build(f"p16-random{s}", "bf16", 16, (),
                                                   "random", s)
    autos = {}
    if "auto" not in skip:
        bpw = rows["pocket-2bit"]["bits_per_weight"]
        autos[bpw] = rep.build(f"auto-{bpw}", f"auto:{bpw}", calib=DOMAINS)
    crit = {}
    if "criteria" not in skip:
        for d in DOMAINS:
            for c in ("reap", "frequency"):
                crit[(d, c)] = rep.build(f"p16-{d}-{c}", "bf16", 16, (d,), c, domains=(d,))
    write_report(a, rows, base, pruned, crit, combined, time.perf_counter() - t0, rep, autos,
                 budget)
    return 0


def write_report(a, rows, base, pruned, crit, combined, seconds, rep, autos, budget) -> None:
    toks = {d: len(rep.ids[d]) for d in DOMAINS}
    L = ["# Quality of converted builds (pocket-tiny)", "",
         "Generated by `python scripts/quality_report.py "
         f"--windows {a.windows} --calib-tokens {a.calib_tokens}` "
         "(do not edit by hand). Source: `assets/pocket-tiny-bf16` (bf16, 32 experts, top-4).", "",
         "Perplexity as `pocket-mlx eval-ppl` computes it: float32 activations on the CPU, "
         f"{WINDOW}-token non-overlapping windows; here on {a.windows} windows spread evenly over "
         "each validation file in `assets/text/` "
         f"({', '.join(f'{d} {t} tokens' for d, t in toks.items())}), the same windows for every "
         "build. Absolute values differ from whole-file numbers; ratios are what matter. "
         "Bits per weight: all stored bytes x 8 / parameters (scales and biases included). "
         "MB per token: weights read per decoded token (top-k experts, one embedding row).", "",
         "## Recipes (no pruning)", "",
         "| build | bits/weight | MB/token | size MB | en | zh | code |",
         "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        L.append(fmt_row(name, r, None if name == "bf16" else base))
    checks = []

    def check(ok: bool, text: str) -> None:
        checks.append(f"- {'PASS' if ok else 'FAIL'}: {text}")

    p2, u2 = rows["pocket-2bit"], rows["uniform-2"]
    check(all(p2["ppl"][d] <= 1.2 * base["ppl"][d] for d in DOMAINS),
          "pocket-2bit within 1.2x of bf16 on en, zh, code")
    check(all(u2["ppl"][d] >= 2 * base["ppl"][d] for d in DOMAINS),
          "uniform-2 at least 2x worse than bf16 on en, zh, code")
    if budget:
        L += ["", "## Size budgets against llama.cpp's low-bit files", "",
              "`--recipe auto --target-size BYTES --calib en --calib zh --calib code` "
              "(`convert/budget.py`): one search over the experts kept per layer (REAP-sum or "
              f"reap-max on {a.calib_tokens} calibration tokens per domain) and the width of each "
              "module (1/2/3/4/6/8 bits in groups of 64, 1/2/3/4 bits in groups of 128), by "
              "the KL of the logits measured on 256 calibration tokens per "
              "domain; each candidate build (expert count and criterion) is then measured whole "
              "on 2048 calibration tokens per domain, each domain's KL divided by its KL in "
              "the least pruned candidate, and the one whose worst domain has the lowest such "
              "ratio wins; candidates are rounded as the writer rounds them (from bfloat16 "
              "weights, bfloat16 scales and biases). Modules of 3 bits "
              "or fewer are rounded activation-aware (`--rounding gptq`, the auto default: "
              "least-squares levels per group, plus GPTQ's error feedback where a matrix saw at "
              "least 4x its input width in rows of up to 8192 calibration tokens per domain, "
              "routed experts included). "
              "Budgets: the tensor bytes of llama.cpp's IQ2_XS (imatrix) file of this model, "
              f"{budget['IQ2_XS bytes']['target_bytes']:,} bytes "
              f"({8 * budget['IQ2_XS bytes']['target_bytes'] / rep.params:.3f} bits per weight "
              f"of the {rep.params:,} weights), and 75% of it. llama.cpp rows are cited from `../shared/anchors/llamacpp` (ratios to its own "
              "BF16 from `llama-perplexity -c 256`; not re-measured here): compare ratios.", "",
              "| build | bits/weight (of the original) | weight bytes | experts | en | zh | code |",
              "|---|---|---|---|---|---|---|"]
        for name, (bpw, ratios, nbytes) in LLAMACPP.items():
            L.append(f"| llama.cpp {name} | {bpw:.2f} | {nbytes:,} | 32 | "
                     + " | ".join(f"({r:.3f}x)" for r in ratios) + " |")
        L.append(fmt_row("pocket-2bit", rows["pocket-2bit"], base, size=False)
                 .replace("| pocket-2bit |", f"| ours pocket-2bit | "
                          f"{8 * rows['pocket-2bit']['weights_bytes'] / rep.params:.2f} | "
                          f"{rows['pocket-2bit']['weights_bytes']:,} | 32 |"))
        for name, r in budget.items():
            widths = r.get("widths") or {k: [f"{b}-bit" for b in v] for k, v in r["bits"].items()}
            bits = ", ".join(f"{k} {' / '.join(v)}" for k, v in widths.items()
                             if k in ("experts", "attention", "linear_attention",
                                      "shared_expert", "embed_tokens", "lm_head"))
            L.append(fmt_row(f"ours auto, {name}", r, base, size=False).replace(
                f"| ours auto, {name} |",
                f"| ours auto, {name} | {8 * r['weights_bytes'] / rep.params:.2f} | "
                f"{r['weights_bytes']:,} | {r['experts']}"
                + (f" ({r['criterion']})" if r["experts"] < 32 else "") + " |"))
            L.append(f"|  ({bits}) | | | | | | |")
        iq2 = LLAMACPP[IQ2_XS][1]
        for name, r in budget.items():
            t = r["target_bytes"]
            check(0.98 * t <= r["weights_bytes"] <= t,
                  f"{name}: {r['weights_bytes']:,} weight bytes written for a budget of {t:,} "
                  f"({r['weights_bytes'] / t:.4f})")
        r = budget["IQ2_XS bytes"]
        nb = LLAMACPP[IQ2_XS][2]
        check(r["weights_bytes"] <= nb, f"IQ2_XS-budget build no larger than the IQ2_XS file's "
              f"tensors ({r['weights_bytes']:,} vs {nb:,} bytes, "
              f"{r['weights_bytes'] / nb - 1:+.2%})")
        ours = [r["ppl"][d] / base["ppl"][d] for d in DOMAINS]
        check(all(o < i for o, i in zip(ours, iq2)),
              "at IQ2_XS bytes, a lower PPL ratio than llama.cpp IQ2_XS on every domain ("
              + ", ".join(f"{d} {o:.3f}x vs {i:.3f}x" for d, o, i in zip(DOMAINS, ours, iq2))
              + ")")
        r = budget["75% of IQ2_XS bytes"]
        ours = [r["ppl"][d] / base["ppl"][d] for d in DOMAINS]
        check(all(o <= 1.3 for o in ours),
              "at 75% of IQ2_XS bytes, within 1.3x of bf16 on every domain ("
              + ", ".join(f"{d} {o:.3f}x" for d, o in zip(DOMAINS, ours)) + ")")
    if pruned:
        L += ["", "## Pruning 32 -> 16 experts per layer (bf16 weights, REAP-sum)", "",
              f"Calibration: {a.calib_tokens} tokens per domain from `assets/text/*.calib.txt`. "
              "Random: 16 experts drawn per layer (`--criterion random --seed S`).", "",
              "| calibration | bits/weight | MB/token | size MB | en | zh | code |",
              "|---|---|---|---|---|---|---|",
              fmt_row("none (32 experts)", base)]
        for name, r in pruned.items():
            L.append(fmt_row(name, r, base))
        rnd = [pruned[f"random seed {s}"] for s in range(3)]
        avg = {d: float(np.mean([r["ppl"][d] for r in rnd])) for d in DOMAINS}
        L.append("| random, mean of 3 seeds | | | | "
                 + " | ".join(f"{avg[d]:.2f} ({avg[d] / base['ppl'][d]:.2f}x)" for d in DOMAINS)
                 + " |")
        for d in DOMAINS:
            own = pruned[d]["ppl"][d]
            others = [pruned[n]["ppl"][d] for n in ("en", "zh", "code", "en+zh+code") if n != d]
            check(own <= min(others), f"{d}: calibrating on {d} gives the best {d} perplexity "
                  f"({own:.2f} vs {', '.join(f'{o:.2f}' for o in others)})")
            check(own <= 1.3 * base["ppl"][d],
                  f"{d}: own-domain pruning within 1.3x of unpruned ({own / base['ppl'][d]:.2f}x)")
            check(own < avg[d], f"{d}: own-domain pruning beats random experts "
                  f"({own:.2f} vs {avg[d]:.2f})")
    if crit:
        L += ["", "## Pruning criterion (32 -> 16, own-domain calibration)", "",
              "| criterion | en | zh | code |", "|---|---|---|---|"]
        for c in ("reap-sum", "reap", "frequency"):
            cells = []
            for d in DOMAINS:
                r = pruned[d] if c == "reap-sum" else crit[(d, c)]
                cells.append(f"{r['ppl'][d]:.2f}")
            L.append(f"| {c} | " + " | ".join(cells) + " |")
        wins = sum(pruned[d]["ppl"][d] <= min(crit[(d, c)]["ppl"][d] for c in ("reap", "frequency"))
                   for d in DOMAINS)
        L += ["", f"REAP-sum is best in {wins} of 3 domains: it stays the default criterion."
              if wins >= 2 else f"REAP-sum is best in only {wins} of 3 domains."]
    if combined:
        L += ["", "## Combined builds (pruned + mixed precision, calibrated on en+zh+code)", "",
              "| build | bits/weight | MB/token | size MB | en | zh | code |",
              "|---|---|---|---|---|---|---|", fmt_row("bf16, 32 experts", base)]
        for (k, r), row in combined.items():
            L.append(fmt_row(f"{k} experts, {r}", row, base))
    if autos:
        L += ["", "## `--recipe auto` against pocket-2bit at the same budget", "",
              "`--recipe auto --target-bpw B --calib en --calib zh --calib code`: KL of the logits "
              "with one group (a layer's routed experts, a layer's dense part, embeddings, lm_head)"
              " quantized at 2/3/4/6 bits, measured on 256 calibration tokens, then a greedy "
              "allocation of the bit budget. Routers stay 8-bit.", "",
              "| build | bits/weight | MB/token | size MB | en | zh | code |",
              "|---|---|---|---|---|---|---|", fmt_row("pocket-2bit", rows["pocket-2bit"], base)]
        for bpw, r in autos.items():
            L.append(fmt_row(f"auto, target {bpw:.2f}", r, base))
            p2 = rows["pocket-2bit"]
            check(all(r["ppl"][d] < p2["ppl"][d] for d in DOMAINS)
                  and r["bits_per_weight"] <= p2["bits_per_weight"] + 0.02,
                  f"auto at {r['bits_per_weight']:.2f} bits/weight beats pocket-2bit "
                  f"({p2['bits_per_weight']:.2f}) on every domain")
    routed = {**{n: r for n, r in rows.items() if n != "bf16"},
              **{f"auto, {n}": r for n, r in budget.items()},
              **{f"16 experts, calibrated on {n}": r for n, r in pruned.items()},
              **{f"{k} experts, {r}": row for (k, r), row in combined.items()},
              **{f"auto, target {b:.2f} bits/weight": r for b, r in autos.items()}}
    L += ["", "## Routing consistency with bf16", "",
          "`pocket-mlx eval-ppl --routing-consistency REF`: for every token of the same "
          "windows, the share of the router's top-4 experts that the build and bf16 both pick "
          "(|top-k ∩ top-k_ref| / k), averaged over tokens, per layer and then over layers; "
          "pruned builds compare in the original expert ids (pocket.json `kept_experts`), so "
          "a dropped expert never matches.", "",
          "| build | all | en | zh | code | per layer (0..7) |", "|---|---|---|---|---|---|"]
    for name, r in routed.items():
        rt = r.get("routing", {})
        if "all" not in rt:
            continue
        L.append(f"| {name} | {rt['all']:.3f} | " + " | ".join(f"{rt[d]:.3f}" for d in DOMAINS)
                 + " | " + " ".join(f"{v:.2f}" for v in rt["per_layer"]) + " |")
    L += ["", "## Checks", "", *checks, "",
          f"Run time: {seconds / 60:.0f} min (results cached in `{a.cache.name}`).", ""]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(L))
    print("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
