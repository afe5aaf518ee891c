"""`convert --recipe auto --target-size SIZE`: one search over pruning and bits for a byte budget.

POCKET has two levers: which experts to keep per layer (pruning) and how many bits each part
gets. Both are measured on the user's calibration text with the same loss, the KL divergence
of the output distribution from the float model's (mean over the calibration tokens; each
calibration file contributes the same number of tokens, so domains weigh equally):

1. KL of every group (a layer's routed experts, a layer's dense part, embeddings, lm_head)
   quantized alone at every width of BUDGET_SPECS (the rest float), rounded as the build will
   round them (`--rounding`: GPTQ by default, which changes the low-bit picture a lot):
   estimated in one pass over the layers, one layer in memory (budget_stream.measure: each
   group quantized alone at one width and carried to the logits as a stream of its own, the
   other widths scaled by importance-weighted weight errors).
2. For each candidate expert count K (the same K in every layer: the config has one
   `num_experts`, and mlx-lm needs it), the K best experts per layer by the calibration
   statistics (REAP-sum, as `--prune-to`); the bytes freed go to bits: a greedy allocation
   upgrades the module with the best measured KL drop per extra byte (a module gets its group's
   KL in proportion to its share of the group's weights) until no upgrade fits the budget.
3. Each K's complete build (pruned and quantized layer by layer, all candidates as streams in
   one more pass: budget_stream.judge; with several calibration files, once with reap-sum and
   once with reap-max experts) is measured once more, as a whole, on
   more text (JUDGE_TOKENS per file: 256 tokens ranked the domains of pruned builds wrongly on
   the reference model, 2048 ranked them as the validation text does), per calibration file:
   each file's KL is divided by its KL in the least pruned candidate, and the build whose
   worst file has the lowest such ratio wins (`_judge`). Additivity is only assumed inside
   one K.

Sizes are exact: the bytes of every tensor the writer will store (packed weights, scales and
biases in the output's float dtype, the float tensors), so the build never exceeds the budget;
upgrades continue (least harmful first) until nothing fits, so it lands within a module's
smallest step of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from pocket_mlx.convert import budget_stream as stream
from pocket_mlx.convert.budget_stream import Quantizer
from pocket_mlx.convert.prune import ExpertStats, select_experts
from pocket_mlx.convert.recipes import DEFAULT_GROUP, Recipe, Spec, glob_rule
from pocket_mlx.errors import PocketError
from pocket_mlx.units import size as fmt_size

# The widths the search hands out, cheapest first: 1-8 bits in groups of 64, and 1-4 bits in
# groups of 128 (a scale and a bias per 128 weights: 2-bit g128 costs 2.25 bits per weight
# against 2.5 for g64 and 1.5 for 1-bit g64). On the reference model's 75%-of-IQ2_XS budget
# the search then drops 1-bit experts for 2-bit g64/g128 ones: en 1.29x -> 1.22x, zh 1.21x ->
# 1.23x, code 1.320x -> 1.317x (docs/QUALITY.md).
BUDGET_SPECS = tuple(sorted(
    [Spec(b) for b in (1, 2, 3, 4, 6, 8)] + [Spec(b, 128) for b in (1, 2, 3, 4)],
    key=lambda s: s.bits + 32 / s.group_size))
ROUTER_SPEC = Spec(8)  # routers and shared-expert gates: tiny, and quality collapses below 8
# The MTP head (mtp.*) is not measured (the trunk's output does not see it): its bytes count in
# the budget at 4 bits (routers 8), the attention bits of the built-in recipes.
MTP_SPEC = Spec(4)
PRUNE_FRACTIONS = (1.0, 0.875, 0.75, 0.625, 0.5)  # below half, quality falls off (measured)


def is_router(path: str) -> bool:
    return path.endswith(("mlp.gate", "shared_expert_gate"))


def spec_bytes(shape: tuple[int, ...], spec: Spec | None, float_bytes: int) -> int:
    """Bytes the writer stores for one matrix (or stack of expert matrices) of `shape`:
    float, or MLX affine (uint32 words of packed rows, a scale and a bias per group)."""
    rows, k = math.prod(shape[:-1]), shape[-1]
    if spec is None:
        return rows * k * float_bytes
    return rows * (k * spec.bits // 32) * 4 + 2 * rows * (k // spec.group_size) * float_bytes


@dataclass
class Sizer:
    """The exact weight bytes of a build: module shapes of the unpruned float model, the float
    dtype each module is written in, and the bytes of everything outside quantizable modules
    (norms, conv, A_log, dt_bias), which neither pruning nor the recipe changes."""

    shapes: dict[str, tuple[int, ...]]
    float_bytes: dict[str, int]
    other: int
    num_experts: int
    # The float dtype each module is written in: the search rounds in it, as the writer does.
    dtypes: dict[str, mx.Dtype] = field(default_factory=dict)

    def shape(self, path: str, k: int) -> tuple[int, ...]:
        s = self.shapes[path]
        if ".switch_mlp." in path or path.endswith("mlp.gate"):
            return (k, *s[1:])  # experts stacked on axis 0; router rows
        return s

    def module(self, path: str, spec: Spec | None, k: int) -> int:
        return spec_bytes(self.shape(path, k), spec, self.float_bytes[path])

    def total(self, specs: dict[str, Spec | None], k: int) -> int:
        return self.other + sum(self.module(p, s, k) for p, s in specs.items())


def _groups(paths: list[str]) -> dict[str, list[str]]:
    """Measurement groups: per layer its routed experts and its dense rest (attention or linear
    attention plus shared expert); embeddings; lm_head. Few groups keep the measuring cheap."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        parts = path.split(".")
        if "layers" in parts:
            i = parts[parts.index("layers") + 1]
            key = f"layers.{i}.{'experts' if '.switch_mlp.' in path else 'dense'}"
        else:
            key = parts[-1]
        groups.setdefault(key, []).append(path)
    return groups


