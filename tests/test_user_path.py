"""The path users run is the path we measure: one dtype policy for every entry point, a start-up
without transformers/mlx_lm, `synthetic:NAME` for every command, finish reasons, `temp=`."""

from __future__ import annotations

import collections
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from conftest import ASSET, ROOT
from mlx.utils import tree_flatten

from pocket_mlx import kernels
from pocket_mlx.engine import loader
from pocket_mlx.engine.generation import generate, stream_generate
from pocket_mlx.engine.loader import (
    cache_dtypes,
    cast_cache,
    cast_model,
    load,
    load_model,
    model_weight_stats,
    use_device,
)
from pocket_mlx.engine.session import ChatSession, Settings
from pocket_mlx.errors import PocketError
from pocket_mlx.models.accounting import weight_stats


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pocket_mlx", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def decode_nodes(model) -> collections.Counter:
    """The graph nodes of one decode step (after a short prefill)."""
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    f = io.StringIO()
    mx.export_to_dot(f, model(mx.array([[5]]), cache=cache))
    return collections.Counter(re.findall(r'label ="([A-Za-z]+)', f.getvalue()))


def params(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def same_params(a, b) -> bool:
    pa, pb = params(a), params(b)
    return pa.keys() == pb.keys() and all(
        pa[k].dtype == pb[k].dtype and mx.array_equal(pa[k], pb[k]).item() for k in pa)


# -- one dtype policy ---------------------------------------------------------------------------
def test_cpu_load_runs_float32_with_scales_as_stored():
    model, _ = load(ASSET, device="cpu", fuse=True)
    assert model.run_dtype == "float32" and model.dtype_override is None
    p = params(model)
    qscales = [k for k in p if k.endswith(".scales") and "embed_tokens" not in k]
    assert qscales and all(p[k].dtype == mx.bfloat16 for k in qscales)  # as stored
    assert p["language_model.model.embed_tokens.scales"].dtype == mx.float32
    floats = [k for k, v in p.items() if v.dtype != mx.uint32 and k not in qscales
              and not k.endswith(".biases")]
    assert all(p[k].dtype == mx.float32 for k in floats)


def test_generate_decode_graph_is_bench_graph(monkeypatch):
    """`generate` (and so `chat` and `load()`) and `bench` load the same way: the models their
    own loading code builds (cli/generate.load_for, cli/bench.load_for with --dtype auto, from
    their parsed command lines) have the same parameters and decode graph, the extension's nodes
    in it, far smaller than the checkpoint-dtype (bf16) graph. (The MLX layout: the parameters
    are compared, and packed matrices' MLX arrays are hollow; test_panels covers the layout.)"""
    monkeypatch.setenv("POCKET_MLX_PANELS", "0")
    from pocket_mlx.cli import bench as bench_cmd
    from pocket_mlx.cli import generate as generate_cmd
    from pocket_mlx.cli.main import build_parser

    parser = build_parser()
    g_args = parser.parse_args(["generate", "--model", str(ASSET), "--prompt", "hi"])
    b_args = parser.parse_args(["bench", "--model", str(ASSET)])
    assert b_args.dtype == "auto"
    device, user, _ = generate_cmd.load_for(g_args)
    bench = bench_cmd.load_for(b_args, ASSET, device)
    stored, _ = load(ASSET, device=device, dtype="bfloat16", fuse=True)  # the old user path
    assert same_params(user, bench)
    a, b, c = decode_nodes(user), decode_nodes(bench), decode_nodes(stored)
    assert a == b
    if kernels.enabled():
        assert a["PocketQMM"] > 0 and sum(a.values()) < sum(c.values()) / 2, (a, c)


def test_dtype_override_sticks_across_devices():
    model, _ = load(ASSET, device="cpu", dtype="bfloat16")
    assert model.dtype_override == "bfloat16"
    assert use_device(model, "cpu") is False
    assert params(model)["language_model.model.embed_tokens.scales"].dtype == mx.bfloat16
    with pytest.raises(PocketError, match="unknown dtype"):
        load(ASSET, device="cpu", dtype="float8")


def test_switch_casts_back_to_the_stored_dtypes_without_reloading(monkeypatch):
    """A GPU switch is cast_model(model, None) (the checkpoint's dtypes): exactly a fresh
    checkpoint-dtype load; back on the CPU, exactly a fresh CPU load. (The MLX layout, as
    above: parameters compared.)"""
    monkeypatch.setenv("POCKET_MLX_PANELS", "0")
    model, _ = load(ASSET, device="cpu", fuse=True)
    cpu_ref = load_model(ASSET, dtype="float32", fuse=True)
    stored_ref = load_model(ASSET, fuse=True)
    before = {k: id(v) for k, v in params(model).items()}
    assert cast_model(model, None) > 0
    assert same_params(model, stored_ref)
    after = params(model)
    assert any(id(after[k]) == before[k] for k in after)  # quantized weights never copied
    assert use_device(model, "cpu") is True and model.run_dtype == "float32"
    assert same_params(model, cpu_ref)
    assert use_device(model, "cpu") is False  # nothing to do the second time


def test_chat_continues_across_a_dtype_switch(exact_kernels):
    """A chat whose model ran in the checkpoint's dtype (as on the GPU) continues on the CPU
    from the same cache: the policy is re-applied before the turn (no reload, no re-prefill)
    and the reply equals an unswitched chat's."""
    model, tok = load(ASSET, device="cpu", fuse=True)
    settings = Settings(max_tokens=12)
    m1 = [{"role": "user", "content": "Tell me a fortune."}]

    def turn(session, msgs):
        return "".join(r.text for r, _ in session.generate(msgs, settings, "cpu"))

    plain = ChatSession(model, tok)
    a1 = turn(plain, m1)
    m2 = m1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And then?"}]
    want = turn(plain, m2)
    assert plain.plan_kind == "cache" and want

    switched = ChatSession(model, tok)
    assert turn(switched, m1) == a1
    cast_model(model, None)  # what a GPU turn leaves behind
    assert model.run_dtype is None
    got = turn(switched, m2)
    assert model.run_dtype == "float32"
    assert switched.plan_kind == "cache" and got == want
    # A cache filled in bf16 (on the GPU, by a model whose activations are bf16) is cast with
    # the weights: float32 nodes at once.
    cast_model(model, None)
    for c in switched.cache:
        for name in ("keys", "values", "conv_state"):
            if getattr(c, name, None) is not None:
                setattr(c, name, getattr(c, name).astype(mx.bfloat16))
    m3 = m2 + [{"role": "assistant", "content": got}, {"role": "user", "content": "Why?"}]
    assert turn(switched, m3) and switched.plan_kind == "cache"
    assert all(a.dtype == mx.float32 for c in switched.cache for a in c.arrays)


CACHE_ARRAYS = ("keys", "values", "conv_state", "state")


def cache_kinds(cache: list) -> set[tuple[str, mx.Dtype]]:
    """(array name, dtype) over a conversation's cache."""
    return {(n, getattr(c, n).dtype) for c in cache for n in CACHE_ARRAYS
            if isinstance(getattr(c, n, None), mx.array)}


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    """The bundled model written back as an MLX-layout checkpoint with every float in bf16, norms
    included (as mlx-lm converts one): in its own dtypes it runs bf16 throughout, so its KV and
    conv window are bf16 (the bundled one keeps float32 norms, which promote them to float32)."""
    src = ASSET
    out = tmp_path_factory.mktemp("bf16") / "pocket-tiny-mlx-bf16"
    out.mkdir()
    model = load_model(src, lazy=True)
    mx.save_safetensors(str(out / "model.safetensors"), {
        k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v
        for k, v in tree_flatten(model.parameters())})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        shutil.copy(src / f, out / f)
    return out


def test_a_switch_casts_the_cache_both_ways(bf16_ckpt):
    """CPU (float32) -> the checkpoint's dtypes (the GPU's policy: cast_model(model, None) and
    the cache cast use_device does) -> CPU: the KV and the conv window follow the model both
    ways, the delta-rule state stays float32, and a new conversation would hold the same."""
    model, tok = load(bf16_ckpt, device="cpu", fuse=True)
    cache = model.make_cache()
    first = list(stream_generate(model, tok, "Tell me a fortune.", max_tokens=4, cache=cache))
    f32, bf16 = mx.float32, mx.bfloat16
    everything_f32 = {("keys", f32), ("values", f32), ("conv_state", f32), ("state", f32)}
    assert cache_kinds(cache) == everything_f32

    assert cast_model(model, None) > 0  # what use_device(model, "gpu") does to the model
    assert cast_cache(model, cache) > 0  # ... and to the conversation's cache
    gpu_kinds = {("keys", bf16), ("values", bf16), ("conv_state", bf16), ("state", f32)}
    assert cache_kinds(cache) == gpu_kinds
    assert cache_kinds(cache) == {(n, d) for layer in cache_dtypes(model) for n, d in layer.items()}
    mx.eval(model(mx.array([[first[-1].fed_tokens[-1]]]), cache=cache))  # a token in bf16
    assert cache_kinds(cache) == gpu_kinds  # the model itself keeps the cache in these dtypes

    assert use_device(model, "cpu", cache) is True  # the switch back, cache included
    assert cache_kinds(cache) == everything_f32
    assert cast_cache(model, cache) == 0  # nothing left to do
    assert list(stream_generate(model, tok, [11, 12], max_tokens=2, cache=cache))[-1].fed_tokens
    assert cache_kinds(cache) == everything_f32


def test_regenerate_after_a_switch_restores_the_new_dtypes(bf16_ckpt, exact_kernels):
    """Turn 1 in the checkpoint's dtypes (as on the GPU), turn 2 after a switch to the CPU, then
    a regenerate of turn 2: the snapshot it restores was taken after the cache's cast, so the
    regenerated reply runs on float32 arrays and equals the first one."""
    model, tok = load(bf16_ckpt, device="cpu", fuse=True)
    settings = Settings(max_tokens=8)
    session = ChatSession(model, tok)
    m1 = [{"role": "user", "content": "Tell me a fortune."}]
    a1 = "".join(r.text for r, _ in session.generate(m1, settings, "cpu"))
    cast_model(model, None)  # what a GPU turn leaves behind: its model and its cache
    cast_cache(model, session.cache)
    assert ("conv_state", mx.bfloat16) in cache_kinds(session.cache)
    m2 = m1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And then?"}]
    want = "".join(r.text for r, _ in session.generate(m2, settings, "cpu"))
    assert session.plan_kind == "cache" and model.run_dtype == "float32"
    snapshot = [a for s in session._snap[1] if s.kind == "linear" for a in s.arrays]
    assert snapshot and all(a.dtype == mx.float32 for a in snapshot)
    got = "".join(r.text for r, _ in session.generate(m2, settings, "cpu"))
    assert session.plan_kind == "snapshot" and got == want
    assert {d for _, d in cache_kinds(session.cache)} == {mx.float32}


def test_weight_stats_once_per_model_and_dtype(monkeypatch):
    """Every generation reports bytes per token: the walk over every module runs once per
    model and dtype (not per chat turn or bench run), and again after a cast."""
    model, tok = load(ASSET, device="cpu", fuse=True)
    calls = []
    monkeypatch.setattr(loader, "weight_stats", lambda m: calls.append(1) or weight_stats(m))
    runs = [list(stream_generate(model, tok, "hi", max_tokens=2))[-1] for _ in range(3)]
    assert len(calls) == 1
    assert {r.stats.bytes_per_token for r in runs} == {weight_stats(model).bytes_per_token}
    f32 = model_weight_stats(model)
    cast_model(model, None)  # the checkpoint's dtypes: fewer bytes
    stored = model_weight_stats(model)
    assert len(calls) == 2 and stored == weight_stats(model)
    assert stored.bytes_total < f32.bytes_total
    assert use_device(model, "cpu") and model_weight_stats(model) == f32 and len(calls) == 3


# -- start-up ---------------------------------------------------------------------------------
def test_generate_path_imports_neither_transformers_nor_mlx_lm():
    code = ("import sys\nfrom pocket_mlx.cli.main import main\n"
            "main(['generate', '--prompt', 'hi', '--max-tokens', '4'])\n"
            "import pocket_mlx.tui.app, pocket_mlx.engine.session\n"
            "print(sorted(m for m in ('transformers', 'mlx_lm', 'huggingface_hub', 'torch')"
            " if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


# -- synthetic:NAME everywhere ------------------------------------------------------------------
@pytest.fixture(scope="module")
def synth_cache(tmp_path_factory):
    return {"POCKET_MLX_CACHE": str(tmp_path_factory.mktemp("cache"))}


def test_generate_and_eval_ppl_take_synthetic_models(synth_cache, tmp_path):
    r = cli("generate", "--model", "synthetic:tiny", "--prompt", "hi", "-n", "5", "--json",
            env=synth_cache)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] in ("length", "eos") and out["device"] == "cpu"
    folder = os.path.join(synth_cache["POCKET_MLX_CACHE"], "synthetic", "tiny-pocket-2bit")
    assert os.path.isfile(os.path.join(folder, "config.json"))  # the folder bench writes
    # Built in a pipe: plain progress lines, not minutes of silence on a big model.
    assert re.search(r"^writing tiny-pocket-2bit: .*, done$", r.stderr, re.M), r.stderr
    data = tmp_path / "d.txt"
    data.write_text("In the beginning God created the heaven and the earth. " * 8)
    r = cli("eval-ppl", "--model", "synthetic:tiny:uniform-4", "--data", str(data),
            "--window", "16", "--json", env=synth_cache)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] > 16
    r = cli("generate", "--model", "synthetic:huge", "--prompt", "hi", env=synth_cache)
    assert r.returncode == 2 and "unknown synthetic model 'huge'" in r.stderr
    assert "Traceback" not in r.stderr


