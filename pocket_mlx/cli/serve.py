"""`pocket-mlx serve`: an OpenAI-compatible HTTP server for one model (server/app.py).

Binds 127.0.0.1 by default; any other address needs --api-key, since the endpoints run code
on this machine's CPU/GPU for whoever can reach them. `--print-launchd` prints a LaunchAgent
that starts the same command at login and restarts it if it stops.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from pocket_mlx.cli import args as argtypes
from pocket_mlx.cli.args import (
    SERVE_SAMPLING,
    add_cache_type_args,
    add_distributed_args,
    add_model_args,
    add_reasoning_args,
    add_serve_sampling_args,
    add_speculative_args,
    cache_type,
    serve_sampling,
)
from pocket_mlx.engine.params import (
    DEFAULT_PREFILL_STEP,
    PROMPT_CACHE_MB,
    SERVE_MAX_CONCURRENCY,
)
from pocket_mlx.engine.reasoning import parse_reasoning_mode
from pocket_mlx.errors import PocketError, one_line

log = logging.getLogger(__name__)

LAUNCHD_LABEL = "com.pocket-mlx.serve"


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve one model over HTTP: GET /health, GET /v1/models, "
                    "POST /v1/chat/completions and POST /v1/completions (streaming or not), "
                    "as OpenAI's API. Up to --max-concurrency requests generate at once, decoded together "
                    "(one forward per token for all of them); others wait in a queue.")
    add_model_args(p)
    add_cache_type_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback requires --api-key")
    p.add_argument("--port", type=_port, default=8080, help="TCP port")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $POCKET_MLX_API_KEY, else no key: loopback only)")
    p.add_argument("--max-concurrency", type=_positive, default=None,
                   metavar="N",
                   help="requests generating at once, decoded together in one batch per step "
                        "(continuous batching: they join and leave between steps); 1 runs them "
                        f"one at a time (default: {SERVE_MAX_CONCURRENCY}; 1 under --distributed)")
    p.add_argument("--max-queue", type=_non_negative, default=8, metavar="N",
                   help="requests waiting for a slot; beyond it: 429 with Retry-After")
    p.add_argument("--max-tokens", type=argtypes.max_tokens, default=None,
                   metavar="N", help="reply cap for requests that give no max_tokens (default: "
                                     "none: they run to the end of text, a stop or a full window)")
    p.add_argument("--ctx-size", "-c", type=_positive, default=None, metavar="N",
                   help="the context window served, in tokens (prompt and reply), at most the "
                        "model's own: a smaller one needs less RAM (default: the model's "
                        "window, capped by what the memory planner says fits in RAM beside "
                        "the weights, as `pocket-mlx info` shows)")
    p.add_argument("--prefill-step", type=_positive, default=DEFAULT_PREFILL_STEP, metavar="N",
                   help="prompt tokens per prefill chunk; other streams get a decode step "
                        "between chunks, so a long prompt delays them by one chunk at a time "
                        "(as llama.cpp's --ubatch-size; default: %(default)s)")
    p.add_argument("--alias", action="append", type=_alias, default=[], metavar="NAME",
                   help="another model name this server answers to (repeatable; as llama.cpp's "
                        "flag): requests and /v1/models accept it beside the model's own name "
                        "(default: none)")
    p.add_argument("--cors", default=None, metavar="ORIGIN",
                   help="allow browser pages from ORIGIN (e.g. http://localhost:3000, or *) to "
                        "call the API (default: no CORS headers)")
    p.add_argument("--max-body-mb", type=_positive, default=8, metavar="MB",
                   help="largest request body in MiB; larger ones get 413")
    p.add_argument("--prompt-cache-mb", type=argtypes.megabytes, default=PROMPT_CACHE_MB,
                   metavar="MIB",
                   help="prompt cache in RAM: a request whose prompt extends a cached one "
                        "(the same conversation, a longer turn) prefills only the rest; 0 = off "
                        f"(default: {PROMPT_CACHE_MB})")
    p.add_argument("--prompt-cache-dir", type=Path, default=None, metavar="DIR",
                   help="where colder cache entries go and are found again after a restart "
                        "(default: prompt-cache/ in the data folder, shared with the chat)")
    add_reasoning_args(p, "A request's own switch (reasoning_effort, chat_template_kwargs."
                          "enable_thinking, Anthropic's thinking, Ollama's think) wins.",
                       "A request's own budget wins.")
    add_serve_sampling_args(p)
    add_speculative_args(p, default="off", where="greedy requests, while one is decoding "
                         "alone (batched steps decode plainly)")
    add_distributed_args(p)
    p.add_argument("--print-launchd", action="store_true",
                   help="print a LaunchAgent plist that runs this server at login (never "
                        "installs it)")
    p.set_defaults(func=run)
    return p


_port = argtypes.int_range(1, 65535, "a TCP port from 1 to 65535")
_positive = argtypes.int_range(1, None, "1 or more")
_non_negative = argtypes.int_range(0, None, "0 or more")


def _alias(text: str) -> str:
    """A model name for --alias: printable, no spaces at its ends (a client sends it as is)."""
    if not text.strip() or text != text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError(f"must be a model name with no spaces at its ends and "
                                         f"no control characters, got {text!r}")
    return text


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_args(args: argparse.Namespace) -> None:
    """Refusals that need no model: one line, exit 2."""
    if not is_loopback(args.host) and not args.api_key:
        raise PocketError(f"--host {args.host} accepts connections from other machines: also "
                          "pass --api-key KEY (or set POCKET_MLX_API_KEY), or keep the default "
                          "--host 127.0.0.1")
    if args.api_key is not None and not args.api_key.strip():
        raise PocketError("--api-key is empty; pass a non-empty key")
    if args.max_concurrency is None:
        args.max_concurrency = 1 if getattr(args, "distributed", None) else SERVE_MAX_CONCURRENCY
    elif getattr(args, "distributed", None) and args.max_concurrency != 1:
        raise PocketError(f"--max-concurrency {args.max_concurrency}: under --distributed the "
                          "ranks generate one request at a time in lockstep; use 1")
    if getattr(args, "distributed", None) and (args.reasoning != "auto"
                                               or args.reasoning_budget is not None):
        raise PocketError("--reasoning and --reasoning-budget do not run with --distributed "
                          "(the ranks' lockstep loop does not parse reasoning); drop them")
    if getattr(args, "distributed", None) and getattr(args, "speculative", "off") != "off":
        raise PocketError(f"--speculative {args.speculative} does not run with --distributed: "
                          "drop one of them")
    if getattr(args, "distributed", None) and args.print_launchd:
        raise PocketError("--print-launchd and --distributed: start the ranks with mlx.launch "
                          "(docs/DISTRIBUTED.md), not with launchd")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise PocketError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    # IPv4 first: "localhost" often resolves to ::1 first, which 127.0.0.1 clients cannot reach.
    family, _, _, _, addr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise PocketError(f"cannot listen on {host}:{port}: {e.strerror}; pick another "
                          "--port (or stop what uses it)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def launchd_argv(args: argparse.Namespace) -> list[str]:
    """This server's command line for launchd: absolute paths, no --print-launchd."""
    argv = [sys.executable, "-m", "pocket_mlx", "serve"]
    if args.model:
        local = Path(args.model).expanduser()
        argv += ["--model", str(local.resolve()) if local.exists() else args.model]
    if args.device:
        argv += ["--device", args.device]
    argv += ["--host", args.host, "--port", str(args.port),
             "--max-concurrency", str(args.max_concurrency), "--max-queue", str(args.max_queue),
             "--max-body-mb", str(args.max_body_mb)]
    if args.max_tokens is not None:
        argv += ["--max-tokens", str(args.max_tokens)]
    if args.ctx_size is not None:
        argv += ["--ctx-size", str(args.ctx_size)]
    for name in args.alias:
        argv += ["--alias", name]
    if args.cors:
        argv += ["--cors", args.cors]
    for field, value in serve_sampling(args).items():
        argv += [SERVE_SAMPLING[field][1], str(value)]
    if cache_type(args) != "f32":
        argv += ["--cache-type-k", args.cache_type_k, "--cache-type-v", args.cache_type_v]
    argv += ["--prompt-cache-mb", str(args.prompt_cache_mb)]
    if args.prompt_cache_dir:
        argv += ["--prompt-cache-dir", str(Path(args.prompt_cache_dir).expanduser().resolve())]
    return argv


