"""`pocket-mlx wired`: show, raise or reset the macOS GPU wired-memory limit.

Exit codes: 0 done (or nothing to do, e.g. on Linux); 1 not applied (prompt declined, or the
value read back differs from the one written); 2 refused (bad value, no such setting here).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from pocket_mlx.errors import PocketError
from pocket_mlx.system.host import Platform, get_platform
from pocket_mlx.system.wired import (
    FIX_COMMAND,
    KEY_BYTES,
    KEY_MB,
    WiredKey,
    apply_limit,
    check_limit_mb,
    default_reserve_bytes,
    describe_limit,
    find_key,
    launchd_instructions,
    launchd_plist,
    model_footprint,
    parse_limit_arg,
    read_limit,
    recommended_limit_mb,
    sysctl_command,
)
from pocket_mlx.units import GiB, MiB, size

NOT_ON_THIS_OS = "the GPU wired-memory limit is a macOS setting; it does not exist on {os}"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "wired",
        help="show or raise the macOS GPU wired-memory limit",
        description=(
            "Show the macOS GPU wired-memory limit and the value recommended for this Mac; "
            "--set applies it with sudo (resets at reboot; --print-launchd makes it stick). "
            "Sizes are binary: 1 MiB = 2^20 bytes, 1 GiB = 2^30 bytes."
        ),
    )
    p.add_argument("--model", metavar="DIR", help="local model directory to size (weights + KV) "
                                              "(default: none, size nothing)")
    p.add_argument(
        "--context", type=int, metavar="TOKENS", help="KV cache length (default: the model's max)"
    )
    p.add_argument(
        "--reserve-gb",
        type=float,
        metavar="GIB",
        help="RAM in GiB to leave to macOS and apps (default: max(4 GiB, 15%% of RAM))",
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument(
        "--set", dest="set_limit", metavar="MIB|auto",
        help="set the limit in MiB (sudo sysctl) (default: only show it)",
    )
    action.add_argument("--reset", action="store_true", help="back to the system default (0)")
    p.add_argument(
        "--print-launchd",
        action="store_true",
        help="print a LaunchDaemon plist that re-applies the limit at boot (never installs it)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask before running sudo")
    p.set_defaults(func=run)
    return p


def run(
    args: argparse.Namespace,
    platform: Platform | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Entry point; `platform` and the streams are injectable for tests."""
    platform = platform or get_platform()
    io = _IO(stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr)
    set_limit = getattr(args, "set_limit", None)
    changing = set_limit is not None or args.reset
    if (args.dry_run or args.yes) and not changing:
        raise PocketError("--dry-run and --yes go with --set or --reset")
    if args.print_launchd and args.reset:
        raise PocketError(
            "--print-launchd re-applies a limit at boot; to drop it: "
            "sudo launchctl bootout system/com.pocket-mlx.wired-limit"
        )
    if args.context is not None and args.context <= 0:
        raise PocketError(f"--context {args.context}: must be a positive number of tokens")
    if args.reserve_gb is not None and args.reserve_gb < 0:
        raise PocketError(f"--reserve-gb {args.reserve_gb:g}: must not be negative")
    if changing or args.print_launchd:
        return _change(args, platform, io)
    return _show(args, platform, io)


