"""Shared fixtures: tiny random Qwen3.5-MoE checkpoints written as real safetensors files."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from pocket_mlx import kernels

ROOT = Path(__file__).resolve().parent.parent
ASSET = ROOT / "assets" / "pocket-tiny"
sys.path.insert(0, str(ROOT / "tests"))


def tiny_config(**over) -> dict:
    cfg = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 300,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
        "eos_token_id": 299,
    }
    cfg.update(over)
    cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg


def hf_weights(cfg: dict, seed: int = 0, layout: str = "per_expert") -> dict[str, np.ndarray]:
    """Random weights named and shaped as transformers saves Qwen3.5-MoE (text model)."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    E, I, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    conv_dim = 2 * kh * kd + vh * vd

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(V, H, scale=0.5), "model.norm.weight": w(H, scale=0.1)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(V, H)

    def layer(p: str, t: str) -> None:
        out[f"{p}.input_layernorm.weight"] = w(H, scale=0.1)
        out[f"{p}.post_attention_layernorm.weight"] = w(H, scale=0.1)
        if t == "linear_attention":
            a = f"{p}.linear_attn"
            out[f"{a}.in_proj_qkv.weight"] = w(conv_dim, H)
            out[f"{a}.in_proj_z.weight"] = w(vh * vd, H)
            out[f"{a}.in_proj_b.weight"] = w(vh, H)
            out[f"{a}.in_proj_a.weight"] = w(vh, H)
            out[f"{a}.conv1d.weight"] = w(conv_dim, 1, cfg["linear_conv_kernel_dim"], scale=0.5)
            out[f"{a}.dt_bias"] = w(vh, scale=0.5)
            out[f"{a}.A_log"] = np.log(rng.uniform(1, 16, vh)).astype(np.float32)
            out[f"{a}.norm.weight"] = (1 + w(vd, scale=0.1)).astype(np.float32)
            out[f"{a}.out_proj.weight"] = w(H, vh * vd)
        else:
            a = f"{p}.self_attn"
            out[f"{a}.q_proj.weight"] = w(nh * hd * 2, H)
            out[f"{a}.k_proj.weight"] = w(nkv * hd, H)
            out[f"{a}.v_proj.weight"] = w(nkv * hd, H)
            out[f"{a}.o_proj.weight"] = w(H, nh * hd)
            out[f"{a}.q_norm.weight"] = w(hd, scale=0.1)
            out[f"{a}.k_norm.weight"] = w(hd, scale=0.1)
        m = f"{p}.mlp"
        out[f"{m}.gate.weight"] = w(E, H)
        out[f"{m}.shared_expert_gate.weight"] = w(1, H)
        for proj, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
            out[f"{m}.shared_expert.{proj}.weight"] = w(*shape)
        gate, up, down = w(E, I, H), w(E, I, H), w(E, H, I)
        if layout == "fused":
            out[f"{m}.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            out[f"{m}.experts.down_proj"] = down
        else:
            for e in range(E):
                out[f"{m}.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{m}.experts.{e}.up_proj.weight"] = up[e]
                out[f"{m}.experts.{e}.down_proj.weight"] = down[e]

    for i, t in enumerate(cfg["layer_types"]):
        layer(f"model.layers.{i}", t)
    if cfg.get("mtp_num_hidden_layers"):  # Qwen3.5's multi-token-prediction head
        out["mtp.fc.weight"] = w(H, 2 * H)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{n}.weight"] = w(H, scale=0.1)
        for i in range(cfg["mtp_num_hidden_layers"]):
            layer(f"mtp.layers.{i}", "full_attention")
    return out


def write_checkpoint(folder: Path, cfg: dict, weights: dict[str, np.ndarray], *,
                     wrapped: bool = False, shards: int = 2) -> Path:
    """Write config + safetensors shards (+ the bundled tokenizer) as transformers would."""
    folder.mkdir(parents=True, exist_ok=True)
    if wrapped:
        config = {"model_type": "qwen3_5_moe", "text_config": cfg,
                  "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        weights = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in weights.items()}
        weights["model.visual.patch_embed.weight"] = np.zeros((4, 4), np.float32)
        if not cfg.get("mtp_num_hidden_layers"):  # a stray head the config does not declare
            weights["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    else:
        config = cfg
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    per = -(-len(names) // shards)
    index = {}
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(folder / fname), {k: mx.array(weights[k]) for k in part})
        index.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / f).write_bytes((ASSET / f).read_bytes())
    return folder


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The synthetic `tiny` model, pocket-2bit (mixed): experts 2-bit, routers 8, attention and
    shared expert 4; built once per test session."""
    from pocket_mlx.convert import synthetic

    out = tmp_path_factory.mktemp("synthetic") / "tiny-pocket-2bit"
    return synthetic.build("tiny", "pocket-2bit", out=out, progress=False)


@pytest.fixture
def make_ckpt(tmp_path):
    def make(name="ckpt", layout="per_expert", wrapped=False, seed=0, **over):
        cfg = tiny_config(**over)
        return write_checkpoint(tmp_path / name, cfg, hf_weights(cfg, seed, layout),
                                wrapped=wrapped)

    return make


@pytest.fixture
def exact_kernels():
    """Parity with MLX/mlx-lm needs the CPU kernels' EXACT mode: the default FAST mode quantizes
    activations to int8 (perplexity within 0.5%, see docs/BENCHMARKS.md), close but not equal."""
    try:
        from pocket_mlx import kernels
    except ImportError:
        yield
        return
    mode = kernels.get_mode()
    kernels.set_mode("exact")
    try:
        yield
    finally:
        kernels.set_mode(mode)


@pytest.fixture
def kernels_ext():
    """For the C++ extension's own tests: skips without the extension, and fails instead under
    POCKET_MLX_REQUIRE_KERNELS=1 (.ci/run), where a build that broke must not pass as skipped."""
    why = kernels.load_error()
    if why is not None:
        if kernels.required():
            pytest.fail(f"POCKET_MLX_REQUIRE_KERNELS=1, but: {why}", pytrace=False)
        pytest.skip(why)
    return kernels


def restore_isa() -> None:
    """Back to the instruction set this run started on: POCKET_MLX_ISA's where it forces one (a
    whole run on AVX2's kernels on an AVX-512 CPU, say), else the CPU's best. Not set_isa("auto")
    alone, which ignores the variable: the tests after it would run on another ISA than the
    subprocesses they compare with (serve, the CLI), which read it."""
    forced = os.environ.get("POCKET_MLX_ISA", "").strip()
    if not (forced and kernels.set_isa(forced)):
        kernels.set_isa("auto")


@pytest.fixture
def cpu_kernels(kernels_ext):
    """The extension's kernels on the CPU device (skips or fails as `kernels_ext`); the device,
    the enabled flag and the ISA are put back afterwards."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    kernels.set_enabled(True)
    yield kernels
    kernels.set_enabled(True)
    restore_isa()
    mx.set_default_device(old)


KERNEL_PATHS = ["fast", "exact", "mlx"]


@contextmanager
def kernel_path(name: str):
    """The CPU extension in mode `name` ("fast", "exact"), or MLX's own ops ("mlx": extension
    off), on the CPU stream; the extension's state restored after."""
    if name != "mlx" and kernels.load_error() is not None:
        if kernels.required():
            pytest.fail(kernels.load_error(), pytrace=False)
        pytest.skip(kernels.load_error())
    mode = kernels.get_mode()
    if name == "mlx":
        kernels.set_enabled(False)
    else:
        kernels.set_mode(name)
    try:
        with mx.stream(mx.cpu):
            yield name
    finally:
        kernels.set_enabled(True)
        kernels.set_mode(mode)


def speculative_run(model, tok, prompt, spec="off", k=3, max_tokens=120, raw=False,
                    **sampling) -> tuple[list[int], object]:
    """(token ids, final stats) of `stream_generate` with `--speculative spec` and K drafts."""
    from pocket_mlx.engine.generation import SamplingParams, stream_generate

    toks, stats = [], None
    for r in stream_generate(model, tok, prompt, max_tokens=max_tokens, speculative=spec,
                             num_draft_tokens=k, raw=raw, sampling=SamplingParams(**sampling)):
        if r.token is not None:
            toks.append(r.token)
        stats = r.stats
    return toks, stats


def headless_copy(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` whose config declares no MTP head (its `mtp.*` tensors are
    then dropped on load, as a stock conversion's would be): what `--speculative mtp` refuses and
    `auto` drafts by lookup on. Weights are linked, not copied."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("mtp_num_hidden_layers", None)
            for key in ("quantization", "quantization_config"):
                if isinstance(cfg.get(key), dict):
                    cfg[key] = {k: v for k, v in cfg[key].items() if not k.startswith("mtp.")}
            (dst / f.name).write_text(json.dumps(cfg))
        elif f.is_file():
            (dst / f.name).symlink_to(f)
    return dst


@pytest.fixture(scope="session")
def headless_asset(tmp_path_factory) -> Path:
    """The bundled model without its MTP head (see headless_copy)."""
    return headless_copy(ASSET, tmp_path_factory.mktemp("headless") / "pocket-tiny")
