"""The valid range of every sampling and reply setting, checked in one place.

The CLI's argparse types (cli/args.py), `SamplingParams.validate` (the Python API), the chat's
`Settings` and the settings saved with a conversation all call these, so a value is refused with
the same sentence wherever it comes from. Each `check_*` returns the value (as float/int) or
raises `ValueError` with the sentence to show. No MLX import: the CLI checks before loading.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pocket_mlx.errors import PocketError

# mx.random.seed takes an unsigned 64-bit integer (checked: 2**64 - 1 works, -1 and 2**64 fail).
SEED_MAX = 2**64 - 1

DEFAULT_MAX_TOKENS = 256
# The prompt cache of chat and serve: replies' caches in RAM (pocket-35b at 2k tokens: ~150 MB each), written
# through to the data folder, where the oldest are evicted past the disk budget.
PROMPT_CACHE_MB = 512
PROMPT_CACHE_DISK_BYTES = 4 << 30
# Tokens of history the repetition penalty looks back over: mlx-lm's default
# (`make_logits_processors(repetition_context_size=20)`), so equal settings penalise alike.
DEFAULT_REPETITION_CONTEXT = 20
DEFAULT_PREFILL_STEP = 512
# `serve`: requests decoded together (continuous batching), one forward per step for all.
SERVE_MAX_CONCURRENCY = 4


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_temperature(v) -> float:
    if not _is_number(v) or not math.isfinite(v) or v < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {v!r}")
    return float(v)


def check_top_p(v) -> float:
    if not _is_number(v) or not 0 < v <= 1:  # False for nan
        raise ValueError(f"top-p must be a number in (0, 1] (1 = off), got {v!r}")
    return float(v)


def check_top_k(v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"top-k must be an integer >= 0 (0 = off), got {v!r}")
    return v


def check_min_p(v) -> float:
    if not _is_number(v) or not 0 <= v <= 1:
        raise ValueError(f"min-p must be a number in [0, 1] (0 = off), got {v!r}")
    return float(v)


def check_repetition_penalty(v) -> float:
    if not _is_number(v) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"repetition penalty must be a finite number > 0 (1 = off), got {v!r}")
    return float(v)


def check_max_tokens(v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"max tokens must be an integer >= 1, got {v!r}")
    return v


def check_repetition_context(v) -> int:
    # 0 would be worse than useless: tokens[-0:] is the whole history, every token penalised.
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"repetition context must be an integer >= 1 (tokens looked back "
                         f"over), got {v!r}")
    return v


def check_prefill_step(v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"prefill step must be an integer >= 1 (prompt tokens per chunk), "
                         f"got {v!r}")
    return v


def check_seed(v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= SEED_MAX:
        raise ValueError(f"seed must be an integer from 0 to {SEED_MAX} (2**64 - 1), got {v!r}")
    return v


def valid(check: Callable, value) -> bool:
    """Whether `check` accepts `value` (for data read back from a file)."""
    try:
        check(value)
    except ValueError:
        return False
    return True


def checked(check: Callable, value):
    """`check(value)` with a bad value raised as a PocketError (one line, exit 2)."""
    try:
        return check(value)
    except ValueError as e:
        raise PocketError(str(e)) from None
