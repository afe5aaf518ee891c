"""`pocket-mlx bench`: llama-bench-style pp/tg throughput, bandwidth roofline, mlx-lm comparison.

Without `--bandwidth` the roofline still comes from a quick probe (256 MB, best of 3) so every
tg row has one; `--bandwidth` runs the longer probe (1 GB, best of 7) and prints it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pocket_mlx import units
from pocket_mlx.cli import bench_modes
from pocket_mlx.cli.args import (
    add_cache_type_args,
    add_distributed_args,
    add_speculative_args,
    cache_type,
)
from pocket_mlx.errors import PocketError


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="measure prefill and decode speed (llama-bench style)",
                       description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", default=None,
                     help="model folder or Hugging Face repo id (default: the bundled model)")
    src.add_argument("--synthetic", default=None, metavar="NAME",
                     help="random-weight model of a known shape: pocket-35b, pocket-35b-e128, "
                          "tiny (built once into the cache) (default: use --model)")
    p.add_argument("--synthetic-recipe", default=None, metavar="RECIPE",
                   help="quantization of --synthetic: pocket-2bit (default), pocket-3bit, "
                        "uniform-2/3/4/8")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="pp test size (0 = skip)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="tg test size (0 = skip)")
    p.add_argument("--parallel", type=parallel_widths, default=None, metavar="B[,B...]",
                   help="decode the tg test with B sequences together (the server's batched "
                        "decode), e.g. 1,4,8: one row per B with the aggregate tok/s and "
                        "bytes_bound_x, the speed-up the bytes a B-step reads allow "
                        "(default: one sequence, no batch)")
    p.add_argument("-d", "--n-depth", type=depths, default=(0,), metavar="N[,N...]",
                   help="run each pp and tg test after N tokens already in the cache "
                        "(prefilled untimed; llama-bench's --n-depth), e.g. -d 0,4096,16384: "
                        "rows 'pp512 @ d4096' (default: 0)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="runs of each test")
    p.add_argument("--device", choices=["cpu", "gpu"], default=None,
                   help="where to run (default: the GPU when MLX has one, else the CPU)")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="threads of the project's CPU kernels (when built) "
                        "(default: POCKET_MLX_THREADS, else one per physical core)")
    add_cache_type_args(p)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="activation/scale dtype; auto = float32 on the CPU (bf16 is 5-40x slower "
                        "there), the checkpoint's own on the GPU")
    p.add_argument("--vs-mlx-lm", action="store_true",
                   help="also run stock mlx-lm on the same weights, interleaved")
    p.add_argument("--bandwidth", action="store_true",
                   help="run the full memory-bandwidth probe and print it")
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default="md",
                   help="table format")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    add_speculative_args(p, default="off")
    add_distributed_args(p)
    p.set_defaults(func=run)
    bench_modes.add_modes(p)  # `bench kernels`, `bench speculative`, ...: cli/bench_modes.py
    return p


def depths(text: str) -> tuple[int, ...]:
    """-d's list: integers >= 0, comma-separated, each once, in order given."""
    try:
        got = [int(x) for x in text.split(",")]
    except ValueError:
        got = [-1]
    if not got or any(d < 0 for d in got):
        raise argparse.ArgumentTypeError(f"must be token counts >= 0 separated by commas, "
                                         f"e.g. 0,4096, got {text!r}")
    return tuple(dict.fromkeys(got))


