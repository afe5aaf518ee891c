"""`pocket-mlx convert`: prune experts on calibration text and quantize with a recipe."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from pocket_mlx.errors import PocketError


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "convert", help="convert a checkpoint: expert pruning + mixed-precision quantization",
        description="Convert SRC (local folder or Hugging Face repo id, any supported layout) "
                    "into an MLX checkpoint OUT that pocket-mlx and mlx-lm load. Streams layer "
                    "by layer; OUT appears only when the conversion is complete.")
    p.add_argument("src", metavar="SRC", help="model folder or Hugging Face repo id")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist, unless --force)")
    p.add_argument("--recipe", default="pocket-2bit", metavar="NAME|FILE",
                   help="bf16, float, uniform-2|3|4|6|8, pocket-2bit, pocket-3bit, or a .toml "
                        "recipe file (docs/RECIPES.md), or auto (with --target-bpw and --calib); "
                        "default pocket-2bit")
    p.add_argument("--target-bpw", type=float, default=None, metavar="B",
                   help="with --recipe auto: average bits per weight to aim for (default: none; "
                        "required by --recipe auto)")
    p.add_argument("--prune-to", type=int, default=None, metavar="K",
                   help="keep the K best experts per layer (needs --calib) (default: keep all)")
    p.add_argument("--calib", action="append", default=[], metavar="FILE",
                   help="calibration text, documents separated by <|endoftext|> lines "
                        "(repeatable: several domains) (default: none)")
    p.add_argument("--calib-tokens", type=int, default=16384, metavar="N",
                   help="calibration tokens per file (default 16384)")
    # `random` (with the hidden --seed) is accepted too: the baseline of docs/QUALITY.md.
    p.add_argument("--criterion", default="reap-sum", metavar="reap-sum|reap|frequency",
                   help="expert score: reap-sum (default), reap, frequency")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="float dtype of unquantized weights and scales (default: the source's)")
    p.add_argument("--shard-size-gb", type=float, default=None, metavar="G",
                   help="largest safetensors shard (default 5)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print pocket.json at the end")
    p.set_defaults(func=run)
    return p


def _terminate(signum, _frame):
    # SystemExit unwinds through atomic_dir, which removes the temporary folder.
    raise SystemExit(128 + signum)


def run(args) -> int:
    from pocket_mlx.convert.pipeline import ConvertOptions, convert, shard_bytes, summary
    from pocket_mlx.convert.recipes import load_recipe

    auto = args.recipe == "auto"
    if auto and args.target_bpw is None:
        raise PocketError("--recipe auto needs --target-bpw B")
    if args.target_bpw is not None and not auto:
        raise PocketError("--target-bpw goes with --recipe auto")
    if auto and not 2.5 <= args.target_bpw <= 16:
        raise PocketError(f"--target-bpw {args.target_bpw:g}: must be between 2.5 and 16")
    recipe = None if auto else load_recipe(args.recipe)
    if args.calib_tokens <= 1:
        raise PocketError(f"--calib-tokens must be > 1, got {args.calib_tokens}")
    opts = ConvertOptions(
        recipe=recipe, auto_bpw=args.target_bpw, prune_to=args.prune_to, calib=[Path(c) for c in args.calib],
        criterion=args.criterion, seed=args.seed, dtype=args.dtype,
        shard_bytes=shard_bytes(args.shard_size_gb), calib_tokens=args.calib_tokens,
        force=args.force, progress=True,  # a bar on a terminal, plain lines in a pipe
    )
    signal.signal(signal.SIGTERM, _terminate)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    result = convert(args.src, Path(args.out), opts, log=log)
    if args.json:
        print(json.dumps(result.info))
    else:
        print(summary(result.info, result.out))
    return 0
