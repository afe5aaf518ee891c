"""Write a Qwen3.5-35B-A3B-shaped bf16 checkpoint in the Hugging Face hub layout, random weights.

Why: `pocket-mlx convert` has to be measured at the scale of the real checkpoint (issue 29),
and no machine here holds the real 70 GB of weights. This writes what `convert` reads from the
hub: the real tensor names (vision-language wrapping `model.language_model.layers.L...`, one
tensor per expert `mlp.experts.E.{gate,up,down}_proj.weight`, shared expert, router gate,
shared_expert_gate, Gated DeltaNet and full-attention layers in the real 3:1 order), the real
shapes (embeddings 248320 x 2048, 256 experts of 512 x 2048, ...), transformers' conventions
(zero-centred norms applied as 1 + w, conv1d as [C, 1, K]), bf16, sharded with
`model.safetensors.index.json`, and the bundled tokenizer (assets/pocket-tiny: 8192 ids, which
the real 248320-row embeddings cover). The vision tower is left out (convert drops it); the
MTP head (`mtp.*`, with `mtp_num_hidden_layers: 1`) only with --mtp. Only the first N layers are written (`--layers`), so slices of 2, 4, 8 layers
measure what grows with depth.

Memory: one tensor at a time (the largest: the embeddings, 1 GB in bf16) plus MLX's buffers;
each tensor is generated, written into the open shard and dropped.

    python scripts/make_shape_checkpoint.py /work/tmp-shape/l4 --layers 4
    python scripts/make_shape_checkpoint.py OUT --layers 2 --experts 64
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocket_mlx.convert.writer import ShardWriter, atomic_dir  # noqa: E402
from pocket_mlx.errors import PocketError  # noqa: E402

ASSET = ROOT / "assets" / "pocket-tiny"
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
             "chat_template.jinja", "generation_config.json")

# Qwen/Qwen3.5-35B-A3B config.json, text part (what transformers' Qwen3_5MoeTextConfig reads).
# Token ids are the bundled tokenizer's (eos 8191, pad 8189), not the real vocabulary's.
TEXT_35B = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144,
    "full_attention_interval": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001, "output_router_logits": False, "initializer_range": 0.02,
    "tie_word_embeddings": False, "use_cache": True, "dtype": "bfloat16",
    "partial_rotary_factor": 0.25, "eos_token_id": 8191, "pad_token_id": 8189,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                        "mrope_section": [11, 11, 10]},
}
# Test-only (--tiny-dims): the same names and layout at toy widths, so a test runs in seconds.
TINY_DIMS = {
    "vocab_size": 8192, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
}


def text_config(layers: int, experts: int | None, tiny: bool = False, mtp: bool = False) -> dict:
    """The text config of an N-layer slice: layer types in the real 3:1 order; `mtp`: with
    the real checkpoint's one-layer multi-token-prediction head."""
    cfg = {**TEXT_35B, **(TINY_DIMS if tiny else {})}
    if mtp:
        cfg["mtp_num_hidden_layers"] = 1
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(layers)]
    if experts is not None:
        cfg["num_experts"] = experts
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], experts)
    return cfg


def hub_config(text: dict) -> dict:
    """config.json as the hub's vision-language checkpoint nests it (vision part left out)."""
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": False, "transformers_version": "5.17.0"}


