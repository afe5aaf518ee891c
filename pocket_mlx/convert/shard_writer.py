"""Writing per-rank shards (`pocket-mlx shard`, cli/shard.py): which tensors each rank holds,
and the folders. The layout, and how the loader reads it, is engine/rank_shards.py."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx

from pocket_mlx.config import read_config
from pocket_mlx.convert.writer import atomic_dir, copy_tokenizer, save_weights
from pocket_mlx.engine.loader import load_weights
from pocket_mlx.engine.rank_shards import (
    FORMAT,
    MANIFEST,
    MODES,
    RANK_MANIFEST,
    VERSION,
    rank_dir,
    read_manifest,
    read_rank,
)
from pocket_mlx.errors import PocketError
from pocket_mlx.models import build_model
from pocket_mlx.models.parallel import pipeline_ranges, split_evenly

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _is_expert(name: str) -> bool:
    return ".switch_mlp." in name


def _is_mtp(name: str) -> bool:
    """The MTP head's tensors: no rank keeps them (`--distributed` decodes without speculation
    and drops the head, Model.pipeline / shard_experts), so no rank's files carry them."""
    return name.startswith("mtp.")


def _owner_pipeline(name: str, ranges: list[tuple[int, int]], tied: bool) -> set[int]:
    """The ranks that hold tensor `name` in pipeline mode (mirrors `setup_pipeline`)."""
    n = len(ranges)
    if (m := _LAYER.search(name)) is not None:
        i = int(m.group(1))
        return {r for r, (lo, hi) in enumerate(ranges) if lo <= i < hi}
    if ".embed_tokens." in name:
        return {n - 1, 0} if tied else {n - 1}
    if name.startswith("language_model.model.norm.") or "lm_head." in name:
        return {0}
    return set(range(n))  # anything else: every rank keeps it


def plan(weights: dict[str, mx.array], mode: str, ranks: int, num_experts: int,
         tied: bool) -> dict:
    """What each rank holds: {"experts": ranges} or {"layers": ranges}."""
    if mode == "experts":
        if num_experts < ranks:
            raise PocketError(f"experts mode over {ranks} ranks needs at least {ranks} experts "
                              f"per layer; the model has {num_experts}")
        return {"experts": [list(split_evenly(num_experts, ranks, r)) for r in range(ranks)]}
    layer_bytes: dict[int, int] = {}
    head = tail = 0
    for k, v in weights.items():
        if _is_mtp(k):
            continue
        if (m := _LAYER.search(k)) is not None:
            i = int(m.group(1))
            layer_bytes[i] = layer_bytes.get(i, 0) + v.nbytes
        elif ".embed_tokens." in k:
            head += v.nbytes
        elif k.startswith("language_model.model.norm.") or "lm_head." in k:
            tail += v.nbytes
    n = max(layer_bytes) + 1 if layer_bytes else 0
    ranges = pipeline_ranges([layer_bytes.get(i, 0) for i in range(n)], head, tail, [1.0] * ranks)
    return {"layers": [list(r) for r in ranges]}


def _rank_tensors(weights: dict[str, mx.array], mode: str, layout: dict, rank: int,
                  tied: bool) -> tuple[Iterator[tuple[str, mx.array]], dict]:
    """(rank's tensors, lazily; its absent tensors' {name: [dtype, shape]})."""
    absent: dict[str, list] = {}
    if mode == "experts":
        lo, hi = layout["experts"][rank]

        def items():
            for k, v in weights.items():
                if not _is_mtp(k):
                    yield k, (mx.contiguous(v[lo:hi]) if _is_expert(k) else v)

        return items(), absent
    ranges = [tuple(r) for r in layout["layers"]]
    keep = []
    for k, v in weights.items():
        if _is_mtp(k):
            continue
        if rank in _owner_pipeline(k, ranges, tied):
            keep.append(k)
        else:
            absent[k] = [str(v.dtype).split(".")[-1], list(v.shape)]
    return ((k, weights[k]) for k in keep), absent


def write(src: Path, out: Path, ranks: int, mode: str, *, force: bool = False,
          log: Callable[[str], None] = print) -> dict:
    """Split the checkpoint at `src` into per-rank folders under `out` (atomic). Reads each
    source tensor once per rank that holds it (lazily mapped; one tensor in memory at a time)."""
    if mode not in MODES:
        raise PocketError(f"unknown --mode {mode!r}: use pipeline or experts")
    if ranks < 2:
        raise PocketError(f"--ranks must be 2 or more, got {ranks}")
    src = Path(src)
    if read_manifest(src) is not None or read_rank(src) is not None:
        raise PocketError(f"{src} is already split into per-rank shards; pass the unsharded "
                          "checkpoint")
    config = read_config(src)
    model = build_model(config)
    weights = model.sanitize(load_weights(src))
    tied = bool(model.args.tie_word_embeddings)
    layout = plan(weights, mode, ranks, model.args.num_experts, tied)
    manifest = {"format": FORMAT, "version": VERSION, "mode": mode, "ranks": ranks, **layout,
                "source": str(src)}
    with atomic_dir(Path(out), force=force, log=log) as tmp:
        for r in range(ranks):
            d = tmp / rank_dir(r, ranks)
            d.mkdir()
            items, absent = _rank_tensors(weights, mode, layout, r, tied)
            save_weights(d, items)
            shutil.copyfile(src / "config.json", d / "config.json")
            if (src / "pocket.json").is_file():
                shutil.copyfile(src / "pocket.json", d / "pocket.json")
            copy_tokenizer(src, d)
            key = "experts" if mode == "experts" else "layers"
            entry = {"format": FORMAT, "version": VERSION, "mode": mode, "rank": r,
                     "ranks": ranks, key: layout[key][r]}
            if mode == "pipeline":
                entry["layers_all"] = layout["layers"]
                entry["absent"] = absent
            (d / RANK_MANIFEST).write_text(json.dumps(entry))
            log(f"rank {r}: {key} {layout[key][r][0]}-{layout[key][r][1] - 1} -> "
                f"{rank_dir(r, ranks)}")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