def parallel_widths(text: str) -> list[int]:
    """--parallel's value: comma-separated sequence counts >= 1, each once, in order given."""
    try:
        out = [int(v) for v in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1 or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(
            f"--parallel takes distinct sequence counts >= 1 separated by commas (1,4,8), "
            f"got {text!r}")
    return out


def load_for(args, path, device: str, shard=None):
    """The model as `bench` measures it: --dtype (auto: the dtype policy every entry point
    shares, devices.policy_dtype), fused projections (`shard`: this rank's share of a
    distributed run). tests/test_user_path.py compares its decode graph with generate's."""
    from pocket_mlx.engine.loader import load

    dtype = None if args.dtype == "auto" else args.dtype
    kv = cache_type(args)
    model, _ = load(path, device=device, dtype=dtype, fuse=True, shard=shard)
    model.set_cache_type(kv)
    return model


def run(args) -> int:
    for flag, v in (("-r", args.repetitions), ("-p", args.n_prompt), ("-n", args.n_gen)):
        if v < (1 if flag == "-r" else 0):
            raise PocketError(f"{flag} must be {'>= 1' if flag == '-r' else '>= 0'}, got {v}")
    if args.n_prompt == 0 and args.n_gen == 0:
        raise PocketError("-p 0 and -n 0 leave nothing to measure: give -p N (prefill) "
                          "and/or -n N (decode) above 0")
    if args.threads is not None and args.threads < 1:
        raise PocketError(f"--threads must be >= 1, got {args.threads}")
    if args.distributed and args.speculative != "off":
        raise PocketError("--speculative does not run with --distributed: drop one of them")
    if args.parallel:
        for flag, bad in (("--vs-mlx-lm", args.vs_mlx_lm), ("--distributed", args.distributed),
                          ("--speculative", args.speculative != "off"),
                          ("-d above 0", any(args.n_depth)),
                          ("-n 0", args.n_gen == 0)):
            if bad:
                raise PocketError(f"--parallel does not run with {flag}: drop one of them")
    if args.synthetic_recipe and not args.synthetic:
        raise PocketError("--synthetic-recipe needs --synthetic")
    cache_type(args)  # a bad pair fails before the load
    import mlx.core as mx

    from pocket_mlx import kernels
    from pocket_mlx.analysis import bench
    from pocket_mlx.engine import devices

    device = devices.resolve_device(args.device)
    # Before anything imports mlx_lm.generate (see bench.mlx_lm_generate_module).
    mx.set_default_device(devices.mx_device(device))
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    group = None
    if args.distributed:
        if args.vs_mlx_lm:
            raise PocketError("--vs-mlx-lm runs stock mlx-lm in one process: drop it with "
                              "--distributed")
        from pocket_mlx.engine import distributed

        group = distributed.init(args.distributed, args.distributed_timeout)
        if group.rank != 0:  # rank 0 does all output
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
            log = lambda s: None  # noqa: E731

    from pocket_mlx.engine.loader import open_folder, resolve_model_path

    if args.synthetic:
        from pocket_mlx.convert import synthetic

        recipe = args.synthetic_recipe or synthetic.DEFAULT_RECIPE
        if recipe not in synthetic.RECIPES:
            raise PocketError(f"unknown recipe {recipe!r} (known: {', '.join(synthetic.RECIPES)})")
        synthetic.config_for(args.synthetic)  # validates the name
        path = synthetic.build(args.synthetic, recipe, progress=not args.quiet)
        name = args.synthetic
    else:
        path = resolve_model_path(args.model)
        name = path.name
    # Read once and handed to the loader (under --distributed with per-rank shards, pocket-mlx
    # shard: this rank's folder).
    folder = open_folder(path, group)
    recipe = folder.recipe_label
    size = folder.weights_bytes  # as stored: the model's size whatever --dtype loads it as

    threads = bench.set_threads(args.threads)
    kinfo = kernels.info()
    if args.threads and not kinfo["active"]:
        log(f"note: --threads {args.threads} has no effect: MLX runs CPU ops on one thread "
            "and the pocket kernels are not active")
    t0 = time.perf_counter()
    try:
        model = load_for(args, folder, device,
                         shard=distributed.shard_for(group) if group else None)
        if group is not None:
            group.barrier(max(distributed.LOAD_TIMEOUT_S, group.timeout),
                          "the other ranks did not finish loading in time")
            distributed.attach(model, group)
            log(f"distributed: {args.distributed} over {group.size} ranks")
            name = f"{name} [{args.distributed} x{group.size}, rank 0]"
        return _measure(args, model, folder.path, name, recipe, size, device, threads, kinfo, log, t0)
    except RuntimeError as e:  # MLX's ring: a peer closed its connection
        if group is None:
            raise
        raise distributed.lost(group.rank, e) from None


def _measure(args, model, path, name, recipe, size, device, threads, kinfo, log, t0) -> int:
    from pocket_mlx import kernels
    from pocket_mlx.analysis import bench
    from pocket_mlx.engine import devices
    from pocket_mlx.engine.loader import model_weight_stats

    # Said after loading: a checkpoint that fails its load check leaves one error line.
    log(f"loaded {path} ({model.run_dtype or 'checkpoint dtype'}) on {devices.describe(device)} in "
        f"{time.perf_counter() - t0:.1f} s")
    stats = model_weight_stats(model)  # computed once: every run below reuses it
    scales = [v for k, v in _flat(model) if k.endswith("scales")]
    shown_dtype = model.run_dtype or (str(scales[0].dtype).split(".")[-1] if scales else "float")
    if model.kv_cache_type != "f32":
        shown_dtype += f", KV {model.kv_cache_type}"

    bw = bench.probe_bandwidth(device, threads, quick=not args.bandwidth)
    if args.bandwidth:
        print(f"memory read bandwidth ({device}, {threads} thread(s)): {units.bandwidth(bw)}",
              file=sys.stderr if args.output != "md" else sys.stdout, flush=True)

    from pocket_mlx.engine.generation import context_limit

    need = max(args.n_depth) + max(args.n_prompt, bench.TG_PROMPT + args.n_gen)
    if need > context_limit(model):
        raise PocketError(f"-d {max(args.n_depth)} with -p {args.n_prompt} / -n {args.n_gen} "
                          f"needs {need} tokens of context; this model's window is "
                          f"{context_limit(model)}")
    runners = [bench.pocket_runner(model, device, speculative=args.speculative,
                                   num_draft_tokens=args.num_draft_tokens)]
    if args.vs_mlx_lm:
        runners.append(bench.mlx_lm_runner(bench.mlx_lm_model(path, model), device))
    probe = lambda: bench.probe_bandwidth(device, threads)  # noqa: E731
    results = bench.run_tests(runners, vocab=model.args.vocab_size, p=args.n_prompt,
                              n=0 if args.parallel else args.n_gen, repeats=args.repetitions,
                              log=log, probe=probe, depths=args.n_depth)
    meta = dict(model=name, size_bytes=size, params_total=stats.params_total,
                params_active=stats.params_active, recipe=recipe, dtype=shown_dtype,
                device=device, threads=threads, kernels=kernels.label(kinfo),
                bytes_per_token=stats.bytes_per_token,
                kv_bytes_per_position=bench.kv_bytes_per_position(model),
                speculative=(f"{args.speculative} k={args.num_draft_tokens}"
                             if args.speculative != "off" else "off"))
    rows = bench.make_rows(results, meta, bw)
    if args.parallel:
        from pocket_mlx.analysis.parallel import parallel_rows

        meta.pop("kv_bytes_per_position")  # no depth with --parallel
        rows += parallel_rows(model, device, widths=args.parallel, n=args.n_gen,
                              repeats=args.repetitions, meta=meta, log=log, probe=probe)
    if args.output == "json":
        print(bench.to_json(rows, bench.machine_info(bw)))
    elif args.output == "csv":
        sys.stdout.write(bench.to_csv(rows))
    else:
        print(bench.format_markdown(rows))
    return 0


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
