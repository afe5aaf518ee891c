"""CPU panel layout (csrc/core/qk_panel*): matrices packed from MLX arrays give FAST's
int8-activation result and EXACT's float result, the same bits for a row alone and inside a B-row
product (B = 1..20), unpack back to the MLX bytes, and a model loaded for the CPU (panels by default)
generates what it generates without them and converts back for another device."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import restore_isa
from mlx.utils import tree_flatten

from pocket_mlx import kernels
from tests.test_kernels import _cpu_and_defaults, _fast_ref, _quantized, _x  # noqa: F401


def _np(a):
    """Bytes-exact numpy view (bfloat16 as its 16-bit pattern)."""
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _packable():
    if not hasattr(kernels._ext, "panel_pack"):
        pytest.skip("extension without panels")


def _pack(w, s, b, bits, gs, release=False):
    n = kernels._ext.panel_pack(w, s, b, bits=bits, group_size=gs, release=release)
    if n == 0:
        pytest.skip("no panel kernels on this CPU")
    return n


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_panel_plain(isa, bits):
    _packable()
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available")
    for gs, sdt in ((64, mx.bfloat16), (32, mx.float16), (128, mx.float32)):
        N, K = 37, gs * 5
        w, s, b = _quantized((N, K), gs, bits, sdt)
        x = _x((20, K), mx.float32)
        mx.eval(w, s, b, x)
        wc, sc, bc = mx.array(w), mx.array(s), mx.array(b)  # keep copies: release=True below
        mx.eval(wc, sc, bc)
        _pack(w, s, b, bits, gs, release=True)
        try:
            kernels.set_mode("exact")
            ref = np.array(mx.quantized_matmul(x, wc, sc, bc, transpose=True, group_size=gs,
                                               bits=bits))
            got = np.array(kernels.quantized_matmul(x, w, s, b, group_size=gs, bits=bits))
            assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
            if bits in kernels.info()["fast_bits"]:
                kernels.set_mode("fast")
                want = np.array(_fast_ref(x, wc, sc.astype(mx.float32), bc.astype(mx.float32),
                                          gs, bits))
                all_rows = np.array(kernels.quantized_matmul(x, w, s, b, group_size=gs, bits=bits))
                assert np.abs(all_rows - want).max() <= 1e-4 * np.abs(want).max()
                for B in (1, 2, 3, 5, 8, 9, 20):
                    part = np.array(kernels.quantized_matmul(x[:B], w, s, b, group_size=gs,
                                                             bits=bits))
                    assert np.array_equal(part, all_rows[:B]), (bits, gs, B)
        finally:
            w2, s2, b2 = kernels._ext.panel_unpack(w)
        assert np.array_equal(np.array(w2), np.array(wc))
        assert np.array_equal(np.array(s2.astype(mx.float32)), np.array(sc.astype(mx.float32)))
        assert np.array_equal(np.array(b2.astype(mx.float32)), np.array(bc.astype(mx.float32)))


def test_panel_gather_rows_identical():
    """Gathered experts (decode, speculative verify, batched): each token's rows equal the same
    token alone, and the k experts of a token may share its activation row."""
    _packable()
    bits, gs, E, N, K = 2, 64, 6, 48, 256
    w, s, b = _quantized((E, N, K), gs, bits, mx.bfloat16)
    x = _x((12, 1, 1, K), mx.float32)
    idx = mx.array(np.random.default_rng(0).integers(0, E, (12, 4)).astype(np.uint32))
    mx.eval(w, s, b, x, idx)
    ref = np.array(kernels.gather_qmm(x, w, s, b, idx, group_size=gs, bits=bits))
    _pack(w, s, b, bits, gs)
    try:
        kernels.set_mode("fast")
        all_rows = np.array(kernels.gather_qmm(x, w, s, b, idx, group_size=gs, bits=bits))
        assert np.abs(all_rows - ref).max() <= 0.05 * np.abs(ref).max()  # FAST vs EXACT
        for t in range(12):
            one = np.array(kernels.gather_qmm(x[t:t + 1], w, s, b, idx[t:t + 1], group_size=gs,
                                              bits=bits))
            assert np.array_equal(one, all_rows[t:t + 1])
    finally:
        kernels._ext.panel_release(w)


@pytest.mark.parametrize("bits,rows", [(2, 1), (2, 4), (2, 5), (4, 1), (4, 6), (4, 8), (6, 2)])
def test_panel_isas_identical(bits, rows):
    """FAST gives the same bits on every x86 build (the int8 dot products are exact in each),
    for row counts on both sides of the VNNI build's in-place-mask path (2 bits up to 4 rows,
    4 bits up to 8; the other builds always shift the codes down)."""
    _packable()
    gs, N, K = 64, 40, 512
    w, s, b = _quantized((N, K), gs, bits, mx.bfloat16)
    x = _x((rows, K), mx.float32)
    mx.eval(w, s, b, x)
    _pack(w, s, b, bits, gs)
    try:
        kernels.set_mode("fast")
        outs = []
        for isa in ("auto", "avx512-novnni", "avx2"):
            if kernels.set_isa(isa):
                outs.append(np.array(kernels.quantized_matmul(x, w, s, b, group_size=gs,
                                                              bits=bits)))
        for o in outs[1:]:
            assert np.array_equal(o, outs[0])
    finally:
        kernels._ext.panel_release(w)


def test_model_with_panels(tiny_ckpt, monkeypatch):
    """The tiny pocket-2bit model (2-bit experts, 4-bit attention, 6-bit lm_head, 8-bit routers)
    loaded for the CPU (the panel layout by default): its matrices are packed, EXACT computes the
    logits it computes without panels (up to float summation order), FAST gives each sequence
    of a batched decode step the bits it gets alone, and unpacking for another device gives back
    the checkpoint's arrays bit for bit. (FAST logits are not compared with the unpacked model:
    on random weights a float-order change flips int8 roundings and then routed experts, as it
    does between the row kernels and the GEMM.)"""
    _packable()
    from pocket_mlx.engine import loader, panels

    tokens = mx.array([[1, 5, 9, 2, 7, 3]])
    monkeypatch.setenv("POCKET_MLX_PANELS", "0")  # the reference: the MLX layout
    model, _ = loader.load(str(tiny_ckpt), device="cpu")
    kernels.set_mode("exact")
    ref = np.array(model(tokens), dtype=np.float32)
    before = {k: _np(v) for k, v in tree_flatten(model.parameters())}
    del model
    monkeypatch.setenv("POCKET_MLX_PANELS", "1")
    packed, _ = loader.load(str(tiny_ckpt), device="cpu")
    report = packed.panel_report
    assert report["to"] == "cpu" and report["matrices"] > 0 and report["bytes"] > 0
    got = np.array(packed(tokens), dtype=np.float32)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    kernels.set_mode("fast")
    batch = np.array(packed(mx.array([[1], [5], [9]])), dtype=np.float32)
    for i, t in enumerate((1, 5, 9)):
        assert np.array_equal(np.array(packed(mx.array([[t]])), dtype=np.float32), batch[i:i + 1])
    back = panels.use_panels(packed, "gpu")
    assert back["to"] == "gpu" and back["matrices"] == report["matrices"]
    for k, v in tree_flatten(packed.parameters()):
        assert np.array_equal(_np(v), before[k]), k


def _packed_model(tiny_ckpt, monkeypatch):
    """The tiny pocket-2bit model loaded for the CPU in the panel layout."""
    _packable()
    from pocket_mlx.engine import loader

    monkeypatch.setenv("POCKET_MLX_PANELS", "1")
    model, _ = loader.load(str(tiny_ckpt), device="cpu")
    if not model.panel_report or not model.panel_report["matrices"]:
        pytest.skip("no panel kernels on this CPU")
    return model


def test_panels_are_the_default_on_x86_and_can_be_turned_off(tiny_ckpt, monkeypatch):
    """The layout is the default where the panel kernels are the measured-faster ones (x86:
    AVX-512 VNNI, AVX-512BW, AVX2), opt-in elsewhere (NEON), and POCKET_MLX_PANELS=0 turns it
    off."""
    from pocket_mlx.engine import loader

    _packable()
    if not kernels.panels_available():
        pytest.skip("no panel kernels on this CPU")
    monkeypatch.delenv("POCKET_MLX_PANELS", raising=False)
    default_on = kernels._ext.panel_variant() in kernels.PANELS_BY_DEFAULT
    model, _ = loader.load(str(tiny_ckpt), device="cpu")
    assert bool(getattr(model, "panel_report", None)) == default_on
    assert kernels.panels_wanted() == default_on
    try:
        for isa in ("avx2", "avx512-novnni"):
            if kernels.set_isa(isa):
                assert kernels.panels_wanted(), isa
                monkeypatch.setenv("POCKET_MLX_PANELS", "0")
                assert not kernels.panels_wanted(), isa
                monkeypatch.delenv("POCKET_MLX_PANELS")
    finally:
        restore_isa()
    monkeypatch.setenv("POCKET_MLX_PANELS", "0")
    assert not kernels.panels_wanted()
    plain, _ = loader.load(str(tiny_ckpt), device="cpu")
    assert getattr(plain, "panel_report", None) is None
    assert not kernels.packed(plain.layers[0].mlp.switch_mlp.gate_proj["weight"])


def test_mlx_ops_never_read_packed_matrices(tiny_ckpt, monkeypatch):
    """MLX's own quantized ops would read the released pages (zeros): with the extension off
    behind the loader's back they raise instead of answering garbage; turning the extension off
    with set_enabled(False) unpacks the model first, so MLX's ops then give the right answer."""
    model = _packed_model(tiny_ckpt, monkeypatch)
    tokens = mx.array([[1, 5, 9, 2]])
    lm_head = model.language_model.lm_head
    assert kernels.packed(lm_head["weight"])
    monkeypatch.setenv("POCKET_MLX_KERNELS", "0")
    with pytest.raises(kernels.PanelLayoutError):
        model(tokens)
    monkeypatch.delenv("POCKET_MLX_KERNELS")
    kernels.set_mode("exact")
    got = np.array(model(tokens), dtype=np.float32)
    kernels.set_enabled(False)
    try:
        assert not model.panel_modules and not kernels.packed(lm_head["weight"])
        ref = np.array(model(tokens), dtype=np.float32)
    finally:
        kernels.set_enabled(True)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_replaced_scales_of_a_packed_matrix_raise(tiny_ckpt, monkeypatch):
    """The panels hold the scales they were packed with: new ones set on the module afterwards
    (weight surgery) must not be silently ignored."""
    model = _packed_model(tiny_ckpt, monkeypatch)
    gate = model.layers[0].mlp.gate
    gate.scales = mx.zeros_like(gate.scales)
    with pytest.raises(RuntimeError, match="replaced after packing"):
        mx.eval(model(mx.array([[1, 2, 3]])))


