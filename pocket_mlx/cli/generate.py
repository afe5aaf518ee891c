"""`pocket-mlx generate`: one-shot generation, streamed to stdout, stats to stderr."""

from __future__ import annotations

import argparse
import json
import sys

from pocket_mlx.cli import args as argtypes
from pocket_mlx.cli.args import (
    add_cache_type_args,
    add_distributed_args,
    add_model_args,
    add_reasoning_args,
    add_sampling_args,
    add_speculative_args,
)
from pocket_mlx.errors import PocketError
from pocket_mlx.units import GB, size


def sampling_from_args(args):
    from pocket_mlx.engine.generation import SamplingParams

    s = SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                       min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                       seed=args.seed)
    s.validate()
    return s


def load_for(args, shard=None):
    """(device, model, tokenizer) as `generate` runs them: the device's dtype policy, fused
    projections (`shard`: this rank's share of a distributed run, see engine/distributed/).
    tests/test_user_path.py compares its decode graph with bench's."""
    from pocket_mlx.engine.devices import resolve_device
    from pocket_mlx.engine.loader import load

    kv = argtypes.cache_type(args)
    device = resolve_device(args.device)
    model, tokenizer = load(args.model, device=device, fuse=True, shard=shard)
    model.set_cache_type(kv)
    return device, model, tokenizer


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a reply to one prompt and print it as it streams.")
    add_model_args(p)
    add_cache_type_args(p)
    p.add_argument("--prompt", "-p", required=True, type=argtypes.utf8_text,
                   help="the prompt (UTF-8), or - to read it from stdin (required)")
    p.add_argument("--system", default=None, type=argtypes.utf8_text,
                   help="system prompt (default: none, or whatever the chat template adds)")
    p.add_argument("--raw", action="store_true",
                   help="no chat template: continue the prompt's text as is; cannot be combined "
                        "with --system (put the system text in the prompt instead)")
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=[], type=argtypes.stop_string,
                   metavar="TEXT", help="stop when the reply contains TEXT, which is left out; "
                                        "repeatable (default: stop only at the end-of-text token "
                                        "or --max-tokens)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead (with the reasoning beside the text)")
    add_reasoning_args(p, "The reasoning goes to stderr, the answer to stdout.", "")
    add_speculative_args(p)
    add_distributed_args(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    if args.raw and args.system is not None:
        raise PocketError("--raw has no chat template to put --system in; drop --system, or "
                          "drop --raw, or write the system text into the prompt")
    if args.raw and (args.reasoning != "auto" or args.reasoning_budget is not None):
        raise PocketError("--raw renders no chat template, so no reasoning block is opened or "
                          "parsed: drop --reasoning / --reasoning-budget, or drop --raw")
    if args.distributed and (args.reasoning != "auto" or args.reasoning_budget is not None):
        raise PocketError("--reasoning and --reasoning-budget do not run with --distributed "
                          "yet: drop them or --distributed")
    if args.distributed:
        if args.speculative not in ("auto", "off"):
            raise PocketError(f"--speculative {args.speculative} does not run with "
                              "--distributed (it decodes plainly): drop one of them")
        return run_distributed(args)
    prompt = read_prompt(args)
    sampling = sampling_from_args(args)
    from pocket_mlx.engine.generation import stream_generate

    device, model, tokenizer = load_for(args)
    text, reasoning, stats = [], Reasoning(not args.json), None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                             sampling=sampling, stop=args.stop, device=device,
                             system=args.system, raw=args.raw, speculative=args.speculative,
                             num_draft_tokens=args.num_draft_tokens,
                             thinking=None if args.raw else "auto",
                             reasoning_budget=args.reasoning_budget,
                             template_kwargs=template_kwargs(args, tokenizer)):
        stats = r.stats
        reasoning.add(r.reasoning)
        if r.text:
            reasoning.end()
            text.append(r.text)
            if not args.json:
                sys.stdout.write(r.text)
                sys.stdout.flush()
    reasoning.end()
    report(args, "".join(text), stats, reasoning=reasoning.text)
    return 0


def template_kwargs(args, tokenizer) -> dict:
    """`--reasoning on|off` as the chat template's `enable_thinking` (a note on stderr when
    the template has no such switch: the flag then changes nothing)."""
    from pocket_mlx.engine.reasoning import parse_reasoning_mode, thinking_kwargs

    enabled = parse_reasoning_mode(args.reasoning)
    kwargs = thinking_kwargs(tokenizer.chat_template, enabled)
    if enabled is not None and not kwargs and not args.raw:
        print(f"pocket-mlx generate: note: this model's chat template has no thinking switch "
              f"(enable_thinking); --reasoning {args.reasoning} changes nothing", file=sys.stderr)
    return kwargs


