"""The measurements of `--recipe auto --target-size` (convert/budget.py), one layer at a time.

Why: the search held the whole float32 model (139 GB at the 35B shape) and ran every group at
every width through the rest of the model. Here a lazily loaded float model is read layer by
layer, each layer used on every stream and dropped, in two passes:

1. `measure_groups`: per layer, the float output of the calibration windows, with each input
   channel's sum of squares per quantizable matrix (routed experts: per expert, on the tokens
   routed to it; llama.cpp's importance matrix). Each group (the layer's routed experts, its
   dense rest; the embeddings) starts a probe stream of its own: the group quantized alone at
   PROBE, the rest of the model float, carried layer by layer to the logits, where its KL from
   the float stream is measured, as the whole-model search measured it. The other widths scale
   that KL by the ratio of the group's weight errors weighted by those channel squares (no
   forward pass per width); the lm_head's KL is measured at every width. (A first version
   measured each group's error at its own layer's output and turned it into KL with one factor
   for the whole model: it misjudged the layers against each other, and at 75% of the
   reference's IQ2_XS bytes chose a build 8-12% worse in perplexity.) The probe streams make
   this pass quadratic in layers (layer i runs 1 + 2i streams), on few tokens.
2. `judge_builds`: every candidate build (pruned and quantized as it would be written) is a stream
   of its own, run layer by layer beside the float stream; at the end each candidate's KL per
   calibration file, the float log-probabilities computed window by window (never stored for
   all windows).

Memory: one layer (float32) plus the streams (windows x hidden x 4 bytes each: two per layer
in the measure pass, 0.5 GB at the 35B shape's 40 layers and 768 tokens). --resume: after each layer the streams are saved in the temporary folder
(write, rename) and the journal notes the layer, so a killed run continues from it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from pocket_mlx.convert.blas import forward_windows, numpy_matmul
from pocket_mlx.convert.budget import (
    BUDGET_SPECS,
    SearchPlan,
    Sizer,
    _allocate,
    options,
)
from pocket_mlx.convert.prune import ExpertStats, select_experts
from pocket_mlx.convert.recipes import Recipe, Spec
from pocket_mlx.progress import progress as progress_bar

PROBE = Spec(3)  # the width each group is run at through its layer (uniform-3: 1.13-1.17x ppl)
MEASURE_STATE = "budget-measure.safetensors"
JUDGE_STATE = "budget-judge.safetensors"

# (path, float weight, spec, kept expert ids or None) -> (weight, scales, biases) or None: rtn
Quantizer = Callable[[str, mx.array, Spec, "list[int] | None"],
                     "tuple[mx.array, mx.array, mx.array] | None"]


class Edit:
    """Quantizes (and prunes) the modules of one part of the lazily loaded float model (a
    layer, the embeddings, the lm_head), rounding each from its weight in the written dtype,
    and puts them back as they were."""

    def __init__(self, root: nn.Module, prefix: str, quantizer: Quantizer | None,
                 dtypes: dict[str, mx.Dtype]):
        self.root, self.prefix = root, prefix
        self.quantizer, self.dtypes = quantizer, dtypes
        self.kept: list[int] | None = None
        self.saved: list[tuple[str, nn.Module]] = []
        self.pruned: list[tuple[nn.Module, mx.array]] = []

    def prune(self, ids: list[int]) -> None:
        """Keep experts `ids` of this layer: sliced as `quantize` rounds them (from the
        weights cast to the written dtype, so no float32 copy of the kept experts is made)."""
        self.kept = ids

    def _pruned(self, rel: str) -> bool:
        return self.kept is not None and (".switch_mlp." in rel or rel.endswith("mlp.gate"))

    def quantize(self, specs: dict[str, Spec | None]) -> None:
        modules = dict(self.root.named_modules())
        new = []
        for p, spec in specs.items():
            rel = p[len(self.prefix):]
            if not p.startswith(self.prefix) or rel not in modules:
                continue
            m = modules[rel]
            if spec is None:
                if self._pruned(rel):
                    self.pruned.append((m, m.weight))
                    m.weight = m.weight[mx.array(self.kept, mx.int32)]
                continue
            self.saved.append((rel, m))
            q = m.to_quantized(group_size=spec.group_size, bits=spec.bits)
            w = m.weight.astype(self.dtypes.get(p, m.weight.dtype))
            if self._pruned(rel):
                w = w[mx.array(self.kept, mx.int32)]
            got = self.quantizer(p, w, spec, self.kept) if self.quantizer else None
            q.weight, q.scales, q.biases = (got if got is not None
                                            else mx.quantize(w, spec.group_size, spec.bits))
            # Now, one matrix at a time: left lazy, every matrix's cast copy (0.5 GB each for a
            # 35B layer's experts) would be alive at once when the layer first runs.
            mx.eval(q.weight, q.scales, q.biases)
            new.append((rel, q))
        if new:
            self.root.update_modules(tree_unflatten(new))

    def restore(self) -> None:
        if self.saved:
            self.root.update_modules(tree_unflatten(self.saved))
        for m, w in reversed(self.pruned):
            m.weight = w
        self.saved, self.pruned, self.kept = [], [], None


class _Squares(nn.Module):
    """Stands in for a Linear or a routed experts' SwitchLinear while the float layer runs:
    adds up each input channel's square (per expert for routed experts)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.sq: mx.array | None = None

    def __call__(self, x: mx.array, indices: mx.array | None = None, **kw) -> mx.array:
        if indices is None:
            s = (x.astype(mx.float32) ** 2).reshape(-1, x.shape[-1]).sum(0)
            out = self.module(x)
        else:  # SwitchGLU: x [..., 1, K] broadcast over the k experts of each token
            xs = mx.broadcast_to(x.squeeze(-2), (*indices.shape, x.shape[-1]))
            n = self.module.weight.shape[0]
            s = mx.zeros((n, x.shape[-1]), mx.float32).at[indices.reshape(-1)].add(
                (xs.astype(mx.float32) ** 2).reshape(-1, x.shape[-1]))
            out = self.module(x, indices, **kw)
        self.sq = s if self.sq is None else self.sq + s
        mx.eval(self.sq)
        return out


