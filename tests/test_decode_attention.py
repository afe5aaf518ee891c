"""The extension's decode attention node (`_qkernels.decode_attention` through
`Attention.decode_rows`, for a decode step of one sequence and for a batched step of B,
models/batched.py) against the ops it replaces (RoPE, the KV cache's append, the one-row attention with its gate, per sequence): the same
bits for the output and for the caches, rows of different lengths, a cache that grows on the way,
every ISA this CPU runs; a cache buffer someone else holds is copied, never written over; one that
nobody holds is written in place; and a model's greedy decode gives the same logits either way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pocket_mlx import kernels
from pocket_mlx.kernels import ops
from pocket_mlx.models.cache import KVCache, attend_as
from pocket_mlx.models.qwen3_5_moe import Attention

RNG = np.random.default_rng()
HQ, HKV, D, DIMS, BASE = 8, 2, 64, 16, 1e6
SCALE = D**-0.5


# Every test: the extension on the CPU (skips without it, fails under POCKET_MLX_REQUIRE_KERNELS=1).
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _a(*shape):
    return mx.array(RNG.standard_normal(shape).astype(np.float32))


def _caches(lengths: list[int], dtype=None) -> list[KVCache]:
    caches = []
    for n in lengths:
        c = KVCache(dtype)
        if n:
            c.update_and_fetch(_a(1, HKV, n, D), _a(1, HKV, n, D))
        mx.eval(c.arrays)
        caches.append(c)
    return caches


def _copy(caches: list[KVCache]) -> list[KVCache]:
    out = []
    for c in caches:
        d = KVCache(c.dtype)
        d.offset = c.offset
        if c.keys is not None:
            d.keys, d.values = c.keys * 1, c.values * 1  # copies (in the cache's dtype)
            mx.eval(d.keys, d.values)
        out.append(d)
    return out


def _per_sequence(q, k, v, gate, caches):
    """What batched.attend ran per sequence before the node (and runs without the extension)."""
    outs = []
    for i, c in enumerate(caches):
        qi = ops.rope(q[i:i + 1], DIMS, BASE, c.offset)
        ki = ops.rope(k[i:i + 1], DIMS, BASE, c.offset)
        ki, vi = attend_as(*c.update_and_fetch(ki, v[i:i + 1]), qi.dtype)
        outs.append(ops.gated_attention(qi, ki, vi, gate[i:i + 1], SCALE, None))
    return mx.concatenate(outs)


def _step_inputs(B: int):
    q = _a(B, 1, HQ, D).transpose(0, 2, 1, 3)  # the model's transposed views
    k = _a(B, 1, HKV, D).transpose(0, 2, 1, 3)
    v = _a(B, 1, HKV, D).transpose(0, 2, 1, 3)
    gate = mx.split(_a(B, 1, HQ, 2 * D), 2, axis=-1)[1]  # strided, as the model's split gives
    return q, k, v, gate


class _Heads:
    """What `Attention.decode_rows` reads of its layer."""

    rope_dims, rope_base, scale = DIMS, BASE, SCALE


def _node(q, k, v, gate, caches):
    return Attention.decode_rows(_Heads(), q, gate, k, v, caches)


def _equal(a: mx.array, b: mx.array) -> bool:
    a, b = (x.astype(mx.float32) if x.dtype == mx.bfloat16 else x for x in (a, b))  # exact
    return a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
@pytest.mark.parametrize("dtype", [None, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_node_has_the_per_sequence_bits(isa, dtype):
    """A half cache (--cache-type-k f16 / bf16): the node rounds the new row as MLX's astype
    does and attends the cache's values as the ops do after casting them to float32."""
    if not kernels.set_isa(isa):
        pytest.skip(f"{isa} not available")
    # Lengths: empty, short, one short of a block, a block exactly (grows), long; then 3 more
    # steps so the ones at a block's edge grow on the way.
    lengths = [0, 5, KVCache.step - 1, KVCache.step, 300]
    mine, ref = _caches(lengths, dtype), None
    ref = _copy(mine)
    for _ in range(4):
        q, k, v, gate = _step_inputs(len(lengths))
        out = _node(q, k, v, gate, mine)
        assert out is not None, "the node did not run"
        want = _per_sequence(q, k, v, gate, ref)
        assert out.shape == want.shape == (len(lengths), 1, HQ * D)
        assert _equal(out, want), f"{isa}: output differs"
        for c, r in zip(mine, ref):
            assert c.offset == r.offset
            assert c.keys.shape == r.keys.shape
            assert _equal(c.keys[..., :c.offset, :], r.keys[..., :r.offset, :]), "keys differ"
            assert _equal(c.values[..., :c.offset, :], r.values[..., :r.offset, :])


