"""`pocket-mlx chat`: the terminal chat app (Textual), with saved conversations."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pocket_mlx.cli import args as argtypes
from pocket_mlx.cli.args import add_distributed_args, add_model_args
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
                   help="replies' caches kept in RAM and written to the data folder, so a "
                        "resumed conversation continues without prefilling it again; 0 = off "
                        f"(default: {PROMPT_CACHE_MB})")
    add_distributed_args(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    if args.distributed:
        # Checked: mlx.launch starts every rank with pipes for stdin/stdout, even from a
        # terminal, so the Textual app has no terminal on rank 0; and the chat has no plain mode.
        raise PocketError("chat --distributed is not supported: mlx.launch gives rank 0 no "
                          "terminal for the chat app; run `serve --distributed "
                          f"{args.distributed}` under mlx.launch and chat through its HTTP API "
                          "(docs/DISTRIBUTED.md)")
    app = make_app(args)
    app.run()
    from pocket_mlx.engine.devices import exit_now

    exit_now(app.return_code or 0)  # MLX ran on the app's worker thread (see exit_now)


def make_app(args) -> ChatApp:
    """The chat app of the command line, its model resolved and its chat template checked
    here (one error line before the UI), not started."""
    from pocket_mlx.engine.conversations import ConversationStore
    from pocket_mlx.engine.devices import resolve_device
    from pocket_mlx.engine.loader import resolve_model_path
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
    # A chat template that cannot render fails here too, on one line, not at the first message.
    tokenizer = load_tokenizer(path)
    if tokenizer.chat_template:
        probe = [{"role": "system", "content": settings.system}] if settings.system else []
        tokenizer.apply_chat_template([*probe, {"role": "user", "content": "hello"}])

    from pocket_mlx.tui.app import ChatApp

    name = args.model or (conv.model if conv else None)
    name = str(name).rstrip("/").split("/")[-1] if name else path.name
    # The folder resolved above, so the app does not resolve (or build, or fetch) it again;
    # the ref as given is what new conversations save.
    return ChatApp(model, path=path, device=device, settings=settings, conversation=conv,
                   store=store, model_name=name, prompt_cache_mb=args.prompt_cache_mb)
