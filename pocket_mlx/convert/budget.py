"""`convert --recipe auto --target-size SIZE`: one search over pruning and bits for a byte budget.

POCKET has two levers: which experts to keep per layer (pruning) and how many bits each part
gets. Both are measured on the user's calibration text with the same loss, the KL divergence
of the output distribution from the float model's (mean over the calibration tokens; each
calibration file contributes the same number of tokens, so domains weigh equally):

1. KL of every group (a layer's routed experts, a layer's dense part, embeddings, lm_head)
   quantized alone at every width of BUDGET_SPECS (the rest float), rounded as the build will
   round them (`--rounding`: GPTQ by default, which changes the low-bit picture a lot); a group
   in layer i is run from the cached input of layer i, so late groups cost less.
2. For each candidate expert count K (the same K in every layer: the config has one
   `num_experts`, and mlx-lm needs it), the K best experts per layer by the calibration
   statistics (REAP-sum, as `--prune-to`); the bytes freed go to bits: a greedy allocation
   upgrades the module with the best measured KL drop per extra byte (a module gets its group's
   KL in proportion to its share of the group's weights) until no upgrade fits the budget.
3. Each K's complete build (pruned and quantized in memory; with several calibration files,
   once with reap-sum and once with reap-max experts) is measured once more, as a whole, on
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

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from pocket_mlx.convert.blas import numpy_matmuls
from pocket_mlx.convert.prune import ExpertStats, select_experts
from pocket_mlx.convert.recipes import DEFAULT_GROUP, Recipe, Spec, glob_rule
from pocket_mlx.errors import PocketError
from pocket_mlx.progress import progress as progress_bar
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


class _Measure:
    """KL of the model's output distribution from its float baseline on calibration windows,
    with each layer's input cached so a change in layer i is run from layer i on."""

    def __init__(self, model, chunks: list[list[int]], sources: list[int] | None = None):
        self.model = model
        self.sources = sources or [0] * len(chunks)
        self.num_sources = max(self.sources) + 1
        self.lm = model.language_model
        self.layers = self.lm.model.layers
        self.xs = [mx.array(c, mx.int32)[None] for c in chunks]
        self.inputs: list[list[mx.array]] = []  # [layer][chunk], plus the last layer's output
        self.base: list[mx.array] = []
        with numpy_matmuls(model):
            for x in self.xs:
                h = self.lm.model.embed_tokens(x)
                row = [h]
                for layer in self.layers:
                    h = layer(h)
                    mx.eval(h)
                    row.append(h)
                self.inputs.append(row)
                self.base.append(self._logp(h))

    def _logp(self, h: mx.array) -> mx.array:
        h = self.lm.model.norm(h)
        lg = (self.lm.model.embed_tokens.as_linear(h) if self.lm.args.tie_word_embeddings
              else self.lm.lm_head(h)).astype(mx.float32)
        out = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        mx.eval(out)
        return out

    def kl(self, start: int = 0) -> float:
        """Mean KL(base || current) over all tokens, running the layers from `start` (0: from
        the embeddings; len(layers): only the final norm and lm_head)."""
        return self.kl_by_source(start)[0]

    def kl_by_source(self, start: int = 0) -> tuple[float, list[float]]:
        """(mean KL over all tokens, mean KL over each calibration file's tokens)."""
        total, n = np.zeros(self.num_sources), np.zeros(self.num_sources)
        with numpy_matmuls(self.model):
            for j, x in enumerate(self.xs):
                h = self.lm.model.embed_tokens(x) if start == 0 else self.inputs[j][start]
                for layer in self.layers[start:]:
                    h = layer(h)
                logp = self._logp(h)
                p = self.base[j]
                total[self.sources[j]] += float((mx.exp(p) * (p - logp)).sum(-1).sum().item())
                n[self.sources[j]] += p.shape[1]
        return float(total.sum() / n.sum()), (total / np.maximum(n, 1)).tolist()


