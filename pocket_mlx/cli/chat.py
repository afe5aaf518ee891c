"""`pocket-mlx chat`: the terminal chat app (Textual), with saved conversations."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from pocket_mlx.cli import args as argtypes
from pocket_mlx.cli.args import add_distributed_args, add_model_args, add_speculative_args
from pocket_mlx.engine.params import PROMPT_CACHE_MB
from pocket_mlx.errors import PocketError

if TYPE_CHECKING:
    from pocket_mlx.tui.app import ChatApp


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="chat in the terminal",
                       description="Chat with a model in a terminal app: live throughput, "
                                   "device switching, saved conversations.")
    add_model_args(p)
    p.add_argument("--system", default=None, type=argtypes.utf8_text,
                   help="system prompt (default: none, or the resumed conversation's)")
    p.add_argument("--temp", type=argtypes.temperature, default=None, metavar="T",
                   help="temperature; 0 = greedy (default: 0, or the resumed conversation's)")
    p.add_argument("--top-p", type=argtypes.top_p, default=None, metavar="P",
                   help="nucleus sampling; 1 = off (default: 1, or the resumed conversation's)")
    p.add_argument("--max-tokens", "-n", type=argtypes.max_tokens, default=None, metavar="N",
                   help=f"longest reply in tokens (default: {argtypes.DEFAULT_MAX_TOKENS}, or "
                        "the resumed conversation's)")
    p.add_argument("--resume", metavar="ID", default=None,
                   help="continue a saved conversation (see the open dialog, ctrl+o) "
                        "(default: start a new one)")
    p.add_argument("--prompt-cache-mb", type=argtypes.megabytes, default=PROMPT_CACHE_MB,
                   metavar="MIB",
                   help="snapshots of the model's cache (after the system prompt and each "
                        "earlier message, every 1,024 prompt tokens, at each reply's end) kept "
                        "in RAM and written to the data folder, so a resumed conversation, or "
                        "a new one with the same system prompt, continues without prefilling "
                        f"it again; 0 = off (default: {PROMPT_CACHE_MB})")
    add_speculative_args(p)
    add_distributed_args(p)
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="with --distributed: start this rank without mlx.launch, which gives "
                        "rank 0 no terminal; FILE lists the ranks' addresses (the ring's "
                        "[[\"ip:port\"], ...] or mlx.launch's hostfile) (default: none)")
    p.add_argument("--rank", type=argtypes.int_range(0, None, "0 or more"), default=None,
                   metavar="R", help="with --hostfile: this process's rank; 0 runs the chat "
                                     "app in this terminal, the others follow it (default: "
                                     "none)")
    p.set_defaults(func=run)
    return p


def _join(args):
    """The Lockstep of `chat --distributed`, started by hand (`--hostfile F --rank R`, or
    MLX_RANK and MLX_HOSTFILE set). Not under mlx.launch: it starts every rank, rank 0
    included, with pipes for stdin and stdout even from a terminal (checked), and the chat app
    needs a terminal on rank 0. So rank 0's terminal is checked before joining."""
    from pocket_mlx.engine import distributed

    how = (f"start rank 0 in your terminal with `pocket-mlx chat --distributed "
           f"{args.distributed} --hostfile hosts.json --rank 0` and each other rank R with "
           "--rank R (on its own machine, or in the background); docs/DISTRIBUTED.md")
    temp = None
    if args.hostfile is not None:
        if args.rank is None:
            raise PocketError("--hostfile needs --rank R: this process's place in the file")
        temp = distributed.use_hostfile(args.hostfile, args.rank)
    elif args.rank is not None:
        raise PocketError("--rank goes with --hostfile FILE")
    rank = distributed.launch_rank()
    if rank is None:
        raise PocketError(f"chat --distributed: {how}")
    if rank == 0 and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise PocketError("chat --distributed: rank 0 runs the chat app and has no terminal "
                          f"here (mlx.launch gives its ranks pipes); {how}")
    try:
        g = distributed.init(args.distributed, args.distributed_timeout)
    finally:
        if temp is not None:
            os.unlink(temp)  # read by MLX when it joined
    return distributed.Lockstep(g)


def run(args) -> int:
    if args.distributed is None and (args.hostfile is not None or args.rank is not None):
        raise PocketError("--hostfile and --rank go with --distributed pipeline|experts")
    if args.distributed and args.speculative not in ("auto", "off"):
        raise PocketError(f"--speculative {args.speculative} does not run with --distributed: "
                          "drop one of them")
    lockstep = _join(args) if args.distributed else None
    if lockstep is not None and lockstep.g.rank != 0:
        from pocket_mlx.cli.serve import follow

        return follow(args, lockstep)
    app = make_app(args, lockstep)
    app.run()
    from pocket_mlx.engine.devices import exit_now

    if lockstep is not None:
        app.engine_done.wait(30)  # the engine thread tells the other ranks to stop
    exit_now(app.return_code or 0)  # MLX ran on the app's worker thread (see exit_now)


def make_app(args, lockstep=None) -> ChatApp:
    """The chat app of the command line, its model resolved and its chat template checked
    here (one error line before the UI), not started."""
    from pocket_mlx.engine.conversations import ConversationStore
    from pocket_mlx.engine.devices import resolve_device
    from pocket_mlx.engine.loader import open_folder, resolve_model_path
    from pocket_mlx.engine.session import Settings
    from pocket_mlx.engine.tokenizer import load_tokenizer

    device = resolve_device(args.device)
    store = ConversationStore()
    conv = store.load(args.resume) if args.resume else None
    options = {name: value for name, value in (
        ("system", args.system), ("temperature", args.temp), ("top_p", args.top_p),
        ("max_tokens", args.max_tokens)) if value is not None}
    # The saved settings were checked when the conversation was read (store.load); the options
    # given override them.
    settings = Settings.from_dict({**(conv.settings if conv else {}), **options})
    settings.validate()
    model = args.model or (conv.model if conv and conv.model else None)
    path = resolve_model_path(model)  # a bad --model fails here, on one line, before the UI
    # Read once (under --distributed: this rank's folder of per-rank shards, pocket-mlx shard);
    # the app loads this folder as it is.
    folder = open_folder(path, lockstep.g if lockstep is not None else None)
    if args.speculative == "mtp":  # no head: one line before the UI, as `generate` says it
        from pocket_mlx.config import text_config

        if not text_config(folder.config).get("mtp_num_hidden_layers"):
            raise PocketError("--speculative mtp: this model has no MTP head (use --speculative "
                              "lookup or auto)")
    # A chat template that cannot render fails here too, on one line, not at the first message.
    tokenizer = load_tokenizer(folder.path, folder.config)
    if tokenizer.chat_template:
        probe = [{"role": "system", "content": settings.system}] if settings.system else []
        tokenizer.apply_chat_template([*probe, {"role": "user", "content": "hello"}])

    from pocket_mlx.tui.app import ChatApp

    name = args.model or (conv.model if conv else None)
    name = str(name).rstrip("/").split("/")[-1] if name else path.name
    # The folder resolved and read above, so the app does not resolve (or build, or fetch) it,
    # nor read its config.json, again; the ref as given is what new conversations save.
    return ChatApp(model, path=folder, device=device, settings=settings, conversation=conv,
                   store=store, model_name=name, prompt_cache_mb=args.prompt_cache_mb,
                   distributed=lockstep,
                   speculative="off" if lockstep is not None else args.speculative,
                   num_draft_tokens=args.num_draft_tokens)
