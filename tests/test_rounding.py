"""Activation-aware rounding (`convert --rounding gptq|awq`): packing, GPTQ against mlx-lm's,
lower output error than round-to-nearest, and converted models that load everywhere."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import ROOT

from pocket_mlx.cli.main import main
from pocket_mlx.convert.blas import numpy_matmuls
from pocket_mlx.convert.rounding import Inputs, gptq, pack, quantize_matrix
from pocket_mlx.engine.loader import load_model

CALIB = str(ROOT / "assets" / "text" / "en.calib.txt")
PROMPT = mx.array([[5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 1, 2]])

pytestmark = pytest.mark.usefixtures("exact_kernels")


def _data(n=24, k=128, rows=512, seed=0):
    rng = np.random.default_rng(seed)
    # Correlated inputs with a few loud channels, as real activations have.
    mix = rng.normal(size=(k, k)) / np.sqrt(k) + np.eye(k)
    x = rng.normal(size=(rows, k)) @ mix * np.where(np.arange(k) % 17 == 0, 6.0, 1.0)
    w = rng.normal(size=(n, k)) * 0.05
    return w.astype(np.float32), x.astype(np.float32)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, (3, 5, 128))
    s = rng.uniform(0.5, 2, (3, 5, 2)).astype(np.float32)
    b = rng.normal(size=(3, 5, 2)).astype(np.float32)
    got = mx.dequantize(mx.array(pack(codes, bits)), mx.array(s), mx.array(b), 64, bits)
    want = codes.reshape(3, 5, 2, 64) * s[..., None] + b[..., None]
    np.testing.assert_allclose(np.array(got), want.reshape(3, 5, 128), rtol=1e-6, atol=1e-6)


def _out_err(w, x, q, s, b, gs, bits):
    wq = np.array(mx.dequantize(q, s, b, gs, bits))
    return float(((x @ (w - wq).T) ** 2).mean())


@pytest.mark.parametrize("bits", [2, 4])
def test_gptq_matches_mlx_lm(bits):
    from mlx_lm.quant.gptq import gptq_quantize

    w, x = _data()

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(w.shape[1], w.shape[0], bias=False)

        def __call__(self, v):
            return self.proj(v)

    m = One()
    m.proj.weight = mx.array(w)
    gptq_quantize(m, mx.array(x).reshape(8, -1, w.shape[1]), bits, 64, 8, 64, batch_size=8)
    theirs = np.array(mx.dequantize(m.proj.weight, m.proj.scales, m.proj.biases, 64, bits))
    H = x.T.astype(np.float64) @ x
    q, s, b = gptq(w, H, bits, 64, fit=False, damp=0.01)  # their levels and damping
    ours = np.array(mx.dequantize(q, s, b, 64, bits))
    step = np.abs(np.array(s)).repeat(64, -1)
    # Same algorithm; float64 (ours) vs float32 (theirs) may flip a rare rounding decision.
    assert (np.abs(ours - theirs) < 0.5 * step).mean() > 0.97
    e_ours = _out_err(w, x, q, s, b, 64, bits)
    e_theirs = _out_err(w, x, m.proj.weight, m.proj.scales, m.proj.biases, 64, bits)
    assert e_ours <= 1.05 * e_theirs
    fitted = _out_err(w, x, *gptq(w, H, bits, 64, fit=True, damp=0.01), 64, bits)
    assert fitted < e_theirs  # least-squares levels: lower output error again


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_activation_aware_beats_round_to_nearest(bits, method):
    w, x = _data(seed=bits, rows=1200)
    experts = np.stack([w, w[::-1] * 1.5])  # [E=2, N, K]
    # Expert 0 saw plenty of rows (GPTQ's feedback), expert 1 few (fitted levels alone).
    xs = [x[:1000], x[1000:] * 0.5]
    inputs = Inputs(np.stack([v.T.astype(np.float64) @ v for v in xs]), xs,
                    np.array([len(v) for v in xs]))
    q, s, b = quantize_matrix(mx.array(experts), bits, 64, method, inputs)
    rq, rs, rb = mx.quantize(mx.array(experts), 64, bits)
    for e in range(2):
        ours = _out_err(experts[e], xs[e], q[e], s[e], b[e], 64, bits)
        rtn = _out_err(experts[e], xs[e], rq[e], rs[e], rb[e], 64, bits)
        assert ours < rtn, (e, ours, rtn)
        if method == "gptq" and e == 0:
            assert ours < 0.9 * rtn


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_converted_with_rounding_loads_in_pocket_and_mlx_lm(tmp_path, make_ckpt, method):
    from mlx_lm.utils import load_model as lm_load

    src = make_ckpt("src", layout="fused", vocab_size=8192)
    out = tmp_path / method
    assert main(["convert", str(src), str(out), "--recipe", "pocket-2bit", "--rounding",
                 method, "--calib", CALIB, "--calib-tokens", "128", "--prune-to", "6"]) == 0
    info = json.loads((out / "pocket.json").read_text())
    assert info["rounding"]["method"] == method and info["num_experts"] == 6
    ours, theirs = load_model(out), lm_load(out)[0]
    a = np.array(ours(PROMPT).astype(mx.float32))
    b = np.array(theirs(PROMPT).astype(mx.float32))
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, np.abs(b).max()))
    rtn = tmp_path / "rtn"
    assert main(["convert", str(src), str(rtn), "--recipe", "pocket-2bit", "--calib", CALIB,
                 "--calib-tokens", "128", "--prune-to", "6"]) == 0
    w = "language_model.model.layers.1.mlp.switch_mlp.down_proj.weight"
    from safetensors.numpy import load_file

    def tensor(folder):
        return next(v[w] for f in folder.glob("*.safetensors") if w in (v := load_file(f)))

    assert (tensor(out) != tensor(rtn)).any()  # the experts were rounded differently


def test_rounding_bad_inputs_are_one_line_errors(tmp_path, make_ckpt, capsys):
    src = make_ckpt("src")
    q = tmp_path / "q"
    assert main(["convert", str(src), str(q), "--recipe", "uniform-4"]) == 0
    for args, msg in (
        ([str(src), str(tmp_path / "o"), "--rounding", "gptq"], "needs calibration text"),
        ([str(q), str(tmp_path / "o"), "--rounding", "awq", "--calib", CALIB],
         "needs a float source"),
    ):
        capsys.readouterr()
        assert main(["convert", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
        assert not (tmp_path / "o").exists()


def _whole_model_inputs(model, chunks):
    """The inputs every module saw, as `convert --rounding gptq` captured them before it
    streamed (the whole float32 model in one forward per window; experts' H stacked)."""
    from mlx.utils import tree_unflatten

    got, moe = {}, {}

    class Catch(nn.Module):
        def __init__(self, m, path):
            super().__init__()
            self.m, self.path = m, path

        def __call__(self, x):
            xf = np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32), np.float64)
            H, n = got.get(self.path, (0.0, 0))
            got[self.path] = (H + xf.T @ xf, n + len(xf))
            return self.m(x)

    linears = [(p, Catch(m, p)) for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    model.update_modules(tree_unflatten(linears))
    layers = model.language_model.model.layers
    for i, layer in enumerate(layers):
        layer.mlp.observer = lambda x, inds, s, o, i=i: moe.setdefault(i, []).append(
            (np.array(x.reshape(-1, x.shape[-1]), np.float64), np.array(inds.reshape(-1, 2))))
    with numpy_matmuls(model):  # as convert's float forwards run (convert/blas.py)
        for c in chunks:
            mx.eval(model(mx.array(c, mx.int32)[None]))
    out = {p: Inputs(H, [], np.array(n)) for p, (H, n) in got.items()}
    for i, parts in moe.items():
        x, inds = (np.concatenate([p[j] for p in parts]) for j in (0, 1))
        sw = layers[i].mlp.switch_mlp
        wg, wu = (np.array(m.weight, np.float64) for m in (sw.gate_proj, sw.up_proj))
        xe = [x[(inds == e).any(-1)] for e in range(wg.shape[0])]
        mid = [(g := v @ wg[e].T) / (1 + np.exp(-g)) * (v @ wu[e].T) for e, v in enumerate(xe)]
        count = np.array([len(v) for v in xe])
        p = f"language_model.model.layers.{i}.mlp.switch_mlp"
        out[f"{p}.gate_proj"] = out[f"{p}.up_proj"] = Inputs(np.stack([v.T @ v for v in xe]),
                                                             [], count)
        out[f"{p}.down_proj"] = Inputs(np.stack([v.T @ v for v in mid]), [], count)
    return out


def test_streamed_gptq_equals_whole_model_gptq(tmp_path, make_ckpt):
    """The writer rounds one layer at a time (convert/layerwise.py) and gets, tensor for
    tensor, what GPTQ on the whole float model's inputs gives: dense modules, lm_head and
    pruned experts, with error feedback and without (some experts' gate and up projections
    see fewer than 4 x 128 rows)."""
    from pocket_mlx.config import read_config
    from pocket_mlx.convert.calibrate import calibration_windows
    from pocket_mlx.convert.rounding import select
    from pocket_mlx.engine.tokenizer import load_tokenizer

    src = make_ckpt("src", vocab_size=8192, layer_types=["linear_attention", "full_attention"])
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--recipe", "uniform-2", "--rounding", "gptq",
                 "--calib", CALIB, "--calib-tokens", "1024", "--prune-to", "6"]) == 0
    written = {}
    for f in out.glob("*.safetensors"):
        written.update(mx.load(str(f)))
    kept = json.loads((out / "pocket.json").read_text())["kept_experts"]
    chunks, _ = calibration_windows([CALIB], load_tokenizer(src, read_config(src)), 512, 1024)
    model = load_model(src, dtype="float32")
    inputs = _whole_model_inputs(model, chunks)
    model = load_model(src, dtype="float32")
    counts = [inputs[p].count for p in inputs if p.endswith("switch_mlp.down_proj")]
    # Some experts' gate/up (128 inputs) saw too few rows for feedback, down_proj (64) enough.
    assert min(c.min() for c in counts) < 4 * 128 and max(c.max() for c in counts) >= 4 * 64
    checked = 0
    for path, m in model.named_modules():
        if path not in inputs:
            continue
        w, inp = m.weight, inputs[path]
        if ".layers." in path and (path.endswith("mlp.gate") or ".switch_mlp." in path):
            ids = kept[path.split(".")[3]]
            w = w[mx.array(ids)]
            inp = select(inp, ids) if ".switch_mlp." in path else inp
        dtype = written[f"{path}.scales"].dtype  # the source's float dtype
        want = quantize_matrix(w.astype(dtype), 2, 64, "gptq", inp)
        for name, a in zip(("weight", "scales", "biases"), want):
            b = written[f"{path}.{name}"]
            assert a.dtype == b.dtype and mx.array_equal(a, b).item(), (path, name)
        checked += 1
    # Every quantized module but the embedding (rounded to nearest) was checked.
    assert checked == len([k for k in written if k.endswith(".scales")]) - 1
