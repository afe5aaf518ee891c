"""`pocket-mlx eval-ppl`: perplexity of a model on a text file of documents."""

from __future__ import annotations

import argparse
import json

from pocket_mlx.cli.args import add_cache_type_args, add_model_args, cache_type
from pocket_mlx.errors import PocketError


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval-ppl", help="perplexity on a text file",
        description="Perplexity over documents separated by `<|endoftext|>` lines, in "
                    "non-overlapping windows. On the CPU a bf16 model runs in float32.")
    add_model_args(p)
    add_cache_type_args(p)
    p.add_argument("--data", required=True, metavar="FILE", help="UTF-8 text file (required)")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--separator", default="<|endoftext|>", metavar="TEXT",
                   help="line that separates documents (default <|endoftext|>)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="use only the first N tokens of the file (default: all of it)")
    p.add_argument("--routing-consistency", default=None, metavar="REF",
                   help="also compare the experts each token routes to with REF (a model "
                        "folder or repo id, e.g. the full-precision original): the mean share "
                        "of the top-k that both pick, per layer and overall (default: off)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import mlx.core as mx

    from pocket_mlx.analysis.perplexity import file_perplexity
    from pocket_mlx.analysis.routing import routing_consistency
    from pocket_mlx.corpus import read_documents, token_stream
    from pocket_mlx.engine.devices import resolve_device, stream_for
    from pocket_mlx.engine.generation import context_limit
    from pocket_mlx.engine.loader import load, resolve_model_path
    from pocket_mlx.progress import progress as progress_bar

    if args.window < 2:
        raise PocketError(f"--window must be at least 2, got {args.window}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise PocketError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    kv = cache_type(args)
    device = resolve_device(args.device)
    # The shared dtype policy (devices.policy_dtype): float32 on the CPU.
    model, tokenizer = load(args.model, device=device, fuse=True)
    model.set_cache_type(kv)
    context = context_limit(model)
    if args.window > context:
        # Past its context a model reads positions it was never trained on: the number
        # would look like a perplexity and mean nothing.
        raise PocketError(f"--window {args.window} is longer than the model's context of "
                          f"{context} tokens; use --window {context} or less")
    ref = None
    if args.routing_consistency is not None:
        # Loaded before the slow part: a bad REF fails at once.
        ref_path = resolve_model_path(args.routing_consistency)
        ref, _ = load(ref_path, device=device, fuse=True)
        if ref.args.vocab_size != model.args.vocab_size:
            raise PocketError(f"--routing-consistency {args.routing_consistency}: its vocabulary "
                              f"({ref.args.vocab_size}) differs from the model's "
                              f"({model.args.vocab_size}); use a build of the same model")
    bar = progress_bar(desc="eval-ppl", unit="window")

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        with mx.stream(stream_for(device)):
            r = file_perplexity(model, tokenizer, args.data, args.window, args.separator,
                                args.max_tokens, progress)
    finally:
        bar.close()
    rc = None
    if ref is not None:
        ids = token_stream(read_documents(args.data, args.separator), tokenizer, args.separator)
        if args.max_tokens is not None:
            ids = ids[:args.max_tokens]
        with mx.stream(stream_for(device)):
            rc = routing_consistency(model, ref, ids, args.window,
                                     resolve_model_path(args.model), ref_path).consistency
    if args.json:
        out = {"ppl": r.ppl, "tokens": r.tokens, "seconds": round(r.seconds, 3),
               "windows": r.windows, "window": args.window, "device": device}
        if rc is not None:
            out["routing_consistency"] = {"reference": args.routing_consistency,
                                          **rc.as_dict()}
        print(json.dumps(out))
    else:
        print(f"perplexity {r.ppl:.3f} over {r.tokens:,} tokens ({r.windows} windows of "
              f"<= {args.window}) in {r.seconds:.1f} s on the {device}")
        if rc is not None:
            layers = " ".join(f"{v:.3f}" for v in rc.per_layer)
            print(f"routing consistency with {args.routing_consistency}: {rc.overall:.3f} "
                  f"(top-{rc.top_k} experts shared, mean over {rc.tokens:,} tokens); "
                  f"per layer: {layers}")
    return 0
