"""pocket-mlx: sparse Mixture-of-Experts language models (the POCKET family) on MLX."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "generate", "stream_generate", "generate_step", "__version__"]


def __getattr__(name: str):
    # Lazy so that `pocket-mlx wired` and friends start without importing the model stack.
    if name == "load":
        from pocket_mlx.engine.loader import load

        return load
    if name in ("generate", "stream_generate", "generate_step"):
        from pocket_mlx.engine import generation as _gen

        return getattr(_gen, name)
    raise AttributeError(name)
