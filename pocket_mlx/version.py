"""The package's version, in a module of its own: the bottom of the import order, so that convert
can stamp its outputs with it without importing the package's API (`pocket_mlx/__init__.py`)."""

__version__ = "0.1.0"
