"""Options shared by the commands that run a model, and the argparse type functions that refuse
bad values before anything loads: argparse then reports them on one line with exit code 2 (see
`cli/main.py`). The ranges themselves are engine/params.py's `check_*` functions, the same ones
the Python API, the chat settings and saved conversations use."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pocket_mlx.engine.params import (
    DEFAULT_MAX_TOKENS,
    SEED_MAX,
    check_max_tokens,
    check_min_p,
    check_repetition_penalty,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_p,
)
from pocket_mlx.errors import PocketError


def check_utf8(v: str) -> str:
    """Text from argv arrives with undecodable bytes as lone surrogates (surrogateescape)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = v.encode("utf-8", "surrogateescape")  # the bytes argv held
        except UnicodeEncodeError:
            raw = v.encode("utf-8", "surrogatepass")  # a surrogate from elsewhere
        try:
            raw.decode("utf-8")
            where = ""
        except UnicodeDecodeError as e:
            where = f" (byte 0x{raw[e.start]:02x} at offset {e.start})"
        raise ValueError(f"text is not valid UTF-8{where}; pass UTF-8 text "
                         "(convert it with e.g. iconv -t UTF-8)") from None
    return v


def check_stop(v: str) -> str:
    if v == "":
        raise ValueError("an empty stop string would match everywhere; pass a non-empty string")
    return check_utf8(v)


def decode_utf8(data: bytes, what: str) -> str:
    """`data` as text, or a ValueError saying where it is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); pass UTF-8 text (convert it with e.g. iconv -t UTF-8)"
                         ) from None


def _arg_type(parse: Callable[[str], object], check: Callable, what: str):
    """An argparse `type=` that parses with `parse`, then applies `check`."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = check.__name__.removeprefix("check_")
    return convert


def _same(text: str) -> str:
    return text


temperature = _arg_type(float, check_temperature, "a number")
top_p = _arg_type(float, check_top_p, "a number")
top_k = _arg_type(int, check_top_k, "an integer")
min_p = _arg_type(float, check_min_p, "a number")
repetition_penalty = _arg_type(float, check_repetition_penalty, "a number")
max_tokens = _arg_type(int, check_max_tokens, "an integer")
seed = _arg_type(int, check_seed, "an integer")


def int_range(low: int, high: int | None, what: str):
    """An argparse `type=` for an integer from `low` to `high` (None: no upper bound); `what`
    names the range in the error ("a TCP port from 1 to 65535")."""

    def check(v: int) -> int:
        if v < low or (high is not None and v > high):
            raise ValueError(f"must be {what}, got {v}")
        return v

    return _arg_type(int, check, "an integer")


def check_positive_seconds(v: float) -> float:
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(f"must be a number of seconds > 0, got {v}")
    return v


positive_seconds = _arg_type(float, check_positive_seconds, "a number of seconds")
megabytes = int_range(0, None, "a size in MiB, 0 or more (0 = off)")
utf8_text = _arg_type(_same, check_utf8, "text")
stop_string = _arg_type(_same, check_stop, "text")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model and --device, the same for every command that runs a model."""
    p.add_argument("--model", "-m", default=None,
                   help="model folder, Hugging Face repo id (user/repo[@revision]) or "
                        "synthetic:NAME[:RECIPE] (default: the bundled pocket-tiny)")
    p.add_argument("--device", choices=["gpu", "cpu"], default=None,
                   help="where to run (default: the GPU when MLX has one, else the CPU)")


CACHE_TYPE_NAMES = ("f32", "f16", "bf16")  # models/cache.CACHE_TYPES (not imported: no MLX here)


def add_cache_type_args(p: argparse.ArgumentParser) -> None:
    """--cache-type-k / --cache-type-v, llama.cpp's names for the KV cache's storage type."""
    for which in ("k", "v"):
        p.add_argument(f"--cache-type-{which}", choices=CACHE_TYPE_NAMES, default="f32",
                       help=f"the attention cache's {'keys' if which == 'k' else 'values'} in "
                            "float32 (default: exact), or f16 / bf16 (half the bytes a decode "
                            "step reads at depth; rounds them; set k and v alike)")


def cache_type(args) -> str:
    """The KV cache type of --cache-type-k/-v (checked before a load: one type for both here);
    the command hands it to `model.set_cache_type` once the model is loaded."""
    k, v = getattr(args, "cache_type_k", "f32"), getattr(args, "cache_type_v", "f32")
    if k != v:
        raise PocketError(f"--cache-type-k {k} with --cache-type-v {v}: keys and values take "
                          "the same type here; give both the same")
    return k


def add_serve_sampling_args(p: argparse.ArgumentParser) -> None:
    """serve's defaults for what a request leaves out (llama.cpp's server names): None
    keeps the API's own default (temperature 1, the rest off)."""
    g = p.add_argument_group("sampling defaults (a request's own value wins)")
    g.add_argument("--temp", type=temperature, default=None, metavar="T",
                   help="temperature; 0 = greedy (default: 1)")
    g.add_argument("--top-p", type=top_p, default=None, metavar="P", help="(default: 1, off)")
    g.add_argument("--top-k", type=top_k, default=None, metavar="K", help="(default: 0, off)")
    g.add_argument("--min-p", type=min_p, default=None, metavar="P", help="(default: 0, off)")
    g.add_argument("--repeat-penalty", "--repetition-penalty", dest="repetition_penalty",
                   type=repetition_penalty, default=None, metavar="R", help="(default: 1, off)")
    g.add_argument("--seed", type=seed, default=None, metavar="S",
                   help="(default: a fresh random seed per request)")