def _squares(layer: nn.Module, prefix: str, paths: list[str], run: Callable[[], None]
             ) -> dict[str, mx.array]:
    """Run `run` (the float layer on every window) with `paths` watched: each path's input
    channel squares."""
    mods = dict(layer.named_modules())
    wrapped = [(p[len(prefix):], _Squares(mods[p[len(prefix):]])) for p in paths]
    layer.update_modules(tree_unflatten(wrapped))
    try:
        run()
    finally:
        layer.update_modules(tree_unflatten([(r, w.module) for r, w in wrapped]))
    return {prefix + r: w.sq for r, w in wrapped if w.sq is not None}


# Only the ratios between a group's widths are used, so a sample of its weights stands for
# it: the WERR_EXPERTS experts of a stack most used on the windows, and at most WERR_ROWS rows
# of each matrix (evenly spaced). A 35B layer in full at 10 widths took minutes (MLX's CPU
# quantize and dequantize, ~100 ns a weight).
WERR_EXPERTS = 8
WERR_ROWS = 512


def weight_error(w: mx.array, sq: mx.array, spec: Spec, dtype: mx.Dtype, path: str,
                 quantizer: Quantizer | None) -> float:
    """Sum over rows of (w - its rounding)^2 weighted by the input channels' squares `sq`
    ([K], or [E, K] for stacked experts): the output error on the windows if the channels were
    uncorrelated. Stacks are rounded a slice of experts at a time (bounded memory)."""
    def part(wp: mx.array, sp: mx.array, whole: bool) -> float:
        wd = wp.astype(dtype)
        got = quantizer(path, wd, spec, None) if quantizer and whole else None
        q, s, b = got if got is not None else mx.quantize(wd, spec.group_size, spec.bits)
        err = (wp.astype(mx.float32) - mx.dequantize(q, s, b, spec.group_size, spec.bits)
               .astype(mx.float32)) ** 2
        return float((err * sp[..., None, :]).sum().item())

    if quantizer is not None:
        return part(w, sq, True)
    if w.shape[-2] > WERR_ROWS:
        w = w[..., ::w.shape[-2] // WERR_ROWS, :]
    if w.ndim == 2:
        return part(w, sq, True)
    if w.shape[0] > WERR_EXPERTS:
        top = mx.argsort(-sq.sum(-1))[:WERR_EXPERTS]
        w, sq = w[top], sq[top]
    step = max(1, (64 << 20) // max(1, math.prod(w.shape[1:])))
    return sum(part(w[i:i + step], sq[i:i + step], False) for i in range(0, w.shape[0], step))


# The log-probabilities and KL run in numpy: at the 35B's 248320-word vocabulary a window's
# logits are 250 MB, and MLX's CPU exp took ~80 ns an element here (numpy's SIMD one ~5x less).
# Both go ROWS tokens at a time, from the head's product on: only the float stream's
# log-probabilities are held whole (they are what every other stream is compared with); a
# compared stream's exist one block at a time, and no whole-window logits are ever made
# (before, a window's logits, their copy and a compared stream's log-probabilities, 250 MB
# each, sat beside the 2 GB float head and the candidates' quantized heads).
ROWS = 128


def _logp_rows(lm, h: mx.array) -> np.ndarray:
    """Log-probabilities [rows, vocab] (float32) of final hidden states `h` [1, rows, H]."""
    h = lm.model.norm(h)
    lg = (lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings
          else numpy_matmul(lm.lm_head)(h))
    z = np.array(lg.astype(mx.float32)).reshape(-1, lg.shape[-1])
    del lg
    z -= z.max(-1, keepdims=True)
    z -= np.log(np.exp(z).sum(-1, keepdims=True))
    return z


def logp(lm, h: mx.array) -> np.ndarray:
    """Log-probabilities [tokens, vocab] (float32) of the final hidden states `h`."""
    h = h.reshape(1, -1, h.shape[-1])
    out = None
    for a in range(0, h.shape[1], ROWS):
        z = _logp_rows(lm, h[:, a:a + ROWS])
        if out is None:
            out = np.empty((h.shape[1], z.shape[1]), np.float32)
        out[a:a + len(z)] = z
    return out


class Base:
    """The float model's distribution on one window: KL(float || q) summed over its tokens."""

    def __init__(self, p: np.ndarray):
        self.p = p

    def kl_sum(self, lm, h: mx.array) -> float:
        """KL summed over the window's tokens, q the log-probabilities of final hidden states
        `h` (made ROWS tokens at a time)."""
        h = h.reshape(1, -1, h.shape[-1])
        total = 0.0
        for a in range(0, len(self.p), ROWS):
            p, q = self.p[a:a + ROWS], _logp_rows(lm, h[:, a:a + ROWS])
            total += float((np.exp(p) * (p - q)).sum(dtype=np.float64))
        return total


class State:
    """The streams of a pass after its n-th layer, in the temporary folder (--resume)."""

    def __init__(self, folder: Path | None, name: str):
        self.path = Path(folder) / name if folder is not None else None

    def save(self, layers: int, streams: dict[str, list[mx.array]]) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(".new-" + self.path.name)
        mx.save_safetensors(str(tmp), {f"{k}.{j}": h for k, hs in streams.items()
                                       for j, h in enumerate(hs)}, {"layers": str(layers)})
        fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, self.path)

    def load(self, layers: int, names: list[str], n: int) -> dict[str, list[mx.array]] | None:
        if self.path is None or not self.path.exists() or layers == 0:
            return None
        data, meta = mx.load(str(self.path), return_metadata=True)
        if meta.get("layers") != str(layers):
            return None
        return {k: [data[f"{k}.{j}"] for j in range(n)] for k in names}

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _embed(lm, xs: list[mx.array], edit: Edit | None = None, spec: Spec | None = None,
           path: str = "language_model.model.embed_tokens") -> list[mx.array]:
    if edit is not None and spec is not None:
        edit.quantize({path: spec})
    hs = [lm.model.embed_tokens(x) for x in xs]
    mx.eval(hs)
    if edit is not None:
        edit.restore()
    return hs


def measure_groups(model, chunks: list[list[int]], groups: dict[str, list[str]],
            specs_of: Callable[[str], list[Spec]], module_spec: Callable[[str, Spec], Spec],
            quantizer: Quantizer | None, dtypes: dict[str, mx.Dtype], memo: dict,
            save: Callable[[str], None] | None, folder: Path | None, progress: bool
            ) -> dict[str, float]:
    """{"group|bits|group_size": estimated KL} of every group at every width it can take
    (module doc, pass 1). `memo` is the journal's section: each finished layer's numbers
    are put there before `save("measure")`, with the streams in `folder`."""
    lm = model.language_model
    layers = lm.model.layers
    L = len(layers)
    xs = [mx.array(c, mx.int32)[None] for c in chunks]
    werr: dict[str, float] = memo.setdefault("werr", {})  # weighted weight error per width
    state = State(folder, MEASURE_STATE)
    done = memo.get("layers", 0)
    emb_path = "language_model.model.embed_tokens"
    embed = "embed_tokens" in groups
    # Streams: "h" the float model, one per group already quantized at PROBE (alone).
    names = ["h"] + (["embed_tokens"] if embed else []) + [
        g for i in range(done) for g in (f"layers.{i}.dense", f"layers.{i}.experts")
        if g in groups]
    streams = state.load(done, names, len(xs))
    if streams is None:
        done = 0
        streams = {"h": _embed(lm, xs)}
        if embed:
            edit = Edit(lm.model, "language_model.model.", quantizer, dtypes)
            streams["embed_tokens"] = _embed(lm, xs, edit, PROBE, emb_path)
            _embed_errors(lm, xs, specs_of("embed_tokens"), dtypes, werr)
    if not lm.args.tie_word_embeddings:
        lm.model.embed_tokens = None  # 2 GB in float32 at the 35B shape
    for i in progress_bar(range(done, L), desc="measure", unit="layer", enabled=progress):
        _measure_layer(layers[i], i, streams, groups, specs_of, module_spec, quantizer,
                       dtypes, werr)
        layers[i] = None
        memo["layers"] = i + 1
        state.save(i + 1, streams)
        if save is not None:
            save("measure")
    # Each probe stream's KL at the logits, and the lm_head's at every width on the float
    # stream: 248320 x 2048 per token at the 35B shape, ~10 s for 768 tokens here.
    h = streams.pop("h")
    heads = specs_of("lm_head") if "lm_head" in groups else []
    bar = progress_bar(total=1 + len(streams) + len(heads), desc="measure logits",
                       unit="stream", enabled=progress)
    base = [Base(logp(lm, x)) for x in h]
    bar.update(1)
    n = sum(x.shape[1] for x in h)
    kl: dict[str, float] = {}
    probe_kl = {}
    for g, hs in streams.items():
        probe_kl[g] = sum(b.kl_sum(lm, x) for b, x in zip(base, hs)) / n
        bar.update(1)
    if heads:
        path = groups["lm_head"][0]
        edit = Edit(lm, "language_model.", quantizer, dtypes)
        for s in heads:
            edit.quantize({path: module_spec(path, s)})
            kl[_key("lm_head", s)] = sum(b.kl_sum(lm, x) for b, x in zip(base, h)) / n
            edit.restore()
            bar.update(1)
    bar.close()
    # Other widths: the group's KL at PROBE times the ratio of its weighted weight errors.
    for g, kp in probe_kl.items():
        w0 = werr.get(_key(g, PROBE), 0.0)
        for s in specs_of(g):
            kl[_key(g, s)] = kp * werr[_key(g, s)] / w0 if w0 > 0 else 0.0
    memo["probe_kl"] = probe_kl
    state.remove()
    return kl


def _key(group: str, spec: Spec) -> str:
    return f"{group}|{spec.bits}|{spec.group_size}"


def _embed_errors(lm, xs: list[mx.array], specs: list[Spec], dtypes: dict[str, mx.Dtype],
                  werr: dict[str, float]) -> None:
    """The embeddings' error at each width, each row weighted by how often the windows read
    it (exact for the rows they read)."""
    path = "language_model.model.embed_tokens"
    w = lm.model.embed_tokens.weight
    ids = np.concatenate([np.array(x).reshape(-1) for x in xs])
    count = np.bincount(ids, minlength=w.shape[0]).astype(np.float32)
    used = np.nonzero(count)[0]
    rows = w[mx.array(used, mx.int32)]
    weights = mx.array(count[used])[:, None]  # each row's reads, as a channel "square"
    for s in specs:
        wd = rows.astype(dtypes.get(path, rows.dtype))
        q, sc, b = mx.quantize(wd, s.group_size, s.bits)
        err = (rows.astype(mx.float32)
               - mx.dequantize(q, sc, b, s.group_size, s.bits).astype(mx.float32)) ** 2
        werr[_key("embed_tokens", s)] = float((err * weights).sum().item())


def _measure_layer(layer, i: int, streams: dict[str, list[mx.array]],
                   groups: dict[str, list[str]], specs_of, module_spec, quantizer,
                   dtypes: dict[str, mx.Dtype], werr: dict[str, float]) -> None:
    """One layer of `measure`: the float stream and every earlier group's probe stream go
    through the float layer; each of this layer's groups starts its probe stream (the group
    at PROBE, from the float input); its weighted weight errors at every width go to
    `werr`."""
    prefix = f"language_model.model.layers.{i}."
    mine = {g: ps for g, ps in groups.items() if g in (f"layers.{i}.dense",
                                                        f"layers.{i}.experts")}
    h = streams["h"]
    out: list[mx.array] = []

    def run() -> None:
        out.extend(forward_windows(layer, h))

    sq = _squares(layer, prefix, [p for ps in mine.values() for p in ps], run)
    # Every probe stream through the float layer, their windows batched together.
    names = [g for g in streams if g != "h"]
    outs = forward_windows(layer, [x for g in names for x in streams[g]])
    for g in names:
        n = len(streams[g])
        streams[g], outs = outs[:n], outs[n:]
    edit = Edit(layer, prefix, quantizer, dtypes)
    for g, ps in mine.items():
        edit.quantize({p: module_spec(p, PROBE) for p in ps})
        streams[g] = forward_windows(layer, h)
        edit.restore()
    streams["h"] = out
    modules = dict(layer.named_modules())
    for g, ps in mine.items():
        for s in specs_of(g):
            werr[_key(g, s)] = sum(
                weight_error(modules[p[len(prefix):]].weight, sq[p], module_spec(p, s),
                             dtypes.get(p, mx.float32), p, quantizer)
                for p in ps if p in sq)


def judge_builds(model, chunks: list[list[int]], sources: list[int],
          builds: list[tuple[list[list[int]] | None, dict[str, Spec]]],
          quantizer: Quantizer | None, dtypes: dict[str, mx.Dtype], memo: dict,
          save: Callable[[str], None] | None, folder: Path | None, progress: bool
          ) -> list[tuple[float, list[float]]]:
    """(mean KL, KL per calibration file) of each complete build (experts kept per layer or
    None, spec per module), all run as streams beside the float one (module doc, pass 2).
    `memo`: the journal's section, "layers" done with the streams in `folder`."""
    lm = model.language_model
    layers = lm.model.layers
    L = len(layers)
    xs = [mx.array(c, mx.int32)[None] for c in chunks]
    names = ["f"] + [f"c{i}" for i in range(len(builds))]
    state = State(folder, JUDGE_STATE)
    done = memo.get("layers", 0)
    got = state.load(done, names, len(xs))
    if got is None:
        done = 0
        streams = {"f": _embed(lm, xs)}
        edit = Edit(lm.model, "language_model.model.", quantizer, dtypes)
        path = "language_model.model.embed_tokens"
        for n, (_, specs) in zip(names[1:], builds):
            streams[n] = _embed(lm, xs, edit, specs.get(path), path)
    else:
        streams = got
    if not lm.args.tie_word_embeddings:
        lm.model.embed_tokens = None
    for i in progress_bar(range(done, L), desc="search", unit="layer", enabled=progress):
        layer = layers[i]
        edit = Edit(layer, f"language_model.model.layers.{i}.", quantizer, dtypes)
        for n, (kept, specs) in zip(names[1:], builds):
            if kept is not None:
                edit.prune(kept[i])
            edit.quantize(specs)
            streams[n] = forward_windows(layer, streams[n])
            edit.restore()
        streams["f"] = forward_windows(layer, streams["f"])
        layers[i] = None
        del layer, edit
        memo["layers"] = i + 1
        state.save(i + 1, streams)
        if save is not None:
            save("search")
    # The logits: the float log-probabilities one window at a time, each build's against them.
    edit = Edit(lm, "language_model.", quantizer, dtypes)
    S = max(sources) + 1
    total = np.zeros((len(builds), S))
    count = np.zeros(S)
    heads: dict = {}
    for n, (_, specs) in zip(names[1:], builds):
        heads.setdefault(tuple(sorted((p, s) for p, s in specs.items()
                                      if p.startswith("language_model.lm_head")
                                      and s is not None)), []).append(n)
    # Each distinct head quantized once (2.5 s for the 35B's 248320-row head), not once per
    # window: a few quantized heads (<= 0.5 GB each) are held side by side instead.
    float_head = lm.lm_head if "lm_head" in lm else None
    quantized = {}
    for head in heads:
        edit.quantize(dict(head))
        quantized[head] = lm.lm_head if float_head is not None else None
        edit.restore()
    for j, x in enumerate(progress_bar(streams["f"], desc="search logits", unit="window",
                                       enabled=progress)):
        base = Base(logp(lm, x))
        count[sources[j]] += x.shape[1]
        for head, ns in heads.items():
            if quantized[head] is not None:
                lm.lm_head = quantized[head]
            for n in ns:
                total[names.index(n) - 1, sources[j]] += base.kl_sum(lm, streams[n][j])
            if float_head is not None:
                lm.lm_head = float_head
        del base
    state.remove()
    per = total / np.maximum(count, 1)
    return [(float(t.sum() / count.sum()), [float(v) for v in p]) for t, p in zip(total, per)]


def streamed_budget_recipe(load: Callable[[], object], chunks: list[list[int]],
                  stats: ExpertStats | None, sizer: Sizer, target: int,
                  criterion: str = "reap-sum", seed: int = 0, progress: bool = True,
                  log: Callable[[str], None] = print, quantizer: Quantizer | None = None,
                  sources: list[int] | None = None,
                  judge: tuple[list[list[int]], list[int]] | None = None,
                  memo: dict | None = None, save: Callable[[str | None], None] | None = None,
                  folder: Path | None = None) -> tuple[Recipe, int | None, dict]:
    """budget.budget_recipe for a model too big to hold in float32 (module doc): (recipe,
    experts to keep per layer or None for all, report) for a build of at most `target` weight
    bytes. `load()`: the float model, lazily loaded (each pass reads it layer by layer and
    drops what it has used). `sources`: the
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
    plan = SearchPlan.of(model, sizer, target)
    E, L, groups = plan.E, plan.L, plan.groups

    def specs_of(g: str) -> list[Spec]:
        # A group is measured at every width one of its modules can take; a module that
        # cannot take it is measured at the same bits in groups of DEFAULT_GROUP.
        return [s for s in BUDGET_SPECS if any(s in options(sizer, u) for u in groups[g])]

    def module_spec(p: str, s: Spec) -> Spec:
        return s if s in options(sizer, p) else Spec(s.bits)

    if not memo.get("measured"):
        done_kl.update(measure_groups(model, chunks, groups, specs_of, module_spec, quantizer,
                                      sizer.dtypes, memo.setdefault("measure", {}), save,
                                      folder, progress))
        memo["measured"] = True
        if save is not None:
            save(None)
    del model
    kl = {(g, s): done_kl[_key(g, s)] for g in groups for s in specs_of(g)}
    plans = []
    for k, crit in plan.runs(stats, criterion):
        kept = select_experts(stats, k, crit, L, E, seed) if k < E else None
        specs, spent = _allocate(plan.units, plan.share, plan.group_of, kl, sizer, k,
                                 plan.fixed, target)
        plans.append((k, crit, kept, specs, spent))
    todo = [p for p in plans if f"{p[0]}|{p[1]}" not in done_tried]
    if todo:
        chunks_j, sources_j = judge if judge is not None else (chunks, sources)
        got = judge_builds(load(), chunks_j, sources_j,
                           [(kept, {**plan.fixed, **specs}) for _, _, kept, specs, _ in todo],
                           quantizer, sizer.dtypes, memo.setdefault("judge", {}), save, folder,
                           progress)
        for (k, crit, *_), (real, per_source) in zip(todo, got):
            done_tried[f"{k}|{crit}"] = [None, real, per_source]
        if save is not None:
            save(None)
    tried = [plan.tried_row(k, crit, kept, specs, spent, kl, *done_tried[f"{k}|{crit}"][1:])
             for k, crit, kept, specs, spent in plans]
    recipe, experts, report = plan.finish(target, tried, kl, chunks,
                                          judge[0] if judge is not None else chunks, log)
    report["kl_probe"] = memo.get("measure", {}).get("probe_kl")
    return recipe, experts, report
