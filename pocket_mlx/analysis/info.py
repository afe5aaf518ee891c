"""What a model is and what it costs: shape, parameters, quantization, bytes per token, RAM.

Works without reading any weight: a model folder is loaded lazily (shapes only), and a bare
config (`synthetic:NAME` or a config.json path) becomes a lazy skeleton quantized shape-wise, so
a 35B shape can be described on a machine that holds no 35B weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from pocket_mlx import kernels
from pocket_mlx.analysis import distributed_estimate as dist_est
from pocket_mlx.config import (
    ModelFolder,
    checkpoint_dtype,
    dtype_bytes,
    read_pocket_json,
    recipe_label,
)
from pocket_mlx.convert import synthetic
from pocket_mlx.convert.recipes import family as recipe_family
from pocket_mlx.engine.devices import policy_dtype, resolve_device
from pocket_mlx.engine.loader import load_model, resolve_model_path
from pocket_mlx.engine.params import PROMPT_CACHE_MB
from pocket_mlx.errors import PocketError
from pocket_mlx.models.accounting import is_mtp, module_costs, mtp_bytes, weight_stats
from pocket_mlx.system import chips
from pocket_mlx.system.host import get_platform
from pocket_mlx.system.wired import (
    default_reserve_bytes,
    kv_cache_bytes,
    planned_context,
    serve_ram_bytes,
)
from pocket_mlx.units import GB, bandwidth, count, size

FAMILIES = ("experts", "router", "attention", "linear_attention", "shared_expert", "embeddings",
            "lm_head", "other", "mtp")


@dataclass
class Source:
    """A model to describe: its config, lazy model, and folder when it has weights."""

    label: str
    config: dict
    model: nn.Module
    path: Path | None  # None: shapes only, no files
    meta: dict  # pocket.json
    folder: ModelFolder | None = None  # the folder `path` read once, when there is one


def _dtype_of(config: dict) -> mx.Dtype:
    return getattr(mx, checkpoint_dtype(config), mx.bfloat16)


def open_source(model: str | None) -> Source:
    """`None` (bundled model), a folder or repo id, `synthetic:NAME[:RECIPE]`, or a config.json."""
    if (ref := synthetic.parse_ref(model)) is not None:
        # Described from its shape alone: nothing is written (generate & co. build the folder).
        name, recipe = ref
        config = synthetic.config_for(name)
        skel = synthetic.build_model(config)
        quant = synthetic.quantization_for(skel, recipe)
        synthetic.quantize_skeleton(skel, quant, _dtype_of(config))
        config = {**config, "quantization": quant}
        meta = {"recipe": recipe, "original_num_experts": synthetic.original_experts(name)}
        return Source(f"synthetic {name} ({recipe})", config, skel, None, meta)
    if model and model.endswith(".json"):
        file = Path(model).expanduser()
        if not file.is_file():
            raise PocketError(f"no such config file: {model}")
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise PocketError(f"{file} is not valid JSON: {e}") from None
        skel = synthetic.skeleton(config, dtype=_dtype_of(config))
        return Source(str(file), config, skel, None, read_pocket_json(file.parent))
    folder = ModelFolder.read(resolve_model_path(model))
    return Source(str(folder.path), folder.config, load_model(folder, lazy=True), folder.path,
                  folder.pocket, folder)


def family(path: str) -> str:
    """The recipes' module family, routers and embeddings grouped as `info` reports them; the
    multi-token-prediction head is a family of its own (read only when it drafts)."""
    if is_mtp(path):
        return "mtp"
    f = recipe_family(path)
    return {"shared_expert_gate": "router", "embed_tokens": "embeddings"}.get(f, f)


def quant_summary(model: nn.Module) -> dict[str, dict]:
    """Per family: bit widths of its quantized matrices (numbers), dtypes of its float matrices,
    group sizes, parameters (logical), bytes stored and bytes read per decoded token
    (accounting's figures, grouped)."""
    out: dict[str, dict] = {}
    for c in module_costs(model):
        entry = out.setdefault(family(c.path), {"bits": set(), "float_dtypes": set(),
                                                "group_sizes": set(), "params": 0, "bytes": 0,
                                                "bytes_per_token": 0})
        bits = getattr(c.module, "bits", None)
        w = c.module.get("weight")
        if bits:
            entry["bits"].add(int(bits))
            entry["group_sizes"].add(c.module.group_size)
        elif isinstance(w, mx.array) and w.ndim >= 2:
            entry["float_dtypes"].add(str(w.dtype).split(".")[-1])
        entry["params"] += c.params
        entry["bytes"] += c.bytes
        entry["bytes_per_token"] += c.bytes_per_token
    for entry in out.values():
        entry["bits"] = sorted(entry["bits"])  # JSON numbers, not strings
        entry["float_dtypes"] = sorted(entry["float_dtypes"])
        entry["group_sizes"] = sorted(entry["group_sizes"])
    return {f: out[f] for f in FAMILIES if f in out}


def describe(model: str | None = None, context: int | None = None,
             bandwidth_gbps: float | None = None, platform=None, ranks: int | None = None,
             link: str | None = None) -> dict:
    """Everything `pocket-mlx info` prints, as one JSON-ready dict (with `ranks`: the
    distributed estimate over `link`, see analysis/distributed_estimate.py)."""
    src = open_source(model)
    platform = platform or get_platform()
    args = src.model.args
    stats = weight_stats(src.model)
    if context is not None and context <= 0:
        raise PocketError(f"--context must be > 0, got {context}")
    # The cache is sized for the device a run here would use, in its activation dtype (the
    # dtype policy: float32 on the CPU, the checkpoint's own on the GPU).
    device = resolve_device(None)
    act_dtype = policy_dtype(device) or checkpoint_dtype(src.config)
    kv = kv_cache_bytes(src.config, context, dtype_bytes(act_dtype))
    ram_needed = stats.bytes_total + kv.total
    total_ram = platform.total_ram_bytes()
    usable = total_ram - default_reserve_bytes(total_ram) if total_ram else None
    disk = None
    if src.folder is not None:
        disk = src.folder.disk_bytes
    # The model's size as stored (tensor bytes): what `bench` and the chat show. A lazy load at
    # the checkpoint's dtypes holds exactly these, so a bare config's skeleton gives the same.
    size_bytes = src.folder.weights_bytes if src.folder is not None else stats.bytes_total
    bw_source = "--bandwidth" if bandwidth_gbps else None
    if not bandwidth_gbps:
        chip = chips.detect(platform)
        if chip:
            bw_source = f"Apple {chip[0]} (published spec)"
            bandwidth_gbps = chip[1]
    n_linear = sum(1 for t in args.layer_types if t == "linear_attention")
    dist = None
    if ranks is not None:
        # Without a measured or detected bandwidth: the Mac mini (M4) the feature is for.
        bw, bw_from = ((bandwidth_gbps, bw_source) if bandwidth_gbps else
                       (dist_est.M4_BANDWIDTH_GBPS,
                        "assumed: Mac mini M4, Apple's published figure"))
        dist = dist_est.estimate(dist_est.split_of(src.model), ranks,
                                 dist_est.link(link or "thunderbolt5"), bw,
                                 act_bytes=dtype_bytes(act_dtype))
        dist["bandwidth_source"] = bw_from
    out = {
        "model": src.label,
        "architecture": {
            "model_type": args.model_type, "layers": args.num_hidden_layers,
            "linear_attention_layers": n_linear,
            "full_attention_layers": args.num_hidden_layers - n_linear,
            "hidden_size": args.hidden_size, "vocab_size": args.vocab_size,
            "attention_heads": args.num_attention_heads, "kv_heads": args.num_key_value_heads,
            "head_dim": args.head_dim, "linear_key_heads": args.linear_num_key_heads,
            "linear_value_heads": args.linear_num_value_heads,
            "moe_intermediate_size": args.moe_intermediate_size,
            "shared_expert_intermediate_size": args.shared_expert_intermediate_size,
            "max_position_embeddings": args.max_position_embeddings,
        },
        "params_total": stats.params_total,
        "params_active": stats.params_active,
        "experts_per_layer": stats.experts_per_layer,
        "experts_original": int(src.meta.get("original_num_experts") or stats.experts_per_layer),
        "top_k": stats.top_k,
        # Qwen3.5's multi-token-prediction head (speculative decoding's drafter), or None.
        "mtp": ({"layers": args.mtp_num_hidden_layers, "bytes": mtp_bytes(src.model)}
                if args.mtp_num_hidden_layers else None),
        "recipe": recipe_label(src.config, src.meta),
        "quantization": quant_summary(src.model),
        "size_bytes": size_bytes,
        "weights_bytes": stats.bytes_total,
        "disk_bytes": disk,
        "bytes_per_token": stats.bytes_per_token,
        "context": kv.context,
        "device": device,
        "activation_dtype": act_dtype,
        "kv_cache_bytes": kv.full_bytes,
        "linear_state_bytes": kv.linear_bytes,
        "ram_needed_bytes": ram_needed,
        "ram_total_bytes": total_ram,
        "ram_usable_bytes": usable,
        "fits": bool(usable is not None and ram_needed <= usable),
        # The window `serve` offers without --ctx-size: the model's own, capped by what fits.
        "serve_context": planned_context(src.config, int(args.max_position_embeddings),
                                         stats.bytes_total, total_ram, dtype_bytes(act_dtype),
                                         PROMPT_CACHE_MB << 20),
        # `serve` at `context` tokens: RAM needed plus its default prompt cache (its RAM budget
        # or one full-window snapshot, the larger; system/wired.py `serve_ram_bytes`).
        "serve_ram_needed_bytes": serve_ram_bytes(src.config, kv.context, stats.bytes_total,
                                                  dtype_bytes(act_dtype), PROMPT_CACHE_MB << 20),
        "serve_prompt_cache_bytes": PROMPT_CACHE_MB << 20,
        "bandwidth_gbps": bandwidth_gbps,
        "bandwidth_source": bw_source,
        "decode_ceiling_tps": (bandwidth_gbps * GB / stats.bytes_per_token
                               if bandwidth_gbps else None),
        "kernels": kernels.label(),
        "cpu_layout": kernels.layout_label(),
    }
    if dist is not None:
        out["distributed"] = dist
    return out


def bits_label(q: dict) -> str:
    """A family's widths for people: "2/4", "bfloat16", or "8/bfloat16"."""
    return "/".join([str(b) for b in q["bits"]] + q["float_dtypes"]) or "-"


def format_text(d: dict) -> str:
    a = d["architecture"]
    lines = [
        f"model            {d['model']}",
        f"architecture     {a['model_type']}: {a['layers']} layers "
        f"({a['linear_attention_layers']} Gated DeltaNet, {a['full_attention_layers']} full "
        f"attention), hidden {a['hidden_size']}, vocab {a['vocab_size']}",
        f"                 attention {a['attention_heads']} heads / {a['kv_heads']} KV x "
        f"{a['head_dim']}; linear {a['linear_key_heads']} key / {a['linear_value_heads']} "
        f"value heads; experts {a['moe_intermediate_size']} wide, shared "
        f"{a['shared_expert_intermediate_size']}",
        f"parameters       {count(d['params_total'])} total, {count(d['params_active'])} "
        f"active per token",
        f"experts          {d['experts_per_layer']} per layer (of {d['experts_original']} "
        f"originally), top-{d['top_k']}",
        f"recipe           {d['recipe']}",
        "mtp head         " + (f"yes: {d['mtp']['layers']} layer(s), {size(d['mtp']['bytes'])} "
                               "(read only when drafting)" if d.get("mtp") else "no"),
        "quantization     family            bits     params     stored  read/token",
    ]
    for fam, q in d["quantization"].items():
        lines.append(f"                 {fam:<17} {bits_label(q):<8} {count(q['params']):>7} "
                     f"{size(q['bytes']):>10} {size(q['bytes_per_token']):>10}")
    fit = "yes" if d["fits"] else "no"
    lines += [
        f"size             {size(d['size_bytes'])} of weights (the tensors as stored)",
        f"per token        {size(d['bytes_per_token'])} of weights read per decoded token",
        f"RAM needed       {size(d['ram_needed_bytes'])} at {d['context']} tokens on the "
        f"{d['device']} (weights + KV {size(d['kv_cache_bytes'])} + linear state "
        f"{size(d['linear_state_bytes'])}, {d['activation_dtype']} cache)",
        f"fits this host   {fit} ({size(d['ram_total_bytes'])} RAM, "
        f"{size(d['ram_usable_bytes'])} usable)",
        f"serve needs      {size(d['serve_ram_needed_bytes'])} at {d['context']} tokens (RAM "
        f"needed + the prompt cache: its {size(d['serve_prompt_cache_bytes'])} budget or a "
        "full-window snapshot, the larger)",
        f"serve window     {d['serve_context']} tokens ("
        + ("the model's window" if d["serve_context"] == d["architecture"][
            "max_position_embeddings"] else "what fits in RAM beside the weights")
        + "; `serve --ctx-size N` picks another)",
    ]
    if d["decode_ceiling_tps"]:
        lines.append(f"decode ceiling   {d['decode_ceiling_tps']:.1f} tok/s at "
                     f"{bandwidth(d['bandwidth_gbps'])} ({d['bandwidth_source']})")
    else:
        lines.append("decode ceiling   unknown: pass --bandwidth GBPS (measure it with "
                     "`pocket-mlx bench --bandwidth`)")
    lines.append(f"kernels          {d['kernels']}")
    lines.append(f"cpu layout       {d['cpu_layout']}")
    if d.get("distributed"):
        lines += dist_est.format_text(d["distributed"])
    return "\n".join(lines)
