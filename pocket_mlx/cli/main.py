"""`pocket-mlx` command line: one console script, one module per subcommand.

Each subcommand lives in `pocket_mlx/cli/<name>.py` and exposes
`register(subparsers) -> argparse.ArgumentParser` whose parser has `func=run(args) -> int`.
Errors a user can cause are `PocketError`s: printed as one line, exit code 2, no traceback.

Every start builds every subcommand's parser, so the command modules import their machinery
inside `run()`: MLX, Textual, the model stack and the converter at module level would cost each
command, `wired` and `--help` included, ~0.37 s more (measured: importing them all takes
~365 ms, building the whole parser ~40 ms).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pocket_mlx.cli.logs import setup_logging
from pocket_mlx.errors import PocketError, one_line

COMMANDS = ["chat", "generate", "serve", "launch", "info", "wired", "convert", "shard",
            "eval_ppl", "bench"]


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help names its default: "(default: X)" is appended unless the help already
    says it in words (for defaults such as None that need explaining)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help
        if (not help_text or "default" in help_text or not action.option_strings
                or action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [], ())):
            return help_text
        return f"{help_text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors on one line with exit code 2, and names defaults in
    --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pocket-mlx", description=__doc__.splitlines()[0])
    from pocket_mlx import __version__

    parser.add_argument("--version", action="version", version=f"pocket-mlx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"pocket_mlx.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(args.command)
    try:
        return int(args.func(args) or 0)
    except PocketError as e:
        print(f"pocket-mlx {args.command}: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"pocket-mlx {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