def _start_layer(group: str, num_layers: int) -> int:
    if group.startswith("layers."):
        return int(group.split(".")[1])
    return num_layers if group == "lm_head" else 0


# (module path, float weight, spec, kept expert ids of its layer or None) -> (weight, scales,
# biases), or None for MLX's round-to-nearest: how the build will round (convert --rounding).
Quantizer = Callable[[str, mx.array, Spec, "list[int] | None"],
                     "tuple[mx.array, mx.array, mx.array] | None"]


def _layer_of(path: str) -> int | None:
    parts = path.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


class _Editor:
    """Prunes and quantizes the in-memory float model, and puts it back as it was.

    The model is float32 (the measurements need it), but each module is rounded from its
    weight in `dtypes[path]`, the dtype the writer quantizes it in (scales and biases come out
    in it too): on the reference model, GPTQ of the same candidate from float32 and from
    bfloat16 weights of equal value gave code 1.284x against 1.313x (the written build's
    1.314x) on held-out text, so a search rounding in float32 judged a build it did not
    write."""

    def __init__(self, model, quantizer: Quantizer | None = None,
                 dtypes: dict[str, mx.Dtype] | None = None):
        self.model = model
        self.modules = dict(model.named_modules())
        self.quantizer = quantizer
        self.dtypes = dtypes or {}
        self.kept: list[list[int]] | None = None
        self.saved: list[tuple[str, nn.Module]] = []
        self.pruned: list[tuple[nn.Module, str, mx.array]] = []

    def prune(self, kept: list[list[int]]) -> None:
        self.kept = kept
        for layer, ids in zip(self.model.language_model.model.layers, kept):
            idx = mx.array(ids, mx.int32)
            mlp = layer.mlp
            for m in (mlp.gate, mlp.switch_mlp.gate_proj, mlp.switch_mlp.up_proj,
                      mlp.switch_mlp.down_proj):
                self.pruned.append((m, "weight", m.weight))
                m.weight = m.weight[idx]

    def quantize(self, specs: dict[str, Spec | None]) -> None:
        new = []
        for p, spec in specs.items():
            if spec is None:
                continue
            m = self.modules[p]
            self.saved.append((p, m))
            q = m.to_quantized(group_size=spec.group_size, bits=spec.bits)  # lazy: replaced
            w = m.weight.astype(self.dtypes.get(p, m.weight.dtype))
            layer = _layer_of(p)
            kept = self.kept[layer] if self.kept is not None and layer is not None else None
            got = self.quantizer(p, w, spec, kept) if self.quantizer else None
            q.weight, q.scales, q.biases = (got if got is not None
                                            else mx.quantize(w, spec.group_size, spec.bits))
            new.append((p, q))
        if new:
            self.model.update_modules(tree_unflatten(new))

    def restore(self) -> None:
        if self.saved:
            self.model.update_modules(tree_unflatten(self.saved))
        for m, name, w in reversed(self.pruned):
            setattr(m, name, w)
        self.saved, self.pruned, self.kept = [], [], None


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


