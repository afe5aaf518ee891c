"""User-facing errors, and the one way a message is put on one line.

Anything a user can cause (bad path, bad flag, broken checkpoint) raises `PocketError`; the CLI
prints its message on one line and exits with code 2 instead of showing a traceback.
"""


def one_line(message: object) -> str:
    """`message` on one line, its lines joined by "; ": an error goes to stderr, and a log
    line (a client's text, an exception) into the server's log, as exactly one line."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


class PocketError(Exception):
    """An error caused by user input, reported as one line by the CLI."""

    exit_code = 2
