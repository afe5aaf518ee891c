"""models/batched.py: one decode step of several sequences gives every sequence the same logits,
bit for bit, as decoding it alone, on a tiny model with 2 full-attention and 2 Gated DeltaNet
layers, sequences joining and leaving between steps; and the quantized matmuls under it give
each row of an M-row product the bits of the same row alone (what that rests on)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import KERNEL_PATHS, kernel_path

from pocket_mlx.engine.loader import load_model
from pocket_mlx.kernels import ops
from pocket_mlx.models.batched import DecodeBatch

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def quantize_mixed(model: nn.Module) -> None:
    """Bits the CPU kernels run in FAST mode (4, 8) and in EXACT mode only (3, 5)."""

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        if "switch_mlp" in path:
            return {"group_size": 64, "bits": 3}
        if path.endswith(("mlp.gate", "shared_expert_gate")):
            return {"group_size": 64, "bits": 8}
        if path.endswith("lm_head"):
            return {"group_size": 64, "bits": 5}
        return True

    nn.quantize(model, 64, 4, class_predicate=predicate)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from conftest import hf_weights, tiny_config, write_checkpoint

    cfg = tiny_config(layer_types=LAYERS)
    path = write_checkpoint(tmp_path_factory.mktemp("batched") / "m", cfg, hf_weights(cfg, 3))
    m = load_model(path, dtype="float32")
    quantize_mixed(m)
    m.fuse_projections()
    mx.eval(m.parameters())
    return m


@pytest.fixture(params=KERNEL_PATHS)
def path(request):
    """The CPU extension in each mode, and MLX's own ops (extension off)."""
    with kernel_path(request.param) as name:
        yield name


class Seq:
    """A prompt, prefilled alone up to its first token (as the server does before a join)."""

    def __init__(self, model, prompt: list[int]) -> None:
        self.cache = model.make_cache()
        model(mx.array(prompt[:-1])[None], cache=self.cache)
        logits = model(mx.array(prompt[-1:])[None], cache=self.cache)[:, -1, :]
        self.token = mx.argmax(logits, axis=-1).astype(mx.uint32)
        mx.eval(self.token, [a for c in self.cache for a in c.arrays])
        self.logits: list[mx.array] = []

    def alone(self, model) -> None:
        logits = model(self.token[None], cache=self.cache)[:, -1, :]
        self.take(logits)

    def take(self, logits: mx.array) -> None:
        mx.eval(logits)
        self.logits.append(logits)
        self.token = mx.argmax(logits, axis=-1).astype(mx.uint32)


PROMPTS = [[5, 17, 42, 9, 3], [7, 7, 100, 250, 31, 64, 2, 8, 11], [1, 2], [200, 150, 99, 45]]


def test_batched_steps_equal_single_steps(model, path):
    # Alone: each sequence decodes its own 6 tokens.
    ref = [Seq(model, p) for p in PROMPTS]
    for s in ref:
        for _ in range(6):
            s.alone(model)
    # Together: A and B from step 0, C joins at step 2, A leaves after step 3 and finishes
    # alone from its written-back cache, D joins at step 3; B, C and D finish together.
    seqs = [Seq(model, p) for p in PROMPTS]
    a, b, c, d = seqs
    batch = DecodeBatch(model)
    plan = {0: [a, b], 1: [a, b], 2: [a, b, c], 3: [a, b, c, d], 4: [b, c, d], 5: [b, c, d],
            6: [c, d], 7: [c, d], 8: [d]}
    for step, members in plan.items():
        order = batch.set_members([s for s in members if len(s.logits) < 6])
        logits = batch.step(mx.concatenate([s.token for s in order]))
        for i, s in enumerate(order):
            s.take(logits[i:i + 1])
        if step == 3:
            batch.release(a)
    batch.set_members([])
    while len(a.logits) < 6:
        a.alone(model)
    for got, want in zip(seqs, ref):
        assert len(got.logits) == len(want.logits) == 6
        for x, y in zip(got.logits, want.logits):
            assert mx.array_equal(x, y).item(), (path, mx.abs(x - y).max().item())
    # The caches hold the same positions and states as the sequences' own.
    for got, want in zip(seqs, ref):
        for cg, cw in zip(got.cache, want.cache):
            assert cg.offset == cw.offset
            for x, y in zip(cg.arrays, cw.arrays):
                n = cg.offset if x.ndim == 4 and hasattr(cg, "keys") else None
                if n is not None:
                    x, y = x[..., :n, :], y[..., :n, :]
                assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_quantized_matmul_rows_do_not_depend_on_m(path, bits):
    mx.random.seed(bits)
    w = mx.random.normal((300, 512))
    wq, s, b = mx.quantize(w, 64, bits)
    x = mx.random.normal((11, 512))
    full = ops.quantized_matmul(x, wq, s, b, group_size=64, bits=bits)
    for m in (1, 2, 5):
        part = ops.quantized_matmul(x[:m], wq, s, b, group_size=64, bits=bits)
        assert mx.array_equal(part, full[:m]).item(), (path, bits, m)
    for i in range(11):
        one = ops.quantized_matmul(x[i:i + 1], wq, s, b, group_size=64, bits=bits)
        assert mx.array_equal(one, full[i:i + 1]).item(), (path, bits, i)


def test_a_member_needs_its_first_token_first(model):
    s = Seq(model, PROMPTS[0])
    s.cache = model.make_cache()  # nothing ran: no linear-attention state yet
    with pytest.raises(ValueError, match="first token"):
        DecodeBatch(model).set_members([s])
