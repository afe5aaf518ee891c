"""`pocket-mlx bench MODE`: measurements beside the default pp/tg table (which `pocket-mlx bench`
without a mode runs, as before). Each mode's measuring is in pocket_mlx/analysis/; here only
its flags."""

from __future__ import annotations

import argparse
import sys

MODES_HELP = ("without a mode: the pp/tg table (llama-bench style, the options below); "
              "a mode runs another measurement (pocket-mlx bench MODE --help)")


def add_modes(p: argparse.ArgumentParser) -> None:
    """The modes, as optional subcommands of `bench`'s parser."""
    sub = p.add_subparsers(dest="bench_mode", metavar="MODE", title="modes",
                           description=MODES_HELP)
    sub.required = False
    _kernels(sub)
    _prefix_cache(sub)
    _speculative(sub)


def _kernels(sub) -> None:
    from pocket_mlx.analysis import kernel_bench

    k = sub.add_parser("kernels", help="the CPU quantized kernels against MLX's own CPU ops "
                       "(GB/s of weights, random weights of the 35B shape)",
                       description=kernel_bench.__doc__.split("\n\n")[0])
    k.add_argument("--threads", "-t", type=int, default=None,
                   help="threads of the kernels (default: one per physical core)")
    k.add_argument("--mode", choices=["exact", "fast"], default="exact",
                   help="the kernels' mode (fast: int8 activations, the mode models run in)")
    k.add_argument("--quick", action="store_true", help="shorter timings")
    k.add_argument("--only-1bit", action="store_true", help="only the 1-bit vs 2-bit section")
    k.set_defaults(func=run_kernels)


def _prefix_cache(sub) -> None:
    from pocket_mlx.analysis import prefix_cache_bench

    c = sub.add_parser("prefix-cache", help="time to first token of a long system prompt cold "
                       "and reused from serve's prompt cache (real HTTP, a serve child)",
                       description=prefix_cache_bench.__doc__.split("\n\n")[0])
    c.add_argument("--model", "-m", default=None,
                   help="model folder, Hugging Face repo id or synthetic:NAME[:RECIPE] "
                        "(default: the bundled model)")
    c.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where to run")
    c.add_argument("--rules", type=int, default=45,
                   help="system prompt length in rules (45: ~1,300 tokens, bundled tokenizer)")
    c.add_argument("--interval", type=int, default=1024,
                   help="prefill tokens of the snapshot-cost measurement")
    c.add_argument("--identity", type=int, default=0, metavar="N",
                   help="also check that N greedy tokens behind a reused prefix equal a "
                        "cache-off server's (a second server start; 0: no check)")
    c.add_argument("--no-cost", action="store_true",
                   help="skip the in-process snapshot cost (a second load of the model)")
    c.add_argument("--session-identity", type=int, default=0, metavar="N",
                   help="only the in-process chat-session check with N greedy tokens (token ids "
                        "compared, no server; 0: off)")
    c.set_defaults(func=run_prefix_cache)


def _speculative(sub) -> None:
    from pocket_mlx.analysis import speculative_bench

    s = sub.add_parser("speculative", help="decode tok/s with speculative decoding (lookup, "
                       "mtp, auto) against without, replies checked identical",
                       description=speculative_bench.__doc__.split("\n\n")[0])
    s.add_argument("--model", "-m", default=None,
                   help="model folder, Hugging Face repo id or synthetic:NAME[:RECIPE] "
                        "(default: the bundled model)")
    s.add_argument("--k", default="2,3,4", help="draft lengths of lookup (the table without --ordinary)")
    s.add_argument("--reps", "-r", type=int, default=3, help="interleaved runs of each method")
    s.add_argument("-n", "--n-gen", type=int, default=256, help="tokens per reply")
    s.add_argument("--ordinary", action="store_true",
                   help="three ordinary prompts (en, zh, code) and the methods of --methods")
    s.add_argument("--methods", default="off,mtp:1,mtp:2,mtp:3,auto:3",
                   help="--ordinary's METHOD[:K],... (the first is the baseline)")
    s.set_defaults(func=run_speculative)


def run_kernels(args) -> int:
    from pocket_mlx.analysis import kernel_bench
    from pocket_mlx.errors import PocketError

    if args.threads is not None and args.threads < 1:
        raise PocketError(f"--threads must be >= 1, got {args.threads}")
    say = lambda s: print(s, flush=True)  # noqa: E731
    ok = kernel_bench.run(threads=args.threads, mode=args.mode, quick=args.quick,
                          only_1bit=args.only_1bit, say=say)
    return 0 if ok else 1


def _ks(text: str) -> list[int]:
    from pocket_mlx.errors import PocketError

    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise PocketError(f"--k takes draft lengths >= 1 separated by commas (2,3,4), got {text!r}")
    return ks


def run_speculative(args) -> int:
    from pocket_mlx.analysis import speculative_bench as sb
    from pocket_mlx.engine.loader import load, resolve_model_path
    from pocket_mlx.errors import PocketError

    for flag, v in (("--reps", args.reps), ("-n", args.n_gen)):
        if v < 1:
            raise PocketError(f"{flag} must be >= 1, got {v}")
    methods = sb.parse_methods(args.methods) if args.ordinary else None
    ks = None if args.ordinary else _ks(args.k)
    path = resolve_model_path(args.model)
    print(f"loading {path} ...", file=sys.stderr, flush=True)
    model, tok = load(path, device="cpu", fuse=True)
    say = lambda s: print(s, flush=True)  # noqa: E731
    if args.ordinary:
        sb.ordinary_table(model, tok, name=path.name, methods=methods, reps=args.reps,
                          n=args.n_gen, say=say)
    else:
        sb.tps_table(model, tok, name=path.name, ks=ks, reps=args.reps, n=args.n_gen, say=say)
    return 0


def run_prefix_cache(args) -> int:
    from pocket_mlx.analysis import prefix_cache_bench as pc
    from pocket_mlx.engine.loader import load, resolve_model_path
    from pocket_mlx.errors import PocketError

    for flag, v, low in (("--rules", args.rules, 1), ("--interval", args.interval, 1),
                         ("--identity", args.identity, 0),
                         ("--session-identity", args.session_identity, 0)):
        if v < low:
            raise PocketError(f"{flag} must be >= {low}, got {v}")
    say = lambda s: print(s, flush=True)  # noqa: E731
    path = resolve_model_path(args.model)  # a bad --model fails here, before a server starts
    if args.session_identity:
        model, tok = load(path, device=args.device)[:2]
        same = pc.session_identity(model, tok, device=args.device, rules=args.rules,
                                   n=args.session_identity, say=say)
        return 0 if same else 1
    same = pc.http_part(model=str(path), device=args.device, rules=args.rules,
                        identity=args.identity, say=say)
    if not args.no_cost:
        model, tok = load(path, device=args.device)[:2]
        pc.snapshot_cost(model, tok, rules=args.rules, interval=args.interval, say=say)
    return 0 if same else 1
