"""`pocket-mlx launch claude|codex|opencode [--model M] [-- ARGS]`: a coding agent on the local
model.

As `ollama launch`: the agent runs against `pocket-mlx serve` on this machine with the settings
it needs, passed on its command line and in its environment only (the user's own config files
are not touched): the server's URL, the served model's name, its real context window (so the
agent compacts its conversation before the window is full) and telemetry off. A server already
answering on --port is used; otherwise one is started for --model (the bundled model by
default) and stopped when the agent exits. The agent's exit status is launch's. Each agent's
settings, and what it sends, are in docs/AGENTS.md.
"""

from __future__ import annotations

import argparse

DEFAULT_PORT = 8080  # serve's default
AGENTS = ("claude", "codex", "opencode")


def _options(p: argparse.ArgumentParser, defaults: bool) -> None:
    """launch's options: before the agent (argparse) or after it (`rest`, parsed in `run`)."""
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    p.add_argument("--model", "-m", default=d(None),
                   help="model to serve when no server answers on --port (default: the bundled "
                        "model, its window raised to 65536 tokens for an agent's prompt)")
    p.add_argument("--port", type=int, default=d(DEFAULT_PORT),
                   help="the local server's port: used if one answers there, else started there")
    p.add_argument("--api-key", default=d(None), metavar="KEY",
                   help="the server's --api-key, if it has one (default: none)")


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="run a coding agent (Claude Code, Codex, opencode) on the "
                                      "local model",
                       description=__doc__.splitlines()[0])
    _options(p, defaults=True)
    p.add_argument("agent", choices=AGENTS, help="the agent to run")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="launch's options, then -- and the agent's arguments (e.g. -- -p \"hi\")")
    p.set_defaults(func=run)
    return p


class _Options(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse API
        from pocket_mlx.errors import PocketError

        raise PocketError(f"{message} (the agent's own arguments go after --)")


def run(args) -> int:
    from pocket_mlx.cli.agents import LocalServer, agent_command, find_agent
    from pocket_mlx.errors import PocketError

    rest = list(args.rest)
    cut = rest.index("--") if "--" in rest else len(rest)
    opts = _Options(prog="pocket-mlx launch", add_help=False)
    _options(opts, defaults=False)
    opts.parse_args(rest[:cut], namespace=args)
    extra = rest[cut + 1:]
    if not 0 < args.port < 65536:
        raise PocketError(f"--port {args.port}: must be 1-65535")
    binary = find_agent(args.agent)
    with LocalServer(args.port, args.model, args.api_key) as server:
        argv, env = agent_command(args.agent, binary, server.info(), extra)
        return server.run_agent(argv, env)