def _key(group: str, spec: Spec) -> str:
    """A measurement's name in the --resume journal."""
    return f"{group}|{spec.bits}|{spec.group_size}"


def _candidates(num_experts: int, top_k: int) -> list[int]:
    ks = {max(top_k, round(num_experts * f)) for f in PRUNE_FRACTIONS}
    return sorted((k for k in ks if top_k <= k <= num_experts), reverse=True)


def options(sizer: Sizer, path: str) -> list[Spec]:
    """The widths `path` can take (a group must divide its input dim), cheapest first."""
    k = sizer.shapes[path][-1]
    return [s for s in BUDGET_SPECS if k % s.group_size == 0]


def _allocate(units: list[str], share: dict[str, float], group_of: dict[str, str],
              kl: dict[tuple[str, Spec], float], sizer: Sizer, k: int,
              fixed: dict[str, Spec], target: int) -> tuple[dict[str, Spec], int]:
    """Greedy: every unit at its cheapest width, then the upgrade (to any dearer width) with
    the best estimated KL drop per byte, while it fits; then, to land close to the budget, the
    least harmful upgrades that still fit."""
    opts = {u: sorted(options(sizer, u), key=lambda s: sizer.module(u, s, k)) for u in units}
    cost = {(u, s): sizer.module(u, s, k) for u in units for s in opts[u]}
    cur = {u: opts[u][0] for u in units}
    spent = sizer.total({**fixed, **cur}, k)

    def est(u: str, s: Spec) -> float:
        return share[u] * kl[(group_of[u], s)]

    for positive_only in (True, False):
        while True:
            best = None
            for u in units:
                s0 = cur[u]
                for s in opts[u][opts[u].index(s0) + 1:]:
                    extra = cost[(u, s)] - cost[(u, s0)]
                    if spent + extra > target:
                        break  # wider is dearer still
                    gain = est(u, s0) - est(u, s)
                    if positive_only and gain <= 0:
                        continue
                    key = gain / max(extra, 1) if positive_only else gain
                    if best is None or key > best[0]:
                        best = (key, u, s, extra)
            if best is None:
                break
            _, u, s, extra = best
            cur[u] = s
            spent += extra
    return cur, spent


def _judge(tried: list[dict]) -> dict:
    """The candidate build whose worst calibration file fares best *relative to the least
    pruned candidate* (all experts when that fits): each file's KL is divided by its KL in
    that build, and the lowest maximum wins (ties: lowest mean KL). Sets
    "kl_worst_relative" on every candidate.

    Why relative: KL levels are not comparable across files. On the reference model the zh
    calibration file always has the highest KL (the model seems to have memorized the
    calibration text, unevenly by domain), so "lowest worst-file KL" chose the build that
    pruned hardest (24 of 32 experts), good for zh and en and the worst for code on held-out
    text: 1.22x/1.23x/1.32x (en/zh/code) at 75% of the IQ2_XS bytes; judged relatively, 28
    experts (reap-max): 1.26x/1.22x/1.24x (docs/QUALITY.md). A file's KL against its own KL
    in another build does track its held-out perplexity: the question each candidate answers
    is "does pruning this much cost some domain more than it gives back in bits?"."""
    ref = max(tried, key=lambda t: (t["experts"], t["criterion"] == tried[0]["criterion"]))
    base = [max(v, 1e-9) for v in ref["kl_by_source"]]
    for t in tried:
        t["kl_worst_relative"] = round(max(v / b for v, b in zip(t["kl_by_source"], base)), 5)
    return min(tried, key=lambda t: (t["kl_worst_relative"], t["kl_measured"]))


