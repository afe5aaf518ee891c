"""What activation-aware rounding (`convert --rounding gptq|awq`) reads, one layer at a time.

Each module is rounded on the inputs it saw in the float model (float32) on the calibration
text. Those come layer by layer, as REAP's calibration pass does (calibrate.collect_stats): the
calibration hidden states go through one float layer, which records the inputs of its modules
(routed experts: the MoE input and each token's experts), its modules are rounded, then it is
dropped and the next layer takes its outputs. So memory is one float32 layer, one module's
rounding and the hidden states (tokens x hidden x 4 B), whatever the number of layers: the
35B's 40 layers stream like 2 (docs/RECIPES.md, "Converting the real 35B").

`round_layer` is the per-layer step; `StreamedRounding` drives it for the writer, unit by unit
(pipeline.converted_tensors); `capture` records a whole loaded model's inputs at once (small
models: the --target-size search rounds its candidates from it).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from pocket_mlx.convert.blas import materialize, numpy_matmuls
from pocket_mlx.convert.recipes import Spec
from pocket_mlx.convert.rounding import AWQ_ROWS, Inputs, quantize_matrix, sample_rows, select

log = logging.getLogger(__name__)

Rounded = tuple[mx.array, mx.array, mx.array]  # MLX affine (weight, scales, biases)
EXPERTS = ("gate_proj", "up_proj", "down_proj")


class Target(NamedTuple):
    """A module to round: its width, the float dtype it is written in (its scales' dtype), and
    the experts its layer keeps (None: all), which slice the router's rows and the experts."""
    spec: Spec
    dtype: mx.Dtype
    kept: list[int] | None = None


class _Catcher(nn.Module):
    """Stands in for a Linear during capture: accumulates its inputs, then runs it. H in
    float64 (a dense module's is at most 8192^2 x 8 B); rows only for AWQ (float32: exact)."""

    def __init__(self, module: nn.Module, method: str):
        super().__init__()
        self.module = module
        self._method = method
        self.H: np.ndarray | None = None
        self.count = 0
        self.rows: list[np.ndarray] = []

    def __call__(self, x: mx.array) -> mx.array:
        self.observe(x)
        return self.module(x)

    def observe(self, x: mx.array) -> None:
        x32 = np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32))
        if self._method != "awq":
            xf = x32.astype(np.float64)
            if self.H is None:
                self.H = np.zeros((xf.shape[1],) * 2)
            self.H += xf.T @ xf
        else:
            self.rows.append(x32)
        self.count += len(x32)

    def inputs(self) -> Inputs:
        rows = [sample_rows(np.concatenate(self.rows), AWQ_ROWS).astype(np.float64)] \
            if self.rows else []
        return Inputs(self.H, rows, np.array(self.count))


class _Routed:
    """What a layer's routed experts saw: the MoE input rows x [T, K] (float32) and each row's
    experts. Expert e's rows, in token order, and its down_proj inputs (the SwiGLU of its
    gate and up projections, from the float layer's weights) are made when asked for."""

    def __init__(self, x: np.ndarray, inds: np.ndarray, switch):
        self.x, self.inds, self.switch = x, inds, switch
        E = switch.gate_proj.weight.shape[0]
        self.count = np.array([(inds == e).any(-1).sum() for e in range(E)])

    def rows_in(self, e: int) -> np.ndarray:
        return self.x[(self.inds == e).any(-1)].astype(np.float64)

    def rows_mid(self, e: int) -> np.ndarray:
        xe = self.rows_in(e)
        sw = self.switch
        wg = np.array(sw.gate_proj.weight[e].astype(mx.float32), np.float64)
        wu = np.array(sw.up_proj.weight[e].astype(mx.float32), np.float64)
        g, u = xe @ wg.T, xe @ wu.T
        return g / (1 + np.exp(-g)) * u  # the SwiGLU that feeds down_proj

    def inputs(self, prefix: str) -> dict[str, Inputs]:
        p = f"{prefix}.mlp.switch_mlp"
        up = Inputs(None, [], self.count, self.rows_in)
        return {f"{p}.gate_proj": up, f"{p}.up_proj": up,
                f"{p}.down_proj": Inputs(None, [], self.count, self.rows_mid)}


def capture_layer(layer, prefix: str, hs: list[mx.array], want, method: str
                  ) -> dict[str, Inputs]:
    """Run the hidden states `hs` (one [1, T, H] per window) through `layer`, replacing each
    by the layer's output, and return the inputs of its modules `want(path)` picks (`prefix`:
    the layer's path)."""
    catchers = {rel: _Catcher(m, method) for rel, m in layer.named_modules()
                if isinstance(m, nn.Linear) and want(f"{prefix}.{rel}")}
    moe = getattr(layer, "mlp", None)
    routed = hasattr(moe, "switch_mlp") and any(
        want(f"{prefix}.mlp.switch_mlp.{n}") for n in EXPERTS)
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def observe(x, inds, scores, experts) -> None:
        seen.append((np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32)),
                     np.array(inds.reshape(-1, inds.shape[-1]))))

    originals = [(rel, c.module) for rel, c in catchers.items()]
    layer.update_modules(tree_unflatten(list(catchers.items())))
    if routed:
        moe.observer = observe
    try:
        forward(layer, hs)
    finally:
        if routed:
            moe.observer = None
        layer.update_modules(tree_unflatten(originals))
    out = {f"{prefix}.{rel}": c.inputs() for rel, c in catchers.items()}
    if routed:
        out.update(_Routed(np.concatenate([s[0] for s in seen]),
                           np.concatenate([s[1] for s in seen]), moe.switch_mlp).inputs(prefix))
    return out


