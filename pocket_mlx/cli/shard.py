"""`pocket-mlx shard`: split a checkpoint into per-rank folders for `--distributed`, so that no
rank reads the whole checkpoint (engine/rank_shards.py has the layout,
convert/shard_writer.py writes it).

A command of its own rather than a `convert` option: splitting copies an already converted
checkpoint's bytes (no math, seconds to minutes), while `convert` prunes, calibrates and
quantizes (slow). One `shard` works on any checkpoint pocket-mlx loads (a converted folder, a
download, `synthetic:NAME`) and can be run again for another rank count or mode without
converting again; `convert` keeps writing one folder.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from pocket_mlx.cli.args import int_range


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "shard", help="split a checkpoint into per-rank shards for --distributed",
        description="Split MODEL into OUT/rank-R-of-N folders: under --distributed MODE over N "
                    "ranks, rank R reads only its own folder (experts: the dense parts and its "
                    "block of every layer's experts; pipeline: its layers). Pass OUT as "
                    "--model. OUT appears only when complete (docs/DISTRIBUTED.md).")
    p.add_argument("model", metavar="MODEL",
                   help="model folder, Hugging Face repo id or synthetic:NAME[:RECIPE]")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist, unless --force)")
    p.add_argument("--ranks", "-N", type=int_range(2, None, "2 or more"), required=True,
                   help="number of ranks the shards are for (required)")
    p.add_argument("--mode", choices=["experts", "pipeline"], required=True,
                   help="the --distributed mode the shards are for (required)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run)
    return p


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through atomic_dir, which removes the temp folder


def run(args) -> int:
    from pocket_mlx.convert import shard_writer
    from pocket_mlx.engine.loader import resolve_model_path

    signal.signal(signal.SIGTERM, _terminate)
    src = resolve_model_path(args.model)
    m = shard_writer.write(src, Path(args.out), args.ranks, args.mode, force=args.force,
                          log=lambda s: print(s, file=sys.stderr))
    print(f"wrote {args.out}: {m['ranks']} ranks, --distributed {m['mode']}")
    return 0
