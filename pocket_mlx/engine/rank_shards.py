"""Per-rank shards: one checkpoint split so that each rank of a `--distributed` run reads only
its own share from disk: the layout and its reading (the loader). `pocket-mlx shard` (cli/shard.py)
writes them with convert/shard_writer.py.

Layout of a sharded folder OUT (written atomically: a temporary folder renamed at the end):

    OUT/shards.json         {"format": FORMAT, "version": 1, "mode", "ranks", "experts" or
                             "layers": [[lo, hi] per rank], "source"}
    OUT/rank-R-of-N/        a model folder: config.json, tokenizer files, pocket.json,
                            model*.safetensors (+ index), and shard.json (this rank's entry)

- experts: rank R's files hold every dense tensor plus experts [lo, hi) of every layer's
  stacked routed-expert tensors (`switch_mlp.*`, leading axis sliced). The ranges are
  `split_evenly`, the same ones an unsharded experts run uses.
- pipeline: rank R's files hold only its layers (rank 0 also the final norm and lm_head, the last
  rank the embedding). The layer ranges are fixed when the shards are written (equal weight bytes
  per rank), not measured from each rank's RAM at load time. The rank's shard.json lists the
  names, dtypes and shapes of the tensors it does not hold ("absent"): the loader builds the
  whole skeleton from lazy placeholders of those shapes (never evaluated: the pipeline setup
  drops them first), so everything that traces the full model (the hidden state's dtype between
  ranks) works as with the whole checkpoint.

The checkpoint's tensor names are written as the model's `sanitize` produces them (MLX layout),
so a rank folder loads through the normal path.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from pocket_mlx.errors import PocketError

FORMAT = "pocket-mlx-rank-shards"
VERSION = 1
MANIFEST = "shards.json"
RANK_MANIFEST = "shard.json"
MODES = ("pipeline", "experts")


def rank_dir(rank: int, ranks: int) -> str:
    return f"rank-{rank}-of-{ranks}"


def _read_json(f: Path) -> dict:
    try:
        data = json.loads(f.read_text())
    except OSError as e:
        raise PocketError(f"cannot read {f}: {e.strerror or e}") from None
    except ValueError as e:
        raise PocketError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PocketError(f"{f} is not a JSON object")
    return data


def read_manifest(path: Path) -> dict | None:
    """OUT/shards.json, checked; None when `path` is not a sharded folder."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        return None
    m = _read_json(f)
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise PocketError(f"{f} is not a pocket-mlx shard manifest of version {VERSION}; "
                          "write the shards again with `pocket-mlx shard`")
    if m.get("mode") not in MODES or not isinstance(m.get("ranks"), int) or m["ranks"] < 2:
        raise PocketError(f"{f}: bad mode or ranks ({m.get('mode')!r}, {m.get('ranks')!r})")
    return m


def read_rank(path: Path) -> dict | None:
    """A rank folder's shard.json; None when `path` is not one rank's share."""
    f = Path(path) / RANK_MANIFEST
    return _read_json(f) if f.is_file() else None


def _describe(m: dict) -> str:
    return f"--distributed {m['mode']} over {m['ranks']} ranks"


def rank_folder(path: Path, group) -> Path:
    """The folder this process loads: `path` itself when it holds no per-rank shards, else
    `path/rank-R-of-N` for this rank. `group` is the run's `distributed.Group` (mode, rank,
    size) or None for one process. A layout that does not match the run is one PocketError
    line, raised on every rank before anything is read (so every rank exits with it)."""
    path = Path(path)
    m = read_manifest(path)
    if m is None:
        r = read_rank(path)
        if r is not None and (group is None or (r.get("mode"), r.get("rank"), r.get("ranks"))
                              != (group.mode, group.rank, group.size)):
            raise PocketError(f"{path} is one rank's share of a sharded checkpoint; pass the "
                              f"folder above it (with {MANIFEST}) under --distributed")
        return path  # a plain checkpoint, or this very rank's folder (picked already)
    if group is None:
        raise PocketError(f"{path} holds per-rank shards for {_describe(m)} (pocket-mlx "
                          f"shard): run it under mlx.launch -n {m['ranks']} with --distributed "
                          f"{m['mode']}, or pass the unsharded checkpoint")
    if m["mode"] != group.mode or m["ranks"] != group.size:
        raise PocketError(f"rank {group.rank}: {path} holds shards for {_describe(m)}, this run "
                          f"is --distributed {group.mode} over {group.size} ranks; start "
                          f"{m['ranks']} ranks with --distributed {m['mode']}, or write shards "
                          f"for this run with `pocket-mlx shard MODEL OUT --ranks {group.size} "
                          f"--mode {group.mode}`")
    sub = path / rank_dir(group.rank, group.size)
    r = read_rank(sub) if sub.is_dir() else None
    if r is None or r.get("rank") != group.rank or r.get("mode") != m["mode"]:
        raise PocketError(f"rank {group.rank}: {sub} is missing or not this rank's share; "
                          "write the shards again with `pocket-mlx shard`")
    return sub


def complete(weights: dict[str, mx.array], rank: dict, model) -> dict[str, tuple]:
    """Fit one rank's tensors to the whole model's skeleton before the shape check: pipeline
    adds lazy placeholders for the tensors other ranks hold (never evaluated); experts returns
    the shapes the rank's expert tensors have (their leading axis is its block). Returns the
    shapes that differ from the skeleton's, for `check_shapes`."""
    if rank["mode"] == "pipeline":
        for name, (dtype, shape) in rank.get("absent", {}).items():
            if name in weights:
                raise PocketError(f"{name} is both in this rank's files and listed as absent in "
                                  f"its {RANK_MANIFEST}; write the shards again")
            weights[name] = mx.zeros(tuple(shape), getattr(mx, dtype))
        return {}
    lo, hi = rank["experts"]
    return {k: (hi - lo, *v.shape[1:]) for k, v in tree_flatten(model.parameters())
            if ".switch_mlp." in k}
