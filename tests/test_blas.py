"""convert/blas.py: numpy-BLAS stand-ins for float32 Linear and SwitchLinear compute what MLX's
own ops compute (up to the order float32 products are summed)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

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