def check_target(sizer: Sizer, target: int, top_k: int) -> dict[int, int]:
    """The smallest build per candidate expert count; a PocketError when `target` is outside
    what the search can build (checked before any slow step)."""
    fixed = {p: ROUTER_SPEC for p in sizer.shapes if is_router(p)}
    units = [p for p in sizer.shapes if not is_router(p)]
    for p in units:
        if sizer.shapes[p][-1] % DEFAULT_GROUP:
            raise PocketError(f"{p}: input dim {sizer.shapes[p][-1]} is not a multiple of "
                              f"{DEFAULT_GROUP}; --target-size cannot quantize this model")
    cheapest = {u: options(sizer, u)[0] for u in units}
    lowest = {k: sizer.total({**fixed, **cheapest}, k)
              for k in _candidates(sizer.num_experts, top_k)}
    highest = sizer.total({**fixed, **{u: BUDGET_SPECS[-1] for u in units}},
                          sizer.num_experts)
    least = min(lowest.values())
    if target < least:
        raise PocketError(f"--target-size {target:,} bytes is below the smallest build of this "
                          f"model ({least:,} bytes, {fmt_size(least)}: {min(lowest)} experts per "
                          "layer, everything 1-bit but the routers)")
    if target > highest:
        raise PocketError(f"--target-size {target:,} bytes is above the largest build of this "
                          f"search ({highest:,} bytes, {fmt_size(highest)}: every part 8-bit); "
                          "use --recipe uniform-8 or bf16")
    return lowest