def tensor_specs(cfg: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor, in write order: embeddings, layer by layer, final
    norm and lm_head. kind: 'w' matrix, 'norm' zero-centred norm, 'gnorm' gated norm (applied
    as is), 'conv', 'alog', 'dt'."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    E, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    S = cfg["shared_expert_intermediate_size"]
    conv_dim = 2 * kh * kd + vh * vd

    def layer(p: str, t: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
        yield f"{p}.input_layernorm.weight", (H,), "norm"
        if t == "linear_attention":
            a = f"{p}.linear_attn"
            yield f"{a}.A_log", (vh,), "alog"
            yield f"{a}.conv1d.weight", (conv_dim, 1, cfg["linear_conv_kernel_dim"]), "conv"
            yield f"{a}.dt_bias", (vh,), "dt"
            yield f"{a}.in_proj_a.weight", (vh, H), "w"
            yield f"{a}.in_proj_b.weight", (vh, H), "w"
            yield f"{a}.in_proj_qkv.weight", (conv_dim, H), "w"
            yield f"{a}.in_proj_z.weight", (vh * vd, H), "w"
            yield f"{a}.norm.weight", (vd,), "gnorm"
            yield f"{a}.out_proj.weight", (H, vh * vd), "w"
        else:
            a = f"{p}.self_attn"
            yield f"{a}.k_norm.weight", (hd,), "norm"
            yield f"{a}.k_proj.weight", (nkv * hd, H), "w"
            yield f"{a}.o_proj.weight", (H, nh * hd), "w"
            yield f"{a}.q_norm.weight", (hd,), "norm"
            yield f"{a}.q_proj.weight", (nh * hd * 2, H), "w"  # queries and their output gate
            yield f"{a}.v_proj.weight", (nkv * hd, H), "w"
        m = f"{p}.mlp"
        for e in range(E):
            yield f"{m}.experts.{e}.down_proj.weight", (H, inter), "w"
            yield f"{m}.experts.{e}.gate_proj.weight", (inter, H), "w"
            yield f"{m}.experts.{e}.up_proj.weight", (inter, H), "w"
        yield f"{m}.gate.weight", (E, H), "w"
        yield f"{m}.shared_expert.down_proj.weight", (H, S), "w"
        yield f"{m}.shared_expert.gate_proj.weight", (S, H), "w"
        yield f"{m}.shared_expert.up_proj.weight", (S, H), "w"
        yield f"{m}.shared_expert_gate.weight", (1, H), "w"
        yield f"{p}.post_attention_layernorm.weight", (H,), "norm"

    base = "model.language_model"
    yield f"{base}.embed_tokens.weight", (V, H), "emb"
    for i, t in enumerate(cfg["layer_types"]):
        yield from layer(f"{base}.layers.{i}", t)
    yield f"{base}.norm.weight", (H,), "norm"
    yield "lm_head.weight", (V, H), "w"
    # The multi-token-prediction head, named as Qwen3.5 ships it (top-level `mtp.*`).
    if n := cfg.get("mtp_num_hidden_layers", 0):
        yield "mtp.fc.weight", (H, 2 * H), "w"
        for i in range(n):
            yield from layer(f"mtp.layers.{i}", "full_attention")
        yield "mtp.norm.weight", (H,), "norm"
        yield "mtp.pre_fc_norm_embedding.weight", (H,), "norm"
        yield "mtp.pre_fc_norm_hidden.weight", (H,), "norm"


def values(shape: tuple[int, ...], kind: str, key: mx.array) -> mx.array:
    """Random bf16 values that keep activations sane: matrices ~ N(0, 1/fan_in), norms near
    their neutral value, A_log and dt_bias as transformers initialises them."""
    if kind in ("w", "conv"):
        scale = shape[-1] ** -0.5 if kind == "w" else 0.5
        return (mx.random.normal(shape, key=key) * scale).astype(mx.bfloat16)
    if kind == "emb":
        return (mx.random.normal(shape, key=key) * 0.5).astype(mx.bfloat16)
    if kind == "norm":
        return (mx.random.normal(shape, key=key) * 0.02).astype(mx.bfloat16)
    if kind == "gnorm":
        return (1 + mx.random.normal(shape, key=key) * 0.02).astype(mx.bfloat16)
    if kind == "alog":
        return mx.log(mx.random.uniform(1, 16, shape, key=key)).astype(mx.bfloat16)
    return mx.ones(shape, dtype=mx.bfloat16)  # dt_bias


def write(out: Path, cfg: dict, seed: int, shard_bytes: int, force: bool,
          log=print) -> dict:
    """Write the checkpoint (atomic: a temporary folder renamed into place)."""
    specs = list(tensor_specs(cfg))
    total = sum(2 * _numel(s) for _, s, _ in specs)
    log(f"{out}: {cfg['num_hidden_layers']} layers, {cfg['num_experts']} experts, "
        f"{len(specs)} tensors, {total / 1e9:.2f} GB bf16")
    t0, done, step = time.perf_counter(), 0, max(1, total // 20)
    with atomic_dir(out, force=force) as tmp:
        w = ShardWriter(tmp, shard_bytes, expected_bytes=total)
        for i, (name, shape, kind) in enumerate(specs):
            arr = values(shape, kind, mx.random.key(seed * 1_000_003 + i))  # per tensor
            w.add(name, arr)
            before, done = done, done + arr.nbytes
            del arr
            if done // step != before // step:
                log(f"  {done / 1e9:.2f}/{total / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)")
        w.close()
        (tmp / "config.json").write_text(json.dumps(hub_config(cfg), indent=2))
        for name in TOKENIZER:
            if (ASSET / name).is_file():
                shutil.copyfile(ASSET / name, tmp / name)
    return {"tensors": len(specs), "bytes": total, "seconds": time.perf_counter() - t0}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder to write (must not exist, see --force)")
    ap.add_argument("--layers", type=int, required=True, help="layers to write (the real: 40)")
    ap.add_argument("--experts", type=int, default=None, help="experts per layer (real: 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size-gb", type=float, default=4.0,
                    help="largest shard (default 4 GB, as the hub's shards are about)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--mtp", action="store_true",
                    help="also write the multi-token-prediction head (mtp.*), as the real has")
    ap.add_argument("--tiny-dims", action="store_true", help=argparse.SUPPRESS)  # tests only
    a = ap.parse_args(argv)
    try:
        if a.layers < 1:
            raise PocketError(f"--layers must be 1 or more, got {a.layers}")
        if a.experts is not None and a.experts < 2:
            raise PocketError(f"--experts must be 2 or more, got {a.experts}")
        if a.shard_size_gb <= 0:
            raise PocketError(f"--shard-size-gb must be positive, got {a.shard_size_gb:g}")
        cfg = text_config(a.layers, a.experts, a.tiny_dims, a.mtp)
        r = write(a.out, cfg, a.seed, int(a.shard_size_gb * (1 << 30)), a.force)
    except PocketError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB in "
          f"{r['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