@dataclass
class SearchPlan:
    """What the in-memory search and the layer-by-layer one (budget_stream.py) share: the
    modules the search sets (units, in groups) and the fixed ones, the expert counts that can
    meet the target, and the candidate builds' rows, verdict and report."""

    sizer: Sizer
    E: int
    L: int
    fixed: dict[str, Spec]
    units: list[str]
    groups: dict[str, list[str]]
    group_of: dict[str, str]
    share: dict[str, float]  # each unit's share of its group's weights
    feasible: list[int]

    @classmethod
    def of(cls, model, sizer: Sizer, target: int) -> SearchPlan:
        """Refuses a target outside what the model can be built to (check_target)."""
        args = model.args
        paths = [p for p, m in model.named_modules() if hasattr(m, "to_quantized")]
        fixed = {p: ROUTER_SPEC if is_router(p) else MTP_SPEC for p in paths
                 if is_router(p) or p.startswith("mtp.")}
        units = [p for p in paths if p not in fixed]
        lowest = check_target(sizer, target, args.num_experts_per_tok)
        groups = _groups(units)
        group_of = {u: g for g, us in groups.items() for u in us}
        gsize = {g: sum(math.prod(sizer.shapes[u]) for u in us) for g, us in groups.items()}
        return cls(sizer, args.num_experts, args.num_hidden_layers, fixed, units, groups,
                   group_of, {u: math.prod(sizer.shapes[u]) / gsize[group_of[u]] for u in units},
                   [k for k, b in lowest.items() if b <= target])

    def runs(self, stats: ExpertStats | None, criterion: str) -> list[tuple[int, str]]:
        """The candidate builds: (experts kept, expert criterion)."""
        # With several calibration files (domains), experts are also chosen by reap-max (each
        # domain's own REAP-sum share: what one domain relies on stays), and a build is judged
        # by its worst domain (relative to the least pruned build): the acceptance of a budget
        # is "within X on every domain", and a domain hurt by pruning (code, on the reference
        # model) would otherwise be sacrificed to a lower mean.
        criteria = [criterion]
        if stats is not None and stats.num_sources > 1 and criterion == "reap-sum":
            criteria.append("reap-max")
        return [(k, c) for k in self.feasible
                for c in (criteria if k < self.E else [criterion])]

    def tried_row(self, k: int, crit: str, kept, specs: dict[str, Spec], spent: int,
                  kl: dict[tuple[str, Spec], float], real: float, per_source: list[float],
                  prune_kl: float | None = None) -> dict:
        """pocket.json's row of one candidate build (kl_pruning only where it was measured)."""
        est = (prune_kl or 0.0) + sum(self.share[u] * kl[(self.group_of[u], s)]
                                      for u, s in specs.items())
        row = {"experts": k, "criterion": crit if k < self.E else None, "bytes": spent}
        if prune_kl is not None:
            row["kl_pruning"] = round(prune_kl, 5)
        return {**row, "kl_estimate": round(est, 5), "kl_measured": round(real, 5),
                "kl_worst_source": round(max(per_source), 5),
                "kl_by_source": [round(v, 5) for v in per_source],
                "specs": specs, "kept": kept}

    def finish(self, target: int, tried: list[dict], kl: dict[tuple[str, Spec], float],
               chunks: list[list[int]], judge_chunks: list[list[int]],
               log: Callable[[str], None]) -> tuple[Recipe, int | None, dict]:
        """The winner (`_judge`), one line on every candidate, and (recipe, experts to keep
        or None for all, report)."""
        best = _judge(tried)
        log(f"target {target:,} bytes: " + "; ".join(
            f"{t['experts']} experts{' ' + t['criterion'] if t['criterion'] else ''} KL "
            f"{t['kl_measured']:.4f} (worst file x{t['kl_worst_relative']:.3f})"
            for t in tried) + f" -> {best['experts']} experts"
            + (f" ({best['criterion']})" if best["criterion"] else ""))
        rules = [glob_rule(p, s) for p, s in self.fixed.items()]
        rules += [glob_rule(p, s) for p, s in best["specs"].items()]
        recipe = Recipe(f"auto-{target}B", rules, default=Spec(4))
        report = _budget_report(target, best, tried, self.groups, kl, chunks, judge_chunks)
        return recipe, (best["experts"] if best["experts"] < self.E else None), report


