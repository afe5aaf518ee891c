"""Routing consistency: how often a compressed model picks the same experts as a reference.

For every token of the same text, each MoE layer's router chooses a set of k experts in both
models. Consistency of one token in one layer is |topk_model ∩ topk_ref| / k; a layer's
consistency is its mean over tokens, the overall number the mean over layers (every layer sees
the same tokens, so this is also the mean over all (token, layer) pairs). Identical models give
1.0. Expert ids of a pruned model are local to what it kept: they are mapped back to the
original ids through pocket.json's `kept_experts` (written by `convert --prune-to`), so a pruned
model is compared in the original model's id space (an expert it dropped can never match).
Both models see the same windows, so differences in routing come from the weights alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from pocket_mlx.config import read_pocket_json
from pocket_mlx.corpus import windows
from pocket_mlx.errors import PocketError


@dataclass
class Routes:
    """The experts each token routed to, per layer, in original expert ids."""

    per_layer: list[np.ndarray]  # one [tokens, k] int32 array per MoE layer
    num_experts: int  # experts of the original (unpruned) model
    top_k: int

    @property
    def tokens(self) -> int:
        return int(self.per_layer[0].shape[0]) if self.per_layer else 0


@dataclass
class Consistency:
    overall: float
    per_layer: list[float]
    tokens: int
    top_k: int

    def as_dict(self) -> dict:
        return {"overall": round(self.overall, 5),
                "per_layer": [round(v, 5) for v in self.per_layer],
                "tokens": self.tokens, "top_k": self.top_k}


def kept_experts(folder: Path, num_layers: int, num_experts: int) -> list[np.ndarray] | None:
    """Per layer, the original id of each local expert of a pruned model (pocket.json's
    `kept_experts`); None for a model that was not pruned."""
    info = read_pocket_json(Path(folder))
    kept = info.get("kept_experts") or (info.get("pruning") or {}).get("kept_experts")
    if not kept:
        return None
    try:
        out = [np.asarray(kept[str(i)], np.int32) for i in range(num_layers)]
    except (KeyError, TypeError, ValueError):
        raise PocketError(f"{folder}/pocket.json: kept_experts does not list all "
                          f"{num_layers} layers; rewrite it with pocket-mlx convert") from None
    if any(len(ids) != num_experts for ids in out):
        raise PocketError(f"{folder}/pocket.json: kept_experts does not match the model's "
                          f"{num_experts} experts per layer")
    return out


def original_experts(folder: Path, num_experts: int) -> int:
    """Experts per layer of the original model (pocket.json), else the model's own."""
    n = read_pocket_json(Path(folder)).get("original_num_experts")
    return int(n) if isinstance(n, int) and n >= num_experts else num_experts


def _moe_blocks(model) -> list:
    return [layer.mlp for layer in model.language_model.model.layers]


class RouteRecorder:
    """Records every MoE layer's top-k expert ids while the model runs (any forward: a
    perplexity pass, say), mapped to original ids with `folder`'s pocket.json. Use as a
    context manager; `routes()` afterwards."""

    def __init__(self, model, folder: Path | None = None):
        args = model.args
        self.blocks = _moe_blocks(model)
        n = len(self.blocks)
        self.kept = kept_experts(folder, n, args.num_experts) if folder is not None else None
        self.num_experts = (original_experts(folder, args.num_experts) if folder is not None
                            else args.num_experts)
        self.top_k = int(args.num_experts_per_tok)
        self.got: list[list[np.ndarray]] = [[] for _ in range(n)]
        self.saved = []

    def _observer(self, i: int):
        def observe(x, inds, scores, experts) -> None:
            self.got[i].append(np.array(inds.reshape(-1, inds.shape[-1]).astype(mx.int32)))
        return observe

    def __enter__(self) -> RouteRecorder:
        self.saved = [b.observer for b in self.blocks]
        for i, b in enumerate(self.blocks):
            b.observer = self._observer(i)
        return self

    def __exit__(self, *exc) -> None:
        for b, s in zip(self.blocks, self.saved):
            b.observer = s

    def routes(self) -> Routes:
        if not self.got or not self.got[0]:
            raise PocketError("no tokens were routed")
        per_layer = [np.concatenate(g) for g in self.got]
        if self.kept is not None:
            per_layer = [self.kept[i][a] for i, a in enumerate(per_layer)]
        return Routes(per_layer, self.num_experts, self.top_k)


def record_routes(model, ids: list[int], window: int, folder: Path | None = None,
                  progress: Callable[[int, int], None] | None = None) -> Routes:
    """Run `ids` through `model` in non-overlapping windows (as eval-ppl does) and record each
    MoE layer's top-k expert ids, mapped to original ids with `folder`'s pocket.json."""
    chunks = windows(ids, window)
    if not chunks:
        raise PocketError("no text to compare routing on")
    with RouteRecorder(model, folder) as rec:
        for j, c in enumerate(chunks):
            mx.eval(model(mx.array(c, mx.int32)[None]))
            if progress:
                progress(j + 1, len(chunks))
    return rec.routes()


def check_comparable(a: Routes, b: Routes, name_a: str = "the model",
                     name_b: str = "the reference") -> None:
    if len(a.per_layer) != len(b.per_layer):
        raise PocketError(f"{name_a} has {len(a.per_layer)} MoE layers, {name_b} "
                          f"{len(b.per_layer)}: routing can only be compared between builds of "
                          "the same model")
    if a.num_experts != b.num_experts:
        raise PocketError(f"{name_a} comes from a model with {a.num_experts} experts per layer, "
                          f"{name_b} from one with {b.num_experts}: not builds of the same model")
    if a.top_k != b.top_k:
        raise PocketError(f"{name_a} routes to {a.top_k} experts per token, {name_b} to "
                          f"{b.top_k}: not builds of the same model")
    if a.tokens != b.tokens:
        raise PocketError(f"{name_a} saw {a.tokens} tokens, {name_b} {b.tokens}: the two "
                          "models must share a tokenizer")


def consistency(a: Routes, b: Routes) -> Consistency:
    """Mean over tokens of |topk_a ∩ topk_b| / k, per layer and overall."""
    check_comparable(a, b)
    k = a.top_k
    per_layer = []
    for x, y in zip(a.per_layer, b.per_layer):
        # Pairwise equality [T, k, k]; ids within one token's top-k are distinct.
        shared = (x[:, :, None] == y[:, None, :]).any(-1).sum(-1)
        per_layer.append(float(shared.mean() / k))
    return Consistency(float(np.mean(per_layer)), per_layer, a.tokens, k)


@dataclass
class RoutingResult:
    consistency: Consistency
    seconds: float


def routing_consistency(model, ref, ids: list[int], window: int, folder: Path | None,
                        ref_folder: Path | None) -> RoutingResult:
    """Record both models' routes on the same windows of `ids` and compare them."""
    t0 = time.perf_counter()
    mine = record_routes(model, ids, window, folder)
    theirs = record_routes(ref, ids, window, ref_folder)
    return RoutingResult(consistency(mine, theirs), time.perf_counter() - t0)
