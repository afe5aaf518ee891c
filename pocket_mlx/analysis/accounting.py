"""Parameter counts and bytes of weights read per decoded token, from the modules themselves.

Decode is memory-bandwidth bound, so bytes read per token is the number that predicts speed:
every dense projection is read once, routed experts only `top_k` of `num_experts` times, and the
embedding table only one row. Works on lazy (never evaluated) models: it reads shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _nbytes(module: nn.Module) -> int:
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


def weight_stats(model: nn.Module) -> WeightStats:
    args = model.args
    top_k, n_experts = args.num_experts_per_tok, args.num_experts
    total_p = active_p = total_b = token_b = 0
    for path, m in model.named_modules():
        if m.children() and not isinstance(m, (SwitchLinear, QuantizedSwitchLinear)):
            # Only leaf modules carry weights here (plus GatedDeltaNet's own small arrays).
            own = {k: v for k, v in m.items() if not isinstance(v, (nn.Module, list, dict))}
            for v in own.values():
                total_p += v.size
                active_p += v.size
                total_b += v.nbytes
                token_b += v.nbytes
            continue
        p, b = _nparams(m), _nbytes(m)
        total_p += p
        total_b += b
        if isinstance(m, (SwitchLinear, QuantizedSwitchLinear)):
            frac = top_k / m.num_experts
            active_p += int(p * frac)
            token_b += int(b * frac)
        elif path.endswith("embed_tokens") and not args.tie_word_embeddings:
            # By convention the whole table counts as active parameters, but decoding a token
            # reads only its row.
            active_p += p
            token_b += b // m.weight.shape[0]
        else:
            active_p += p
            token_b += b
    return WeightStats(total_p, active_p, total_b, token_b, n_experts, top_k)
