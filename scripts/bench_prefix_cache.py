#!/usr/bin/env python
"""Issue 30's measurement: a shared system prompt reused across conversations. This is
`pocket-mlx bench prefix-cache` (pocket_mlx/analysis/prefix_cache_bench.py), run from here with
the flags it always had.

Through real HTTP against a `python -m pocket_mlx serve` child (fresh data and cache folders):
one unmeasured warm-up request, then two new conversations with the same long system prompt
and different user messages, on /v1/chat/completions, then the same on /v1/messages with
another system prompt (so its first request is cold too). Each timed request asks for one
token, not streamed: its wall time is the time to first token (prefill + one step + HTTP).
Reports each request's prompt and reused tokens, TTFT cold vs warm and the ratio.

With `--identity N`: a third new conversation behind the same system prompt, N greedy tokens on
the warm server (it starts from the system prompt's snapshot), then the same request on a fresh
server with the prompt cache off: the two replies must be identical (issue 30: reuse never
changes output).

With `--session-identity N`: the same check in process, through the chat's `ChatSession` (the
same snapshot points and store), comparing token ids rather than text (a random-weight model's
tokens past the bundled tokenizer's vocabulary decode to nothing, so equal text proves little
there): one session with the store serves a first conversation, then a new one behind the same
system prompt (it starts from the boundary snapshot); a session without the store serves the new
one cold.

Then, in process, the cost of one snapshot against the prefill it saves (the basis of
SNAPSHOT_INTERVAL): prefill `--interval` tokens, then time `PromptCache.store` of that cache.

    python scripts/bench_prefix_cache.py [--model MODEL] [--rules 45] [--interval 1024]
        [--identity N] [--session-identity N] [--no-cost]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocket_mlx.cli.main import main as cli  # noqa: E402 - after the path above

if __name__ == "__main__":
    sys.exit(cli(["bench", "prefix-cache", *sys.argv[1:]]))
