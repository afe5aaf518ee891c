"""User-facing errors.

Anything a user can cause (bad path, bad flag, broken checkpoint) raises `PocketError`; the CLI
prints its message on one line and exits with code 2 instead of showing a traceback.
"""


class PocketError(Exception):
    """An error caused by user input, reported as one line by the CLI."""

    exit_code = 2