def print_launchd(args: argparse.Namespace) -> int:
    from pocket_mlx.system.wired import launchd_job_plist

    log = str(Path.home() / "Library" / "Logs" / "pocket-mlx-serve.log")
    keys: dict = {"RunAtLoad": True, "KeepAlive": True, "StandardOutPath": log,
                  "StandardErrorPath": log}
    if args.api_key:
        # In the environment, not in ProgramArguments: `ps` shows arguments to every user.
        keys["EnvironmentVariables"] = {"POCKET_MLX_API_KEY": args.api_key}
    plist = launchd_job_plist(LAUNCHD_LABEL, launchd_argv(args), **keys)
    print(plist.rstrip("\n"))
    path = f"~/Library/LaunchAgents/{LAUNCHD_LABEL}.plist"
    print(f"""To install (starts the server at login, restarts it if it stops):
  pocket-mlx serve ... --print-launchd > {LAUNCHD_LABEL}.plist
  cp {LAUNCHD_LABEL}.plist {path}{'  &&  chmod 600 ' + path if args.api_key else ''}
  launchctl bootstrap gui/$(id -u) {path}
Log: {log}
To remove:
  launchctl bootout gui/$(id -u)/{LAUNCHD_LABEL}
  rm {path}""", file=sys.stderr)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.api_key is None:
        args.api_key = os.environ.get("POCKET_MLX_API_KEY") or None
    check_args(args)
    kv = cache_type(args)
    if kv != "f32" and args.distributed:
        raise PocketError(f"--cache-type-k {kv} does not run with --distributed yet: drop one")
    if args.print_launchd:
        return print_launchd(args)
    # The server stack and MLX are imported here, not at the top: see cli/main.py (every
    # command's parser is built at each start).
    import uvicorn

    from pocket_mlx.server.app import create_app
    from pocket_mlx.server.worker import ServeWorker

    lockstep = None
    if args.distributed:
        from pocket_mlx.engine import distributed

        g = distributed.init(args.distributed, args.distributed_timeout)
        lockstep = distributed.Lockstep(g)
        if g.rank != 0:
            return follow(args, lockstep)
    sock = bind(args.host, args.port)
    engine = ServeWorker(args.model, args.device, max_concurrency=args.max_concurrency,
                    max_queue=args.max_queue, default_max_tokens=args.max_tokens,
                    prompt_cache_mb=args.prompt_cache_mb, prompt_cache_dir=args.prompt_cache_dir,
                    distributed=lockstep, ctx_size=args.ctx_size,
                    prefill_step=args.prefill_step, speculative=args.speculative,
                    num_draft_tokens=args.num_draft_tokens,
                    reasoning=parse_reasoning_mode(args.reasoning),
                    reasoning_budget=args.reasoning_budget,
                    sampling=serve_sampling(args))
    try:
        engine.start()
    except PocketError as e:
        # MLX may already have run on the engine thread (weights loaded before the tokenizer
        # failed): a normal exit would then abort in MLX's teardown, so end here, exit 2.
        sock.close()
        from pocket_mlx.engine.devices import exit_now

        log.error(f"error: {one_line(e)}")
        exit_now(e.exit_code)
    # Before the first request (the socket is bound, nothing is served yet): the caches made
    # from here on (each request's, the prompt cache's restores) store this type.
    engine.model.set_cache_type(kv)
    app = create_app(engine, api_key=args.api_key, cors=args.cors,
                     max_body=args.max_body_mb * 2**20, aliases=args.alias)
    host = f"[{args.host}]" if ":" in args.host else args.host
    ranks = f" x{lockstep.g.size} ranks ({args.distributed})" if lockstep else ""
    also = f" (also answers to {', '.join(args.alias)})" if args.alias else ""
    log.info(f"{engine.model_id}{also} on {engine.device}{ranks}, context {engine.context} tokens "
             f"({engine.context_source}); listening on http://{host}:{args.port}/v1 "
             f"({'API key required' if args.api_key else 'no API key'})")
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then restores the handlers it found and
    # re-raises the signal. Ctrl-C comes back as KeyboardInterrupt; SIGTERM (launchd, kill)
    # gets the same handling through the handler below, so both stop the engine, which writes
    # the prompt cache's RAM entries to disk for the next start.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
        sock.close()
    log.info("stopped")
    from pocket_mlx.engine.devices import exit_now

    exit_now(0)  # MLX ran on the engine thread: skip its teardown (see exit_now)


