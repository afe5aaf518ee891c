"""collect_stats drops the embedding table once the windows are embedded (issue 29: 2 GB in
float32 at the 35B's 248320 x 2048), with statistics identical to embedding on demand."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from pocket_mlx.convert import synthetic
from pocket_mlx.convert.calibrate import collect_stats
from pocket_mlx.convert.prune import ExpertStats
from pocket_mlx.engine.loader import load_model


def _on_demand(model, chunks, sources) -> ExpertStats:
    """The statistics as computed before the change: the table kept, the MTP head's tokens
    t+1+i embedded when the head runs."""
    lm, mtp = model.language_model, model.mtp
    layers = lm.model.layers
    rows = len(layers) + len(mtp.layers)
    stats = ExpertStats(rows, model.args.num_experts)
    stats.tokens = sum(len(c) for c in chunks)
    stats.by_source = np.zeros((max(sources) + 1, rows, model.args.num_experts))
    hs = [lm.model.embed_tokens(mx.array(c, mx.int32)[None]) for c in chunks]
    for i, layer in enumerate(layers):
        layer.mlp.observer = stats.observer(i)
        for j, h in enumerate(hs):
            stats.source = sources[j]
            hs[j] = layer(h)
            mx.eval(hs[j])
        layer.mlp.observer = None
    hs = [lm.model.norm(h) for h in hs]
    for i, layer in enumerate(mtp.layers):
        layer.mlp.observer = stats.observer(len(layers) + i)
        for j, (c, h) in enumerate(zip(chunks, hs)):
            toks = c[i + 1 :]
            if not toks:
                continue
            stats.source = sources[j]
            emb = lm.model.embed_tokens(mx.array(toks, mx.int32)[None])
            hs[j] = mtp(h[:, : len(toks)], emb, None, step=i)
            mx.eval(hs[j])
        layer.mlp.observer = None
    return stats


def test_stats_identical_and_table_dropped(tmp_path):
    src = synthetic.build("tiny-mtp", out=tmp_path / "s", progress=False)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 8192, n).tolist() for n in (64, 40, 1, 64)]
    sources = [0, 0, 1, 1]
    want = _on_demand(load_model(src, dtype="float32", lazy=True), chunks, sources)
    model = load_model(src, dtype="float32", lazy=True)
    got = collect_stats(model, chunks, progress=False, sources=sources)
    assert model.language_model.model.embed_tokens is None  # the table is not held
    assert got.tokens == want.tokens
    for k, v in vars(want).items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(getattr(got, k), v, err_msg=k)
    assert got.freq[-1].sum() > 0  # the head was observed
