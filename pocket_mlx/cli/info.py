"""`pocket-mlx info`: a model's shape, size, quantization, RAM need and decode ceiling."""

from __future__ import annotations

import argparse
import json


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("info", help="describe a model: size, quantization, RAM, decode ceiling",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", default=None,
                   help="model folder, repo id, config.json, or synthetic:NAME[:RECIPE] "
                        "(default: the bundled model)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context for the RAM estimate (default: the model's maximum)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GBPS",
                   help="memory bandwidth in GB/s for the decode ceiling (default: the "
                        "published figure of this Apple chip)")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="also estimate running across N machines (--distributed pipeline and "
                        "experts): memory per rank, collectives and decode tok/s (default: "
                        "one machine, no estimate)")
    p.add_argument("--link", choices=["thunderbolt5", "10gbe", "1gbe"], default=None,
                   help="with --ranks: the link between the machines (default: thunderbolt5; "
                        "typical figures, stated as assumptions)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from pocket_mlx.analysis.info import describe, format_text
    from pocket_mlx.errors import PocketError

    if args.bandwidth is not None and args.bandwidth <= 0:
        raise PocketError(f"--bandwidth must be > 0 GB/s, got {args.bandwidth}")
    if args.ranks is not None and args.ranks < 2:
        raise PocketError(f"--ranks must be 2 or more, got {args.ranks}")
    if args.link is not None and args.ranks is None:
        raise PocketError("--link describes the link between machines: add --ranks N")
    d = describe(args.model, args.context, args.bandwidth, ranks=args.ranks, link=args.link)
    print(json.dumps(d, indent=2) if args.json else format_text(d))
    return 0