def budget_recipe(load: Callable[[], object], chunks: list[list[int]],
                  stats: ExpertStats | None, sizer: Sizer, target: int,
                  criterion: str = "reap-sum", seed: int = 0, progress: bool = True,
                  log: Callable[[str], None] = print, quantizer: Quantizer | None = None,
                  sources: list[int] | None = None,
                  judge: tuple[list[list[int]], list[int]] | None = None,
                  memo: dict | None = None, save: Callable[[str | None], None] | None = None,
                  folder: Path | None = None) -> tuple[Recipe, int | None, dict]:
    """(recipe, experts to keep per layer or None for all, report) for a build of at most
    `target` weight bytes. `load()`: the float model, lazily loaded (each pass reads it layer
    by layer and drops what it has used: convert/budget_stream.py). `sources`: the
    calibration file of each chunk. `judge`: (chunks, sources) on which the complete candidate
    builds are compared (default: `chunks`); the build with the lowest worst-file KL relative
    to the least pruned build wins (`_judge`). The report's "criterion" is the expert
    criterion the chosen build used. `memo` (--resume, convert/resume.py): the measurements of
    an interrupted run, taken instead of measuring again, and where each new one is put before
    `save(step)` is called; `folder` keeps the passes' streams between layers."""
    memo = memo if memo is not None else {}
    done_kl, done_tried = memo.setdefault("kl", {}), memo.setdefault("tried", {})
    sources = sources or [0] * len(chunks)
    model = load()
    args = model.args
    E, top_k, L = args.num_experts, args.num_experts_per_tok, args.num_hidden_layers
    paths = [p for p, m in model.named_modules() if hasattr(m, "to_quantized")]
    fixed = {p: ROUTER_SPEC if is_router(p) else MTP_SPEC for p in paths
             if is_router(p) or p.startswith("mtp.")}
    units = [p for p in paths if p not in fixed]
    lowest = check_target(sizer, target, top_k)
    feasible = [k for k, b in lowest.items() if b <= target]
    groups = _groups(units)
    group_of = {u: g for g, us in groups.items() for u in us}
    gsize = {g: sum(math.prod(sizer.shapes[u]) for u in us) for g, us in groups.items()}
    share = {u: math.prod(sizer.shapes[u]) / gsize[group_of[u]] for u in units}

    def specs_of(g: str) -> list[Spec]:
        # A group is measured at every width one of its modules can take; a module that
        # cannot take it is measured at the same bits in groups of DEFAULT_GROUP.
        return [s for s in BUDGET_SPECS if any(s in options(sizer, u) for u in groups[g])]

    def module_spec(p: str, s: Spec) -> Spec:
        return s if s in options(sizer, p) else Spec(s.bits)

    if not memo.get("measured"):
        done_kl.update(stream.measure(model, chunks, groups, specs_of, module_spec, quantizer,
                                      sizer.dtypes, memo.setdefault("measure", {}), save,
                                      folder, progress))
        memo["measured"] = True
        if save is not None:
            save(None)
    del model
    kl = {(g, s): done_kl[_key(g, s)] for g in groups for s in specs_of(g)}
    # With several calibration files (domains), experts are also chosen by reap-max (each
    # domain's own REAP-sum share: what one domain relies on stays), and a build is judged by
    # its worst domain (relative to the least pruned build): the acceptance of a budget is
    # "within X on every domain", and a domain hurt by pruning (code, on the reference model)
    # would otherwise be sacrificed to a lower mean.
    criteria = [criterion]
    if stats is not None and stats.num_sources > 1 and criterion == "reap-sum":
        criteria.append("reap-max")
    runs = [(k, c) for k in feasible for c in (criteria if k < E else [criterion])]
    plans = []
    for k, crit in runs:
        kept = select_experts(stats, k, crit, L, E, seed) if k < E else None
        specs, spent = _allocate(units, share, group_of, kl, sizer, k, fixed, target)
        plans.append((k, crit, kept, specs, spent))
    todo = [p for p in plans if f"{p[0]}|{p[1]}" not in done_tried]
    if todo:
        chunks_j, sources_j = judge if judge is not None else (chunks, sources)
        got = stream.judge(load(), chunks_j, sources_j,
                           [(kept, {**fixed, **specs}) for _, _, kept, specs, _ in todo],
                           quantizer, sizer.dtypes, memo.setdefault("judge", {}), save, folder,
                           progress)
        for (k, crit, *_), (real, per_source) in zip(todo, got):
            done_tried[f"{k}|{crit}"] = [None, real, per_source]
        if save is not None:
            save(None)
    tried = []
    for k, crit, kept, specs, spent in plans:
        _, real, per_source = done_tried[f"{k}|{crit}"]
        est = sum(share[u] * kl[(group_of[u], s)] for u, s in specs.items())
        tried.append({"experts": k, "criterion": crit if k < E else None, "bytes": spent,
                      "kl_estimate": round(est, 5), "kl_measured": round(real, 5),
                      "kl_worst_source": round(max(per_source), 5),
                      "kl_by_source": [round(v, 5) for v in per_source],
                      "specs": specs, "kept": kept})
    best = _judge(tried)
    log(f"target {target:,} bytes: " + "; ".join(
        f"{t['experts']} experts{' ' + t['criterion'] if t['criterion'] else ''} KL "
        f"{t['kl_measured']:.4f} (worst file x{t['kl_worst_relative']:.3f})" for t in tried)
        + f" -> {best['experts']} experts" + (f" ({best['criterion']})" if best["criterion"]
                                              else ""))
    rules = [glob_rule(p, s) for p, s in fixed.items()]
    rules += [glob_rule(p, s) for p, s in best["specs"].items()]
    recipe = Recipe(f"auto-{target}B", rules, default=Spec(4))
    report = _budget_report(target, best, tried, groups, kl, chunks,
                            judge[0] if judge is not None else chunks)
    report["kl_probe"] = memo.get("measure", {}).get("probe_kl")
    return recipe, (best["experts"] if best["experts"] < E else None), report


def _budget_report(target: int, best: dict, tried: list[dict], groups: dict[str, list[str]],
                   kl: dict[tuple[str, Spec], float], chunks: list[list[int]],
                   judge_chunks: list[list[int]]) -> dict:
    """pocket.json's account of the search: the chosen build, every candidate, each group's
    widths and measured KLs."""
    return {
        "target_bytes": target,
        "bytes": best["bytes"],
        "experts": best["experts"],
        "criterion": best["criterion"],
        "tokens": sum(len(c) for c in chunks),
        "judge_tokens": sum(len(c) for c in judge_chunks),
        "candidates": [{k: v for k, v in t.items() if k not in ("specs", "kept")}
                       for t in tried],
        "groups": {g: {"bits": sorted({best["specs"][u].bits for u in us}),
                       "widths": sorted({best["specs"][u].label() for u in us}),
                       "kl": {s.label(): round(kl[(g, s)], 5) for s in BUDGET_SPECS
                              if (g, s) in kl}}
                   for g, us in groups.items()},
    }
