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
                        "recipe file (docs/RECIPES.md), or auto (with --target-bpw or --target-size, and --calib); "
                        "default pocket-2bit")
    p.add_argument("--target-bpw", type=float, default=None, metavar="B",
                   help="with --recipe auto: average bits per weight to aim for (default: none; "
                        "required by --recipe auto)")
    p.add_argument("--target-size", default=None, metavar="SIZE",
                   help="with --recipe auto: weight bytes not to exceed (a byte count, or 800MB, "
                        "5GB, 5GiB); the search picks both the experts kept per layer and the "
                        "bits (1-8) of every module by measured loss on --calib (default: none)")
    p.add_argument("--rounding", choices=["rtn", "gptq", "awq"], default=None,
                   help="how modules of 3 bits or fewer are rounded: rtn (round to nearest), "
                        "gptq or awq (activation-aware, on --calib text; small models: loads "
                        "the whole model) (default: gptq with --recipe auto, else rtn)")
    p.add_argument("--prune-to", type=int, default=None, metavar="K",
                   help="keep the K best experts per layer (needs --calib) (default: keep all)")
    p.add_argument("--calib", action="append", default=[], metavar="FILE",
                   help="calibration text, documents separated by <|endoftext|> lines "
                        "(repeatable: several domains) (default: none)")
    p.add_argument("--calib-tokens", type=int, default=None, metavar="N",
                   help="calibration tokens per file (default for expert pruning: 128 routed "
                        "tokens per expert, N = 128 x experts / top-k: 1024 for 32 experts "
                        "top-4, 4096 for the 35B's 256 top-8; other measurements: their own "
                        "caps)")
    # `random` (with the hidden --seed) is accepted too: the baseline of docs/QUALITY.md.
    p.add_argument("--criterion", default="reap-sum", metavar="reap-sum|reap|frequency|reap-max",
                   help="expert score: reap-sum (default), reap, frequency, or reap-max (several "
                        "--calib domains: keep what any one domain relies on)")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="float dtype of unquantized weights and scales (default: the source's)")
    p.add_argument("--shard-size-gb", type=float, default=None, metavar="G",
                   help="largest safetensors shard (default 5)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--resume", action="store_true",
                   help="continue a run of this same command that was killed (kill -9, crash, "
                        "power loss) from its last finished layer or search step, in the "
                        "temporary folder it left beside OUT (default: start afresh)")
    p.add_argument("--json", action="store_true", help="print pocket.json at the end")
    p.set_defaults(func=run)
    return p


def _terminate(signum, _frame):
    # SystemExit unwinds through atomic_dir, which removes the temporary folder.
    raise SystemExit(128 + signum)


def run(args) -> int:
    from pocket_mlx.convert.pipeline import ConvertOptions, convert, shard_bytes, summary
    from pocket_mlx.convert.recipes import load_recipe
    from pocket_mlx.units import parse_size

    auto = args.recipe == "auto"
    target_size = None
    if args.target_size is not None:
        if not auto:
            raise PocketError("--target-size goes with --recipe auto")
        if args.target_bpw is not None:
            raise PocketError("give --target-bpw or --target-size, not both")
        try:
            target_size = parse_size(args.target_size)
        except ValueError as e:
            raise PocketError(f"--target-size: {e}") from None
    if auto and args.target_bpw is None and target_size is None:
        raise PocketError("--recipe auto needs --target-bpw B or --target-size SIZE")
    if args.target_bpw is not None and not auto:
        raise PocketError("--target-bpw goes with --recipe auto")
    if auto and args.target_bpw is not None and not 2.5 <= args.target_bpw <= 16:
        raise PocketError(f"--target-bpw {args.target_bpw:g}: must be between 2.5 and 16")
    recipe = None if auto else load_recipe(args.recipe)
    if args.calib_tokens is not None and args.calib_tokens <= 1:
        raise PocketError(f"--calib-tokens must be > 1, got {args.calib_tokens}")
    opts = ConvertOptions(
        recipe=recipe, auto_bpw=args.target_bpw, target_size=target_size,
        prune_to=args.prune_to, calib=[Path(c) for c in args.calib],
        criterion=args.criterion, seed=args.seed, dtype=args.dtype, rounding=args.rounding,
        shard_bytes=shard_bytes(args.shard_size_gb), calib_tokens=args.calib_tokens,
        force=args.force, resume=args.resume, progress=True,  # a bar on a terminal, plain lines in a pipe
    )
    signal.signal(signal.SIGTERM, _terminate)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    result = convert(args.src, Path(args.out), opts, log=log)
    if args.json:
        print(json.dumps(result.info))
    else:
        print(summary(result.info, result.out))
    return 0
