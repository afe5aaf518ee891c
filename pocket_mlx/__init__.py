"""pocket-mlx: sparse Mixture-of-Experts language models (the POCKET family) on MLX."""

from __future__ import annotations

import os

# Before numpy loads its OpenBLAS: one thread; convert/blas.py splits its GEMMs itself (a
# static two-thread split stalled 4-7x whenever another process held a core).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pocket_mlx.engine import schemes
from pocket_mlx.version import __version__

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


def _synthetic(ref: str):
    # Lazy: the synthetic writer (numpy, the recipes) is only needed for synthetic:NAME.
    from pocket_mlx.convert import synthetic

    return synthetic.resolve(ref)


# Registered here, above both: the loader (engine/) resolves `synthetic:` references without
# importing convert/, which imports the loader (see engine/schemes.py).
schemes.register("synthetic:", _synthetic)
