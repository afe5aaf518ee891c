"""Calibration text and router statistics, computed one layer at a time.

The model is loaded lazily and run layer by layer over all calibration windows: each layer's
weights are read, used on every window, then dropped. Peak memory is one layer plus the hidden
states of the calibration windows, whatever the size of the checkpoint.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from pocket_mlx.convert.blas import forward_windows, numpy_matmuls
from pocket_mlx.convert.prune import ExpertStats
from pocket_mlx.convert.recipes import Recipe, Spec, glob_rule
from pocket_mlx.corpus import read_documents, token_stream, windows
from pocket_mlx.errors import PocketError
from pocket_mlx.progress import progress as progress_bar


@dataclass
class TextFile:
    name: str
    size: int
    sha256: str
    tokens: int  # tokens used (after any cap)

    def as_dict(self) -> dict:
        return asdict(self)


def file_info(path: Path, tokens: int) -> TextFile:
    data = Path(path).read_bytes()
    return TextFile(Path(path).name, len(data), hashlib.sha256(data).hexdigest(), tokens)


# REAP's calibration tokens per file when --calib-tokens is not given (issue 29): enough for each
# routed expert to see ROUTED_PER_EXPERT of a file's tokens on average (tokens x top_k / experts),
# in whole windows. Measured on the reference (32 experts, top-4; docs/RECIPES.md, "How many
# calibration tokens"): below 1024 tokens a domain (128 routed per expert) the worst domain's
# perplexity rose 5-11% over the 16384-token build's; from 1024 up the builds agree within the
# churn of marginal experts. The 35B (256 experts, top-8) gets 4096; the pass's time is
# linear in tokens x layers.
ROUTED_PER_EXPERT = 128


def reap_tokens(num_experts: int, top_k: int, window: int = 512) -> int:
    """Default calibration tokens per file for expert statistics, in whole windows."""
    need = -(-ROUTED_PER_EXPERT * num_experts // top_k)
    return max(window, -(-need // window) * window)


def calibration_windows(files: list[Path], tokenizer, window: int = 512,
                        max_tokens: int = 16384) -> tuple[list[list[int]], list[TextFile]]:
    """Windows from each file (at most `max_tokens` per file, so domains weigh equally)."""
    chunks, infos = [], []
    for f in files:
        f = Path(f)
        if not f.is_file():
            raise PocketError(f"calibration file {f} does not exist")
        if f.stat().st_size == 0:
            raise PocketError(f"calibration file {f} is empty")
        ids = token_stream(read_documents(f), tokenizer)[:max_tokens]
        if len(ids) < 2:
            raise PocketError(f"calibration file {f} has too little text")
        chunks += windows(ids, window)
        infos.append(file_info(f, len(ids)))
    return chunks, infos


def window_sources(infos: list[TextFile], window: int) -> list[int]:
    """The file index of each window `calibration_windows` returned with these `infos`."""
    out = []
    for i, info in enumerate(infos):
        out += [i] * len(windows(list(range(info.tokens)), window))
    return out


def collect_stats(model, chunks: list[list[int]], progress: bool = True,
                  sources: list[int] | None = None) -> ExpertStats:
    """Run the windows through a (lazily loaded) model layer by layer, observing each MoE
    block. The model's layers are dropped as they are done: do not use it afterwards.
    `sources`: the calibration file of each window, for per-file statistics (reap-max).
    A model with an MTP head gets one more row per head layer (row L + i: `mtp.layers.i`),
    observed as the head runs in drafting: on the trunk's post-norm hidden at t and the
    window's token t+1 (layer i > 0 on layer i-1's output and token t+1+i)."""
    if not chunks:
        raise PocketError("no calibration text")
    lm = model.language_model
    layers = lm.model.layers
    mtp = getattr(model, "mtp", None)
    n_mtp = len(mtp.layers) if mtp is not None else 0
    stats = ExpertStats(len(layers) + n_mtp, model.args.num_experts)
    stats.tokens = sum(len(c) for c in chunks)
    if sources is not None:
        stats.by_source = np.zeros((max(sources) + 1, len(layers) + n_mtp,
                                    model.args.num_experts))
    hs = [lm.model.embed_tokens(mx.array(c, mx.int32)[None]) for c in chunks]
    # The MTP head reads the embeddings of tokens t+1+i: slices of the windows' own.
    emb = [h[:, 1:] for h in hs] if n_mtp else []
    mx.eval(hs, emb)
    # Drop the (float32: 2 GB at the 35B's 248320 x 2048) table before the layer loop.
    lm.model.embed_tokens = None
    for i in progress_bar(range(len(layers)), desc="calibrate", unit="layer",
                          enabled=progress):
        layer = layers[i]
        layer.mlp.observer = stats.observer(i)
        hs = forward_windows(layer, hs, sources, lambda j: setattr(
            stats, "source", sources[j] if sources is not None else 0))
        layer.mlp.observer = None
        layers[i] = None  # drop this layer's weights
        del layer
    if n_mtp:
        _observe_mtp(model, emb, hs, stats, len(layers), sources)
    return stats


def _observe_mtp(model, emb: list[mx.array], hs: list[mx.array], stats: ExpertStats,
                 first_row: int, sources: list[int] | None) -> None:
    """REAP statistics of the MTP head's MoE blocks (rows first_row + i), from the trunk's
    final hidden states `hs` (pre-norm) of each window and the embeddings `emb` of its
    tokens 1.. (the table itself is gone by now)."""
    lm, mtp = model.language_model, model.mtp
    hs = [lm.model.norm(h) for h in hs]
    for i, layer in enumerate(mtp.layers):
        layer.mlp.observer = stats.observer(first_row + i)
        with numpy_matmuls(mtp):
            for j, (e, h) in enumerate(zip(emb, hs)):
                n = e.shape[1] - i  # tokens t+1+i of the window
                if n <= 0:
                    continue
                stats.source = sources[j] if sources is not None else 0
                hs[j] = mtp(h[:, :n], e[:, i:], None, step=i)
                mx.eval(hs[j])
        layer.mlp.observer = None


# ---- `--recipe auto`: spend a bit budget where it lowers the output error most -------------------
AUTO_BITS = (2, 3, 4, 6)


def _groups(model) -> dict[str, list[str]]:
    """Per layer: routed experts, and the dense rest (attention or linear attention plus the
    shared expert); then embeddings and lm_head. Routers and the shared-expert gate are not in
    play (8 bits, tiny). Few groups keep the measurement cheap."""
    groups: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        if not hasattr(m, "to_quantized"):
            continue
        if path.endswith(("mlp.gate", "shared_expert_gate")) or path.startswith("mtp."):
            continue  # the MTP head: not seen by the logits measured; see auto_recipe
        parts = path.split(".")
        if "layers" in parts:
            i = parts[parts.index("layers") + 1]
            fam = "experts" if ".switch_mlp." in path else "dense"
            key = f"layers.{i}.{fam}"
        else:
            key = parts[-1]
        groups.setdefault(key, []).append(path)
    return groups


def _kl(base_logp: mx.array, logp: mx.array) -> float:
    return float((mx.exp(base_logp) * (base_logp - logp)).sum(-1).mean().item())


def auto_recipe(model, chunks: list[list[int]], target_bpw: float, progress: bool = True,
                scale_bits: int = 16):
    """A Recipe for `model` at about `target_bpw` bits per weight: measure the KL divergence of
    the logits when one group alone is quantized at each width, then upgrade greedily the
    group with the best KL drop per extra bit until the budget is spent (KL assumed additive).
    `scale_bits`: width of the stored scales and biases (the output's float dtype)."""
    xs = [mx.array(c, mx.int32)[None] for c in chunks]

    def logprobs() -> list[mx.array]:
        out = []
        with numpy_matmuls(model):
            for x in xs:  # one window at a time: small graphs, no batch-shape corner cases
                lg = model(x).astype(mx.float32)
                out.append(lg - mx.logsumexp(lg, axis=-1, keepdims=True))
                mx.eval(out[-1])
        return out

    base = logprobs()
    groups = _groups(model)
    modules = dict(model.named_modules())
    size = {g: sum(modules[p].weight.size for p in ps) for g, ps in groups.items()}
    kl: dict[tuple[str, int], float] = {}
    todo = [(g, b) for g in groups for b in AUTO_BITS]
    for g, b in progress_bar(todo, desc="auto recipe", unit="group", enabled=progress):
        paths = set(groups[g])
        saved = [(p, modules[p]) for p in paths]
        nn.quantize(model, 64, b, class_predicate=lambda p, m, s=paths: p in s)
        kl[(g, b)] = sum(_kl(p, q) for p, q in zip(base, logprobs())) / len(xs)
        model.update_modules(tree_unflatten(saved))
    overhead = 2 * scale_bits / 64  # a scale and a bias per group of 64
    # Budget over the groups in play; routers and gates are added at 8.5 bits.
    fixed = [p for p in modules if p.endswith(("mlp.gate", "shared_expert_gate"))]
    fixed_bits = sum(modules[p].weight.size for p in fixed) * (8 + overhead)
    total = sum(size.values()) + sum(modules[p].weight.size for p in fixed)
    budget = target_bpw * total - fixed_bits
    bits = {g: AUTO_BITS[0] for g in groups}
    spent = sum(size[g] * (bits[g] + overhead) for g in groups)
    if spent > budget:
        lowest = (spent + fixed_bits) / total
        raise PocketError(f"--target-bpw {target_bpw:g} is below the lowest this recipe "
                          f"reaches ({lowest:.2f})")
    while True:
        best = None
        for g in groups:
            i = AUTO_BITS.index(bits[g])
            if i + 1 == len(AUTO_BITS):
                continue
            nb = AUTO_BITS[i + 1]
            cost = size[g] * (nb - bits[g])
            if spent + cost > budget:
                continue
            gain = (kl[(g, bits[g])] - kl[(g, nb)]) / cost
            if best is None or gain > best[0]:
                best = (gain, g, nb, cost)
        if best is None or best[0] <= 0:
            break
        _, g, nb, cost = best
        bits[g] = nb
        spent += cost
    rules = [glob_rule("*.mlp.gate", Spec(8)), glob_rule("*.shared_expert_gate", Spec(8))]
    for g, ps in groups.items():
        rules += [glob_rule(p, Spec(bits[g])) for p in ps]
    if getattr(model, "mtp", None) is not None:
        # The MTP head, which the logits measured here do not see: its experts at the widest
        # bits any layer's experts got, the rest at the widest dense bits.
        top = {f: max((bits[g] for g in groups if g.endswith(f)), default=4)
               for f in (".experts", ".dense")}
        rules += [glob_rule("mtp.*.switch_mlp.*", Spec(top[".experts"])),
                  glob_rule("mtp.*", Spec(top[".dense"]))]
    recipe = Recipe(f"auto-{target_bpw:g}", rules, default=Spec(4))
    return recipe, {g: {"bits": bits[g], "kl": {b: round(kl[(g, b)], 5) for b in AUTO_BITS}}
                    for g in groups}