def follow(args: argparse.Namespace, lockstep) -> int:
    """A rank other than 0 under `serve --distributed` (or `chat --distributed`):
    load this rank's share, then generate in lockstep with rank 0 until it stops (rank 0
    alone serves HTTP, or runs the chat app, and logs)."""
    from pocket_mlx.engine.distributed import LOAD_TIMEOUT_S
    from pocket_mlx.engine.loader import load
    from pocket_mlx.engine.worker import ModelWorker

    g = lockstep.g
    g.watchdog.arm(max(LOAD_TIMEOUT_S, g.timeout), "the other ranks did not finish loading "
                                                    "in time")

    def setup(model, tokenizer) -> tuple:
        # Not the worker's `lockstep`: that one is rank 0's side (beats, stop).
        lockstep.ready(model)
        log.info(f"rank {g.rank} of {g.size} ({args.distributed}) follows rank 0")
        return model, tokenizer

    def serve(state: tuple) -> None:
        try:
            lockstep.follow(*state)
        except KeyboardInterrupt:  # Ctrl-C under mlx.launch reaches every rank: stop quietly
            pass

    # As the engine loads on rank 0 (server/worker.py), so every rank builds the same model.
    worker = ModelWorker(lambda: load(args.model, device=args.device, fuse=True,
                                      shard=lockstep.shard))
    if not worker.run(serve, setup):
        raise worker.error
    log.info(f"rank {g.rank} stopped")
    return 0
