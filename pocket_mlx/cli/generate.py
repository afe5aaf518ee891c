"""`pocket-mlx generate`: one-shot generation, streamed to stdout, stats to stderr."""

from __future__ import annotations

import argparse
import json
import sys

from pocket_mlx.errors import PocketError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="model folder, Hugging Face repo id or synthetic:NAME[:RECIPE] "
                        "(default: the bundled pocket-tiny)")
    p.add_argument("--device", choices=["gpu", "cpu"], default=None,
                   help="where to run (default: the GPU when MLX has one, else the CPU)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def sampling_from_args(args):
    from pocket_mlx.engine.generation import SamplingParams

    s = SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                       min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                       seed=args.seed)
    s.validate()
    return s


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a reply to one prompt and print it as it streams.")
    add_model_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt, or - to read stdin")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise PocketError("the prompt is empty")
    sampling = sampling_from_args(args)
    if args.max_tokens < 0:
        raise PocketError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    from pocket_mlx.engine.devices import resolve_device
    from pocket_mlx.engine.generation import stream_generate
    from pocket_mlx.engine.loader import load

    device = resolve_device(args.device)
    model, tokenizer = load(args.model, device=device, fuse=True)
    text, stats = [], None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                             sampling=sampling, stop=args.stop, device=device,
                             system=args.system, raw=args.raw):
        stats = r.stats
        if r.text:
            text.append(r.text)
            if not args.json:
                sys.stdout.write(r.text)
                sys.stdout.flush()
    if args.json:
        print(json.dumps({
            "text": "".join(text),
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "prompt_tps": round(stats.prompt_tps, 3),
            "generation_tps": round(stats.generation_tps, 3),
            "ttft_s": round(stats.ttft_s, 4),
            "peak_memory_gb": round(stats.peak_memory_gb, 4),
            "bytes_per_token": stats.bytes_per_token,
            "device": stats.device,
            "finish_reason": stats.finish_reason,
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()  # the reply's last line before the stats line on stderr
        print(f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s | "
              f"generation: {stats.generation_tokens} tokens, {stats.generation_tps:.1f} tok/s | "
              f"ttft {stats.ttft_s:.3f} s | peak memory {stats.peak_memory_gb:.3f} GB | "
              f"{stats.device} | {stats.finish_reason}", file=sys.stderr)
    return 0