def test_chat_takes_a_synthetic_model(synth_cache, tmp_path, monkeypatch):
    """The chat app loads `synthetic:tiny` through the same resolution and answers."""
    import asyncio

    from pocket_mlx.tui.app import ChatApp

    monkeypatch.setenv("POCKET_MLX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("POCKET_MLX_CACHE", synth_cache["POCKET_MLX_CACHE"])
    app = ChatApp("synthetic:tiny", device="cpu", settings=Settings(max_tokens=4),
                  model_name="synthetic:tiny")

    async def until(pilot, cond) -> None:
        t = time.monotonic()
        while not cond():
            assert time.monotonic() - t < 60, "timed out"
            await pilot.pause(0.05)

    async def main() -> None:
        async with app.run_test(size=(100, 32)) as pilot:
            await until(pilot, lambda: app.ready)
            app.prompt.text = "hi"
            await pilot.press("enter")
            await until(pilot, lambda: app.replies_done > 0)

    asyncio.run(main())
    s = app.last_stats
    assert s is not None and s.device == "cpu" and s.finish_reason in ("length", "eos")
    assert 0 < s.generation_tokens <= 4 or s.finish_reason == "eos"


# -- finish reasons and temp= -------------------------------------------------------------------
def test_finish_reason_is_printed():
    r = cli("generate", "--prompt", "Tell me a fortune.", "-n", "3")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1].split(" | ")[-1] in ("length", "eos")


def test_context_is_the_finish_reason_when_the_context_cuts_the_reply():
    model, tok = load(ASSET, device="cpu")
    ids = tok.encode("In the beginning God created the heaven and the earth.")
    old, eos = model.args.max_position_embeddings, tok.eos_token_ids
    model.args.max_position_embeddings, tok.eos_token_ids = len(ids) + 3, []
    try:
        last = list(stream_generate(model, tok, ids, max_tokens=50))[-1]
    finally:
        model.args.max_position_embeddings, tok.eos_token_ids = old, eos
    assert last.stats.finish_reason == "context" and last.stats.generation_tokens == 3


def test_api_takes_temp_like_mlx_lm():
    model, tok = load(ASSET, device="cpu")
    a = generate(model, tok, "Write a poem.", max_tokens=12, temp=1.0, seed=3)
    b = generate(model, tok, "Write a poem.", max_tokens=12, temperature=1.0, seed=3)
    g = generate(model, tok, "Write a poem.", max_tokens=12)
    assert a == b and a != g
    with pytest.raises(PocketError, match="disagree"):
        generate(model, tok, "hi", temp=1.0, temperature=0.5)