class Reasoning:
    """The reply's reasoning: kept for --json, else streamed to stderr (stdout stays the
    answer, for scripts), ended by a newline before the answer starts."""

    def __init__(self, show: bool) -> None:
        self.show, self.parts, self.open = show, [], False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, piece: str) -> None:
        if not piece:
            return
        self.parts.append(piece)
        if self.show:
            sys.stderr.write(piece)
            sys.stderr.flush()
            self.open = True

    def end(self) -> None:
        if self.open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.open = False


def run_distributed(args) -> int:
    """`generate --distributed MODE` on one rank of an mlx.launch group: rank 0 reads the
    prompt and prints; every rank loads its share, then all decode the same tokens."""
    import os

    from pocket_mlx.engine import distributed
    from pocket_mlx.engine.generation import prompt_tokens, stream_generate

    g = distributed.init(args.distributed, args.distributed_timeout)
    if g.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 does all output
    prompt = read_prompt(args) if g.rank == 0 else None
    sampling = sampling_from_args(args)
    try:
        load_s = max(distributed.LOAD_TIMEOUT_S, g.timeout)
        g.watchdog.arm(load_s, "the other ranks did not finish loading in time")
        device, model, tokenizer = load_for(args, shard=distributed.shard_for(g))
        g.barrier(load_s, "the other ranks did not finish loading in time")
        ids = g.broadcast_ints(prompt_tokens(tokenizer, prompt, system=args.system, raw=args.raw)
                               if g.rank == 0 else None)
        distributed.attach(model, g)
        text, stats = [], None

        def beat(*_) -> None:
            g.watchdog.arm(g.timeout, f"no answer from the other ranks for {g.timeout:g} s "
                                      "(--distributed-timeout)")

        beat()
        for r in stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens,
                                 sampling=sampling, stop=args.stop, device=device,
                                 progress=beat):
            beat()
            stats = r.stats
            if r.text:
                text.append(r.text)
                if not args.json:
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
        ranks = distributed.rank_report(model, g)
        g.watchdog.disarm()
    except RuntimeError as e:  # MLX's ring: a peer closed its connection
        raise distributed.lost(g.rank, e) from None
    if g.rank == 0:
        report(args, "".join(text), stats, ranks)
    sys.stdout.flush()
    return 0


def read_prompt(args) -> str:
    if args.prompt == "-":
        try:
            prompt = argtypes.decode_utf8(sys.stdin.buffer.read(), "the prompt on stdin (--prompt -)")
        except ValueError as e:
            raise PocketError(str(e)) from None
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise PocketError("the prompt is empty; pass some text with --prompt")
    return prompt


def report(args, text: str, stats, ranks: dict | None = None, reasoning: str = "") -> None:
    """The JSON object, or the newline after the streamed reply and the stats line."""
    if args.json:
        out = {
            "text": text,
            "reasoning": reasoning,
            "reasoning_tokens": stats.reasoning_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "prompt_tps": round(stats.prompt_tps, 3),
            "generation_tps": round(stats.generation_tps, 3),
            "ttft_s": round(stats.ttft_s, 4),
            "peak_memory_gb": round(stats.peak_memory_gb, 4),
            "bytes_per_token": stats.bytes_per_token,
            "device": stats.device,
            "finish_reason": stats.finish_reason,
        }
        if stats.speculative is not None:
            out["speculative"] = {k: stats.speculative[k] for k in
                                  ("method", "num_draft_tokens", "drafted", "accepted")}
        if ranks is not None:
            out["distributed"] = ranks
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()  # the reply's last line before the stats line on stderr
        print(f"prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s | "
              f"generation: {stats.generation_tokens} tokens, {stats.generation_tps:.1f} tok/s | "
              + (f"reasoning: {stats.reasoning_tokens} tokens | " if stats.reasoning_tokens
                 else "")
              + f"ttft {stats.ttft_s:.3f} s | peak memory {size(stats.peak_memory_gb * GB)} | "
              + (f"{spec['method']}: {spec['accepted']}/{spec['drafted']} drafts accepted | "
                 if (spec := stats.speculative) else "")
              + f"{stats.device} | {stats.finish_reason}"
              + (f" | {ranks['mode']} x{ranks['ranks']}" if ranks else ""), file=sys.stderr)
