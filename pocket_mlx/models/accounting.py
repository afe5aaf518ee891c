"""Parameter counts and bytes of weights read per decoded token, from the modules themselves.

Decode is memory-bandwidth bound, so bytes read per token is the number that predicts speed:
every dense projection is read once, routed experts only `top_k` of `num_experts` times, and the
embedding table only one row. Works on lazy (never evaluated) models: it reads shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from pocket_mlx.models.layers import QuantizedSwitchLinear, SwitchLinear


@dataclass
class WeightStats:
    params_total: int  # logical parameters (quantized weights counted unpacked)
    params_active: int  # parameters used per token (top-k experts, one embedding row)
    bytes_total: int  # bytes of all parameters as stored
    bytes_per_token: int  # bytes of weights read per decoded token
    experts_per_layer: int
    top_k: int


def param_bytes(module: nn.Module | None) -> int:
    """Bytes of `module`'s parameters as stored (0 for no module)."""
    if module is None:
        return 0
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _nparams(module: nn.Module) -> int:
    """Logical parameters: a packed uint32 weight holds 32 / bits values."""
    n = 0
    bits = getattr(module, "bits", None)
    for name, v in tree_flatten(module.parameters()):
        if bits and name.endswith("weight") and "uint" in str(v.dtype):
            n += v.size * 32 // bits
        elif bits and name.endswith(("scales", "biases")):
            continue
        else:
            n += v.size
    return n


@dataclass
class ModuleCost:
    """What one module holds and reads: the unit `weight_stats` sums and `info` groups."""

    path: str
    module: nn.Module
    params: int  # logical parameters
    params_active: int
    bytes: int  # as stored
    bytes_per_token: int  # read per decoded token


def is_mtp(path: str) -> bool:
    """A module of the multi-token-prediction head: read only when it drafts, so it counts in
    the totals but not per plain-decoded token."""
    return path == "mtp" or path.startswith("mtp.")


def module_costs(model: nn.Module) -> list[ModuleCost]:
    """Every module that holds arrays, with its parameters and bytes, total and per token."""
    out = [c if not is_mtp(c.path) else ModuleCost(c.path, c.module, c.params, 0, c.bytes, 0)
           for c in _module_costs(model)]
    return out


def mtp_bytes(model: nn.Module) -> int:
    """Bytes of the multi-token-prediction head as stored (0 without one)."""
    return sum(c.bytes for c in _module_costs(model) if is_mtp(c.path))


def _module_costs(model: nn.Module) -> list[ModuleCost]:
    args = model.args
    top_k = args.num_experts_per_tok
    out = []
    for path, m in model.named_modules():
        if m.children() and not isinstance(m, (SwitchLinear, QuantizedSwitchLinear)):
            # Only leaf modules carry weights here (plus GatedDeltaNet's own small arrays).
            own = [v for v in m.values() if isinstance(v, mx.array)]
            if own:
                p, b = sum(v.size for v in own), sum(v.nbytes for v in own)
                out.append(ModuleCost(path, m, p, p, b, b))
            continue
        p, b = _nparams(m), param_bytes(m)
        if not b:
            continue
        if isinstance(m, (SwitchLinear, QuantizedSwitchLinear)):
            # A rank of an expert-parallel run holds some of the experts (experts_global in
            # all): it reads top_k x held / all of them per token on average.
            frac = top_k / getattr(m, "experts_global", m.num_experts)
            out.append(ModuleCost(path, m, p, int(p * frac), b, int(b * frac)))
        elif path.endswith("embed_tokens") and not args.tie_word_embeddings:
            # By convention the whole table counts as active parameters, but decoding a token
            # reads only its row.
            out.append(ModuleCost(path, m, p, p, b, b // m.weight.shape[0]))
        else:
            out.append(ModuleCost(path, m, p, p, b, b))
    return out


def weight_stats(model: nn.Module) -> WeightStats:
    costs = module_costs(model)
    return WeightStats(
        params_total=sum(c.params for c in costs),
        params_active=sum(c.params_active for c in costs),
        bytes_total=sum(c.bytes for c in costs),
        bytes_per_token=sum(c.bytes_per_token for c in costs),
        experts_per_layer=model.args.num_experts, top_k=model.args.num_experts_per_tok)