def test_a_held_buffer_is_copied_and_a_free_one_written_in_place():
    caches = _caches([7, 20, 3])
    held_k = caches[0].keys  # the same array held elsewhere
    held_v = caches[2].values.reshape(caches[2].values.shape)  # a view of its data, as
    before_k, before_v = np.array(held_k), np.array(held_v)  # the prompt cache's snapshots hold
    free_addr = np.asarray(memoryview(caches[1].values)).ctypes.data
    q, k, v, gate = _step_inputs(3)
    out = _node(q, k, v, gate, caches)
    mx.eval(out, [a for c in caches for a in c.arrays])
    assert np.array_equal(np.array(held_k), before_k), "a held cache buffer was written over"
    assert np.array_equal(np.array(held_v), before_v), "a viewed cache buffer was written over"
    assert not np.array_equal(np.array(caches[0].keys), before_k)  # the new row is in the copy
    assert not np.array_equal(np.array(caches[2].values), before_v)
    assert np.asarray(memoryview(caches[1].values)).ctypes.data == free_addr


def test_cache_type_names_and_a_half_cache_holds_half_the_bytes(tiny_ckpt):
    from pocket_mlx.engine.loader import load_model
    from pocket_mlx.errors import PocketError

    model = load_model(tiny_ckpt, dtype="float32")
    sizes = {}
    for name in ("f32", "f16", "bf16"):
        model.set_cache_type(name)
        cache = model.make_cache()
        mx.eval(model(mx.array([[3, 1, 4, 1, 5]]), cache=cache))
        kv = [c for c in cache if type(c) is KVCache]
        sizes[name] = sum(c.nbytes for c in kv)
        assert {c.keys.dtype for c in kv} == {
            {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[name]}
    assert sizes["f16"] == sizes["bf16"] == sizes["f32"] // 2
    with pytest.raises(PocketError, match="unknown KV cache type 'q8_0'"):
        model.set_cache_type("q8_0")


def test_other_caches_and_devices_fall_back():
    q, k, v, gate = _step_inputs(1)

    class OtherCache(KVCache):
        pass

    assert _node(q, k, v, gate, [OtherCache()]) is None
    kernels.set_enabled(False)
    assert _node(q, k, v, gate, _caches([3])) is None


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_model_decode_has_the_same_logits_with_and_without_the_node(tiny_ckpt, monkeypatch,
                                                                    cache_type):
    from pocket_mlx.engine.loader import load_model

    model = load_model(tiny_ckpt, dtype="float32")
    model.set_cache_type(cache_type)  # f16: --cache-type-k/-v f16, the node reads it as stored
    monkeypatch.setattr(KVCache, "step", 4)  # grow every 4 positions: growth on the way

    def decode(steps: int) -> list[np.ndarray]:
        cache = model.make_cache()
        logits = model(mx.array([[3, 1, 4, 1, 5]]), cache=cache)[:, -1, :]
        out = []
        for _ in range(steps):
            tok = mx.argmax(logits, axis=-1)
            logits = model(tok[None], cache=cache)[:, -1, :]
            out.append(np.array(logits))
        return out

    ran = []
    real = ops.decode_attention
    monkeypatch.setattr(ops, "decode_attention", lambda *a: ran.append(real(*a)) or ran[-1])
    with_node = decode(9)
    assert ran and all(r is not None for r in ran), "the node did not run"
    want = mx.float16 if cache_type == "f16" else mx.float32
    assert all(o.dtype == want for r in ran for o in r[1:]), "the cache's buffers' dtype"

    def per_sequence_ops(*a):  # no node: the model runs RoPE, the cache append, attention
        ran.append(None)

    monkeypatch.setattr(ops, "decode_attention", per_sequence_ops)
    without = decode(9)
    assert ran[-1] is None
    for a, b in zip(with_node, without):
        assert np.array_equal(a, b)