def _slices_experts(path: str) -> bool:
    """Whether pruning cuts this module (prune.slice_layer): the router's rows, the experts."""
    return path.endswith(".mlp.gate") or ".mlp.switch_mlp." in path


def round_modules(modules: dict[str, nn.Module], targets: dict[str, Target],
                  inputs: dict[str, Inputs], method: str) -> dict[str, Rounded]:
    """Round each target module (float weights) on its inputs, as the writer would round the
    source's weights: pruned to the kept experts, cast to the written dtype first."""
    out = {}
    for path in sorted(targets):
        spec, dtype, kept = targets[path]
        w, inp = modules[path].weight, inputs.get(path)
        if kept is not None and _slices_experts(path):
            w = w[mx.array(kept, mx.int32)]
            if inp is not None and ".switch_mlp." in path:
                inp = select(inp, kept)
        out[path] = quantize_matrix(w.astype(dtype), spec.bits, spec.group_size, method, inp)
        mx.eval(out[path])
    return out


def round_layer(layer, prefix: str, hs: list[mx.array], targets: dict[str, Target],
                method: str) -> dict[str, Rounded]:
    """The per-layer step: run the calibration hidden states `hs` through the float `layer`
    (each replaced by the layer's output, from the float weights: the next layer's inputs are
    the float model's, as `capture`'s are), recording what its modules in `targets` saw, and
    round those. Returns {module path: (weight, scales, biases)}."""
    mine = {p: t for p, t in targets.items() if p.startswith(prefix + ".")}
    if not mine:
        forward(layer, hs)
        return {}
    inputs = capture_layer(layer, prefix, hs, mine.__contains__, method)
    modules = {f"{prefix}.{rel}": m for rel, m in layer.named_modules()}
    return round_modules(modules, mine, inputs, method)


def forward(layer, hs: list[mx.array]) -> None:
    """Replace each hidden state in `hs` by `layer`'s output (float32 matmuls in numpy's BLAS
    on the CPU: convert/blas.py)."""
    with numpy_matmuls(layer):
        for j, h in enumerate(hs):
            hs[j] = layer(h)
            mx.eval(hs[j])


def _lm_head_inputs(lm, hs: list[mx.array], method: str) -> Inputs:
    """lm_head's inputs (the final norm of the last hidden states); its logits, 248320 wide
    for the 35B, are not needed."""
    catcher = _Catcher(lm.lm_head, method)
    for h in hs:
        catcher.observe(lm.model.norm(h))
    return catcher.inputs()


def capture(model, chunks: list[list[int]], method: str = "gptq") -> dict[str, Inputs]:
    """Every quantizable matrix's inputs on the calibration windows (routed experts: per
    expert, only its tokens), from a loaded float model, which stays usable. The experts'
    inputs read the model's weights when rounded: keep it alive. Small models only (all
    layers' inputs are held at once)."""
    lm = model.language_model
    hs = [lm.model.embed_tokens(mx.array(c, mx.int32)[None]) for c in chunks]
    mx.eval(hs)
    store: dict[str, Inputs] = {}
    for i, layer in enumerate(lm.model.layers):
        store.update(capture_layer(layer, f"language_model.model.layers.{i}", hs,
                                   lambda p: True, method))
    if not lm.args.tie_word_embeddings:
        store["language_model.lm_head"] = _lm_head_inputs(lm, hs, method)
    return store


class StreamedRounding:
    """The writer's source of activation-aware roundings: called with each write unit in
    order (0 embeddings, 1..L layers, L+1 final norm and lm_head, L+2 the MTP head; see
    pipeline._unit), it reads that unit's float weights from the lazily loaded float32 `model`,
    rounds the unit's `targets` and drops the weights; `skip` (a resumed run's units already
    written) only carries the hidden states through. The MTP head is not run (its modules are
    rounded to nearest, as with `capture`)."""

    def __init__(self, model, chunks: list[list[int]], targets: dict[str, Target], method: str):
        self.lm, self.chunks, self.targets, self.method = model.language_model, chunks, \
            targets, method
        self.hs: list[mx.array] | None = None
        self.seconds = {"inputs+rounding": 0.0, "cpu": 0.0}

    def __call__(self, unit: int, skip: bool = False) -> dict[str, Rounded]:
        t0, c0 = time.perf_counter(), time.process_time()
        out = self._unit(unit, skip)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.seconds["inputs+rounding"] += wall
        self.seconds["cpu"] += cpu
        log.debug("rounding unit %d: %d modules, %.1f s (CPU %.1f s)", unit, len(out), wall, cpu)
        return out

    def _unit(self, unit: int, skip: bool) -> dict[str, Rounded]:
        model = self.lm.model
        layers = model.layers
        if unit == 0:
            self.hs = [model.embed_tokens(mx.array(c, mx.int32)[None]) for c in self.chunks]
            mx.eval(self.hs)
            model.embed_tokens = None  # the float32 table (2 GB for the 35B): not needed again
            return {}
        if unit <= len(layers):
            layer, layers[unit - 1] = layers[unit - 1], None
            materialize(layer)
            if skip:
                forward(layer, self.hs)
                return {}
            return round_layer(layer, f"language_model.model.layers.{unit - 1}", self.hs,
                               self.targets, self.method)
        if unit == len(layers) + 1 and self.hs is not None:
            hs, self.hs = self.hs, None
            path = "language_model.lm_head"
            if skip or path not in self.targets:
                return {}
            inputs = {path: _lm_head_inputs(self.lm, hs, self.method)}
            return round_modules({path: self.lm.lm_head}, {path: self.targets[path]}, inputs,
                                 self.method)
        return {}
