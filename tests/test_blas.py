"""convert/blas.py: numpy-BLAS stand-ins for float32 Linear and SwitchLinear compute what MLX's
own ops compute (up to the order float32 products are summed)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from pocket_mlx.convert.blas import NumpyLinear, NumpySwitchLinear, forward_windows
from pocket_mlx.models.layers import SwitchGLU, SwitchLinear


def close(a: mx.array, b: mx.array) -> bool:
    return np.allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_numpy_linear_equals_mlx(bias):
    mx.random.seed(0)
    lin = nn.Linear(128, 96, bias=bias)
    x = mx.random.normal((2, 5, 128))
    assert close(NumpyLinear(lin)(x), lin(x))


@pytest.mark.parametrize("batch", [(3, 7), (1, 1), (13,)])
def test_numpy_switch_linear_equals_gather_mm(batch):
    """One row per (token, expert) as SwitchGLU calls it: x [..., 1, 1, K] broadcast over the
    k experts of indices [..., k]; experts repeated, some unused."""
    mx.random.seed(1)
    sw = SwitchLinear(64, 48, 10)
    sw.weight = mx.random.normal(sw.weight.shape) * 0.1
    x = mx.random.normal((*batch, 1, 1, 64))
    idx = mx.random.randint(0, 6, (*batch, 4))
    assert close(NumpySwitchLinear(sw)(x, idx), sw(x, idx))


def test_forward_windows_equals_one_window_at_a_time():
    mx.random.seed(2)
    glu = SwitchGLU(32, 24, 8)
    for m in (glu.gate_proj, glu.up_proj, glu.down_proj):
        m.weight = mx.random.normal(m.weight.shape) * 0.1

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.glu = glu

        def __call__(self, h):
            idx = mx.argsort(-self.proj(h), axis=-1)[..., :2] % 8
            return self.glu(h, idx).sum(-2)

    block = Block()
    # Batched, the five 8-token windows take SwitchGLU's sorted path (>= 64 rows); alone, not.
    hs = [mx.random.normal((1, 8, 32)) for _ in range(5)] + [mx.random.normal((1, 3, 32))]
    got = forward_windows(block, hs)
    assert len(got) == len(hs)
    for g, h in zip(got, hs):
        assert g.shape == h.shape and close(g, block(h))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_narrow_expert_stacks_give_the_float32_stacks_products_exactly(dtype):
    """A bf16/fp16 stack (narrow_experts) is widened an expert at a time, to the same float32
    values: the products equal the float32 stack's bit for bit."""
    mx.random.seed(3)
    sw = SwitchLinear(64, 48, 10)
    sw.weight = (mx.random.normal(sw.weight.shape) * 0.1).astype(dtype)
    wide = SwitchLinear(64, 48, 10)
    wide.weight = sw.weight.astype(mx.float32)
    x = mx.random.normal((3, 7, 1, 1, 64))
    idx = mx.random.randint(0, 10, (3, 7, 4))
    got = NumpySwitchLinear(sw)(x, idx)
    assert got.dtype == mx.float32
    assert mx.array_equal(got, NumpySwitchLinear(wide)(x, idx)).item()


def test_narrow_experts_keeps_the_stored_dtype_of_the_experts_only():
    """A float32-cast model of a bf16 checkpoint (the bundled reference): the expert stacks go
    back to bf16, everything else stays float32, and a layer's forward (numpy's BLAS) is
    unchanged bit for bit."""
    from conftest import ROOT

    from pocket_mlx.convert.blas import narrow_experts
    from pocket_mlx.engine.loader import load_model

    src = ROOT / "assets" / "pocket-tiny-bf16"
    wide = load_model(src, dtype="float32", lazy=True)
    narrow = narrow_experts(load_model(src, dtype="float32", lazy=True))
    dtypes = {k: v.dtype for k, v in tree_flatten(narrow.parameters())}
    experts = [k for k in dtypes if ".switch_mlp." in k]
    assert experts and all(dtypes[k] == mx.bfloat16 for k in experts)
    assert all(d == mx.float32 for k, d in dtypes.items()
               if k not in experts and mx.issubdtype(d, mx.floating))
    h = [mx.random.normal((1, 9, wide.args.hidden_size), key=mx.random.key(4))]
    for i in (0, wide.args.num_hidden_layers - 1):
        a = forward_windows(wide.language_model.model.layers[i], h)[0]
        b = forward_windows(narrow.language_model.model.layers[i], h)[0]
        assert mx.array_equal(a, b).item()