# `Sampling` field -> (its serve option's attribute, the option), read by `serve_sampling`
# and by serve's launchd command line.
SERVE_SAMPLING = {"temperature": ("temp", "--temp"), "top_p": ("top_p", "--top-p"),
                  "top_k": ("top_k", "--top-k"), "min_p": ("min_p", "--min-p"),
                  "repetition_penalty": ("repetition_penalty", "--repeat-penalty"),
                  "seed": ("seed", "--seed")}


def serve_sampling(args: argparse.Namespace) -> dict:
    """The sampling defaults serve was given, as `Sampling` fields."""
    return {k: getattr(args, attr) for k, (attr, _) in SERVE_SAMPLING.items()
            if getattr(args, attr) is not None}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """generate's sampling options; defaults match `SamplingParams`."""
    p.add_argument("--max-tokens", "-n", type=max_tokens, default=DEFAULT_MAX_TOKENS,
                   metavar="N", help="longest reply in tokens")
    p.add_argument("--temp", type=temperature, default=0.0, metavar="T",
                   help="temperature; 0 = greedy")
    p.add_argument("--top-p", type=top_p, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to this probability "
                        "mass; 1 = off")
    p.add_argument("--top-k", type=top_k, default=0, metavar="K",
                   help="keep only the K most likely tokens; 0 = off")
    p.add_argument("--min-p", type=min_p, default=0.0, metavar="P",
                   help="drop tokens less likely than P x the most likely one; 0 = off")
    p.add_argument("--repetition-penalty", type=repetition_penalty, default=1.0, metavar="R",
                   help="divide the logits of recently generated tokens by R; 1 = off")
    p.add_argument("--seed", type=seed, default=None, metavar="S",
                   help=f"random seed, 0 to {SEED_MAX} (default: a fresh random seed each run)")


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """--distributed and its timeout, for the commands that can run under mlx.launch."""
    p.add_argument("--distributed", choices=["pipeline", "experts"], default=None,
                   help="run across the ranks mlx.launch started (docs/DISTRIBUTED.md): "
                        "pipeline = layers split (memory per rank ~1/N), experts = every "
                        "layer's experts split (bytes per token per rank fall); rank 0 does "
                        "all I/O (default: one process)")
    p.add_argument("--distributed-timeout", type=positive_seconds, default=120.0,
                   metavar="S", help="with --distributed: give up with an error when the other "
                                     "ranks do not connect, or stop answering, for S seconds")


def num_draft_tokens(text: str) -> int:
    from pocket_mlx.engine.drafters import MAX_NUM_DRAFT_TOKENS

    try:
        k = int(text)
    except ValueError:
        k = 0
    if not 1 <= k <= MAX_NUM_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be an integer 1..{MAX_NUM_DRAFT_TOKENS}, "
                                         f"got {text!r}")
    return k


def add_reasoning_args(p: argparse.ArgumentParser, switch: str, budget: str) -> None:
    """--reasoning on|off|auto and --reasoning-budget N (engine/reasoning.py) for `generate`
    and `serve`; `switch` and `budget` end their help (where the output goes, what wins)."""
    p.add_argument("--reasoning", choices=["on", "off", "auto"], default="auto",
                   help="thinking models: on or off is passed to the chat template "
                        f"(enable_thinking) when it has the switch; auto keeps the template's "
                        f"default. {switch} (default: auto)")
    p.add_argument("--reasoning-budget", type=int_range(0, None, "0 or more tokens"),
                   default=None, metavar="N",
                   help="close the reasoning block after N tokens of it (the model then "
                        f"answers).{' ' + budget if budget else ''} (default: no limit)")


def add_speculative_args(p: argparse.ArgumentParser, default: str = "auto",
                         where: str = "") -> None:
    """--speculative and --num-draft-tokens (engine/speculative.py, docs/SPECULATIVE.md);
    `where` says when it applies (serve: greedy requests decoding alone)."""
    from pocket_mlx.engine.drafters import DEFAULT_NUM_DRAFT_TOKENS, METHODS

    p.add_argument("--speculative", choices=list(METHODS), default=default,
                   help="speculative decoding: lookup = n-gram drafts from the prompt and reply, "
                        "mtp = the model's multi-token-prediction head, auto = lookup where the "
                        "context matches, else the head when the model has one, each backing "
                        "off while its drafts fail; greedy "
                        "output is the same as off, token for token"
                        + (f"; applies to {where}" if where else "")
                        + f" (default: {default})")
    p.add_argument("--num-draft-tokens", type=num_draft_tokens, default=DEFAULT_NUM_DRAFT_TOKENS,
                   metavar="K", help="tokens drafted per verify pass")
