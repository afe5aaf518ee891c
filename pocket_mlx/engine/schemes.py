"""Model references by scheme (`synthetic:NAME`): resolved by whoever registered the scheme.

Why a registry: building a synthetic checkpoint is convert/'s work, a layer above the loader
that resolves `--model`. The package (`pocket_mlx/__init__.py`, which runs before any of its
modules) registers `synthetic:` here, so the loader reads references without importing convert.
Standard library only: registering costs the package's import nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

_SCHEMES: dict[str, Callable[[str], Path]] = {}


def register(prefix: str, resolve: Callable[[str], Path]) -> None:
    """Resolve references that start with `prefix` (e.g. "synthetic:") with `resolve(ref)`."""
    _SCHEMES[prefix] = resolve


def resolve(ref: str) -> Path | None:
    """The folder a registered scheme gives for `ref`, or None when no scheme claims it."""
    for prefix, fn in _SCHEMES.items():
        if ref.startswith(prefix):
            return fn(ref)
    return None