def test_a_graph_built_while_packed_reads_right_after_unpacking(tiny_ckpt, monkeypatch):
    """Unpacking writes the MLX layout back into the packed arrays themselves: a step still lazy
    when the model switches device evaluates to what it would have given packed (through the
    row kernels then: EXACT's float sums in another order, not zeros read from released
    pages)."""
    from pocket_mlx.engine import panels

    model = _packed_model(tiny_ckpt, monkeypatch)
    kernels.set_mode("exact")
    tokens = mx.array([[3, 1, 4, 1, 5]])
    want = np.array(model(tokens), dtype=np.float32)
    lazy = model(tokens)
    panels.unpack_model(model)
    got = np.array(lazy, dtype=np.float32)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_panels_are_freed_with_their_model(tiny_ckpt, monkeypatch):
    import gc

    before = kernels._ext.panel_bytes()
    model = _packed_model(tiny_ckpt, monkeypatch)
    assert kernels._ext.panel_bytes() == before + model.panel_report["bytes"]
    del model
    gc.collect()
    assert kernels._ext.panel_bytes() == before


def test_expert_parallel_over_packed_experts(tiny_ckpt, monkeypatch):
    """Expert parallelism (a group of one) on the packed model: its held experts are a view of
    the first experts of the packed stack (the zero expert left out), the same logits."""
    from pocket_mlx.engine import loader

    ref = _packed_model(tiny_ckpt, monkeypatch)
    group = mx.distributed.init()
    model, _ = loader.load(str(tiny_ckpt), device="cpu", shard=lambda m: m.shard_experts(group))
    assert kernels.packed(model.layers[0].mlp.switch_mlp.gate_proj["weight"])
    caches = ref.make_cache(), model.make_cache()
    for x in (mx.array([[1, 50, 30, 7]]), mx.array([[42]])):
        assert mx.array_equal(ref(x, caches[0]), model(x, caches[1]))