class _IO:
    def __init__(self, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> None:
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr

    def out(self, text: str = "") -> None:
        print(text, file=self.stdout)

    def err(self, text: str) -> None:
        print(text, file=self.stderr)

    def confirm(self, question: str) -> bool:
        self.stderr.write(f"{question} [y/N] ")
        self.stderr.flush()
        answer = self.stdin.readline()
        if not answer:
            self.stderr.write("\n")
        return answer.strip().lower() in ("y", "yes")


def _reserve(args: argparse.Namespace, total: int) -> int:
    if args.reserve_gb is None:
        return default_reserve_bytes(total)
    return int(args.reserve_gb * GiB)


def _total_ram(platform: Platform) -> int:
    total = platform.total_ram_bytes()
    if not total:
        raise PocketError("cannot read the total RAM of this machine (sysctl hw.memsize)")
    return total


def _require_key(platform: Platform) -> WiredKey:
    if not platform.is_macos():
        raise PocketError(NOT_ON_THIS_OS.format(os=platform.system()))
    key = find_key(platform)
    if key is None:
        raise PocketError(
            f"{platform.os_label()} has no GPU wired-limit sysctl ({KEY_MB.name} needs macOS 14, "
            f"{KEY_BYTES.name} macOS 13)"
        )
    return key


def _change(args: argparse.Namespace, platform: Platform, io: _IO) -> int:
    requested = parse_limit_arg(args.set_limit) if args.set_limit is not None else None
    key = _require_key(platform)
    if args.reset:
        mb = 0
    else:
        total = _total_ram(platform)
        mb = (
            requested
            if requested is not None
            else recommended_limit_mb(total, _reserve(args, total))
        )
        check_limit_mb(mb, total)
    if args.print_launchd:
        io.out(launchd_plist(key, mb).rstrip("\n"))
        io.err(launchd_instructions())
        return 0
    command = sysctl_command(key, mb)
    if args.dry_run:
        io.out(f"dry run: would run: {command}")
        return 0
    if not args.yes and not io.confirm(f"Run `{command}`?"):
        io.err("not changed.")
        return 1
    result = apply_limit(platform, key, mb)
    if result.output:
        io.out(result.output)
    if not result.ok:
        got = "nothing readable" if result.actual is None else str(result.actual)
        io.err(
            f"pocket-mlx wired: {key.name} reads back {got}, not {result.expected}: "
            "the limit was not applied as asked"
        )
        return 1
    if mb == 0:
        io.out("wired limit is back to the system default.")
    else:
        io.out(
            f"wired limit is now {describe_limit(key, result.actual)}. It resets at reboot: "
            "`pocket-mlx wired --print-launchd` prints a LaunchDaemon that re-applies it."
        )
    return 0


def _show(args: argparse.Namespace, platform: Platform, io: _IO) -> int:
    macos = platform.is_macos()
    total = platform.total_ram_bytes()
    io.out(f"OS:                 {platform.os_label()}")
    io.out(f"Total RAM:          {size(total) if total else 'unknown'}")
    footprint = model_footprint(args.model, args.context) if args.model else None
    if not macos:
        io.out(f"Wired limit:        none: {NOT_ON_THIS_OS.format(os=platform.system())}")
        _show_model(io, footprint)
        io.out("Nothing to do here.")
        return 0
    key = find_key(platform)
    if key is None:
        io.out(
            f"Wired limit:        not adjustable on {platform.os_label()} "
            f"({KEY_MB.name} needs macOS 14, {KEY_BYTES.name} macOS 13)"
        )
        _show_model(io, footprint)
        return 0
    if not total:
        raise PocketError("cannot read the total RAM of this Mac (sysctl hw.memsize)")
    raw = read_limit(platform, key)
    io.out(f"Wired limit:        {describe_limit(key, raw)}")
    info = platform.gpu_device_info()
    max_rec = info.get("max_recommended_working_set_size")
    if max_rec:
        name = info.get("device_name", "GPU")
        io.out(f"MLX working set:    {size(int(max_rec))} recommended by the GPU ({name})")
    else:
        io.out("MLX working set:    not reported (MLX sees no GPU in this process)")
    _show_model(io, footprint)
    reserve = _reserve(args, total)
    mb = recommended_limit_mb(total, reserve)
    io.out(
        f"Recommended limit:  {mb} MiB = {size(mb * MiB)} "
        f"({size(total)} RAM - {size(reserve)} reserve)"
    )
    if footprint is not None and footprint.total > mb * MiB:
        io.out(
            "                    the model does not fit even then: use a smaller build, "
            "a shorter --context, or run it on the CPU"
        )
    if raw is not None and key.to_mb(raw) == mb:
        io.out("                    already applied.")
        return 0
    io.out(f"Apply with:         {sysctl_command(key, mb)}")
    io.out(f"                    or: {FIX_COMMAND}  (resets at reboot; see --print-launchd)")
    return 0


def _show_model(io: _IO, footprint) -> None:
    if footprint is None:
        return
    io.out(f"Model weights:      {size(footprint.weight_bytes)} ({footprint.path})")
    kv = footprint.kv
    if kv is None:
        io.out("KV cache:           unknown (no config.json)")
        return
    io.out(
        f"KV cache:           {size(kv.total)} at {kv.context} tokens "
        f"({kv.full_layers} full-attention layers {size(kv.full_bytes)}, "
        f"{kv.linear_layers} linear-attention layers {size(kv.linear_bytes)})"
    )
    io.out(f"Model total:        {size(footprint.total)}")
