"""Where pocket-mlx's files live: the bundled assets, the cache, the user data folder.

Why one module: these places were computed in the loader, the synthetic builder and the saved
conversations alike (`parents[2] / "assets"` twice); here they are named once, each with the
environment variable that moves it, at the bottom of the import order so any layer may ask.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _assets() -> Path:
    """The bundled assets: pocket_mlx/assets/ in an installed wheel (pyproject maps the
    checkout's assets/ there), else the checkout's assets/ (a source tree, an editable install)."""
    here = Path(__file__).resolve().parent
    installed = here / "assets"
    return installed if installed.is_dir() else here.parent / "assets"


ASSETS = _assets()
BUNDLED_MODEL = ASSETS / "pocket-tiny"  # the model every command uses without --model
MODEL_ENV = "POCKET_MLX_MODEL"  # another default model
CACHE_ENV = "POCKET_MLX_CACHE"  # built synthetic checkpoints (rebuildable)
HOME_ENV = "POCKET_MLX_HOME"  # conversations, the prompt cache on disk (the user's)


def default_model_path() -> Path:
    """The bundled model (assets/pocket-tiny), or $POCKET_MLX_MODEL when set."""
    env = os.environ.get(MODEL_ENV)
    return Path(env) if env else BUNDLED_MODEL


def cache_dir() -> Path:
    """Files pocket-mlx can build again: $POCKET_MLX_CACHE, else ~/.cache/pocket-mlx."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pocket-mlx"


def data_dir() -> Path:
    """pocket-mlx's user data folder: $POCKET_MLX_HOME, else the platform's usual place."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "pocket-mlx"
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "pocket-mlx"
