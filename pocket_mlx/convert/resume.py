"""`convert --resume`: what a conversion has finished, kept in its temporary folder.

Why: a 35B conversion runs for hours; a crash, a kill -9 or a power cut should cost the step
in flight, not the night. The temporary folder beside OUT (writer.atomic_dir) already survives
such a death; this journal in it records the steps done: each search measurement (the KL of a
group at a width, each candidate build's KL) and, while writing, the shard writer's state after
each finished layer. A run with --resume takes over the folder of a dead run with the same
inputs and options (the fingerprint), redoes only the calibration pass (deterministic) and skips
what the journal holds, so its output equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

JOURNAL = "resume.json"
# Test hook: "STEP:N" kills this process with SIGKILL right after the N-th journal entry of
# STEP ("measure", "search" or "write") is on disk: a deterministic kill -9 for the tests.
DIE_ENV = "POCKET_MLX_TEST_DIE_AFTER"


def fingerprint(src: Path, opts: Any, version: str) -> dict:
    """What must match for a run to continue another: the source, the options that change the
    output, the calibration files (path, size, modification time) and pocket-mlx's `version`."""
    calib = []
    for f in opts.calib:
        try:
            st = Path(f).stat()
            calib.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
        except OSError:
            calib.append([str(f), None, None])
    recipe = opts.recipe.describe() if opts.recipe is not None else None
    return {"version": version, "src": str(Path(src).resolve()), "recipe": recipe,
            "auto_bpw": opts.auto_bpw, "target_size": opts.target_size,
            "measure_tokens": opts.measure_tokens, "rounding": opts.rounding,
            "prune_to": opts.prune_to, "calib": calib, "criterion": opts.criterion,
            "seed": opts.seed, "dtype": opts.dtype, "shard_bytes": opts.shard_bytes,
            "calib_tokens": opts.calib_tokens, "window": opts.window}


class Journal:
    """A JSON document in the temporary folder, rewritten whole (write, fsync, rename) after
    each step, so a death at any point leaves the previous or the next state, never half."""

    def __init__(self, folder: Path, fp: dict):
        self.path = Path(folder) / JOURNAL
        self.data: dict = {"fingerprint": fp}
        self.counts: dict[str, int] = {}

    @staticmethod
    def read(folder: Path) -> dict | None:
        try:
            data = json.loads((Path(folder) / JOURNAL).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def section(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def save(self, step: str | None = None) -> None:
        tmp = self.path.with_name(JOURNAL + ".new")
        with open(tmp, "w") as f:
            json.dump(self.data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if step is not None:
            self.counts[step] = self.counts.get(step, 0) + 1
            _maybe_die(step, self.counts[step])


def _maybe_die(step: str, n: int) -> None:
    want = os.environ.get(DIE_ENV, "")
    if want and want == f"{step}:{n}":
        os.kill(os.getpid(), signal.SIGKILL)