def budget_recipe(model, chunks: list[list[int]], stats: ExpertStats | None, sizer: Sizer,
                  target: int, criterion: str = "reap-sum", seed: int = 0,
                  progress: bool = True, log: Callable[[str], None] = print,
                  quantizer: Quantizer | None = None, sources: list[int] | None = None,
                  judge: tuple[list[list[int]], list[int]] | None = None,
                  memo: dict | None = None, save: Callable[[str], None] | None = None
                  ) -> tuple[Recipe, int | None, dict]:
    """(recipe, experts to keep per layer or None for all, report) for a build of at most
    `target` weight bytes; `model` is the float model, fully loaded (small models only).
    `sources`: the calibration file of each chunk. `judge`: (chunks, sources) on which the
    complete candidate builds are compared (default: `chunks`); the build with the lowest
    worst-file KL relative to the least pruned build wins (`_judge`). The report's
    "criterion" is the expert criterion the chosen build used. `memo` (--resume,
    convert/resume.py): the measurements of an interrupted run, taken instead of measuring
    again, and where each new one is put before `save(step)` is called."""
    memo = memo if memo is not None else {}
    done_kl, done_tried = memo.setdefault("kl", {}), memo.setdefault("tried", {})
    plan = SearchPlan.of(model, sizer, target)
    E, L, units, share, group_of = plan.E, plan.L, plan.units, plan.share, plan.group_of
    meas = _Measure(model, chunks, sources)
    whole = _Measure(model, *judge) if judge is not None else meas
    edit = _Editor(model, quantizer, sizer.dtypes)
    kl = _measure_groups(meas, edit, sizer, plan.groups, L, done_kl, progress, save)
    runs = plan.runs(stats, criterion)
    tried = []
    left = [r for r in runs if f"{r[0]}|{r[1]}" not in done_tried]
    bar = iter(progress_bar(left, desc="search", unit="build", enabled=progress))
    for k, crit in runs:
        kept = select_experts(stats, k, crit, L, E, seed) if k < E else None
        specs, spent = _allocate(units, share, group_of, kl, sizer, k, plan.fixed, target)
        if (got := done_tried.get(f"{k}|{crit}")) is None:
            next(bar, None)
            got = done_tried[f"{k}|{crit}"] = _try_build(whole, edit, kept,
                                                         {**plan.fixed, **specs})
            if save is not None:
                save("search")
        prune_kl, real, per_source = got
        tried.append(plan.tried_row(k, crit, kept, specs, spent, kl, real, per_source,
                                    prune_kl))
    for _ in bar:  # the bar's closing line
        pass
    return plan.finish(target, tried, kl, chunks, judge[0] if judge is not None else chunks,
                       log)


def _measure_groups(meas: _Measure, edit: _Editor, sizer: Sizer, groups: dict[str, list[str]],
                    num_layers: int, done_kl: dict, progress: bool,
                    save: Callable[[str], None] | None) -> dict[tuple[str, Spec], float]:
    """The KL of each group quantized alone at each width, the rest float: taken from
    `done_kl` (an interrupted run's) where there, else measured and put there."""
    kl: dict[tuple[str, Spec], float] = {}
    # A group is measured at every width one of its modules can take; a module that cannot
    # take it is measured at the same bits in groups of DEFAULT_GROUP.
    todo = [(g, s) for g in groups for s in BUDGET_SPECS
            if any(s in options(sizer, u) for u in groups[g])]
    for g, s in [t for t in todo if _key(*t) in done_kl]:
        kl[(g, s)] = done_kl[_key(g, s)]
    todo = [t for t in todo if _key(*t) not in done_kl]
    for g, s in progress_bar(todo, desc="measure", unit="group", enabled=progress):
        edit.quantize({p: s if s in options(sizer, p) else Spec(s.bits) for p in groups[g]})
        kl[(g, s)] = done_kl[_key(g, s)] = meas.kl(_start_layer(g, num_layers))
        edit.restore()
        if save is not None:
            save("measure")
    return kl


def _try_build(whole: _Measure, edit: _Editor, kept: list[list[int]] | None,
               specs: dict[str, Spec]) -> list:
    """[KL of the pruning alone, KL of the complete build, its KL per calibration file] of one
    candidate build, the model restored afterwards."""
    if kept is not None:
        edit.prune(kept)
    prune_kl = whole.kl() if kept is not None else 0.0
    edit.quantize(specs)
    real, per_source = whole.kl_by_source()
    edit.restore()
    return [prune_kl, real, per_source]


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
