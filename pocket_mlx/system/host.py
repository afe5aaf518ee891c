"""The few OS facts and commands pocket-mlx needs, behind one small interface.

Why an interface: the macOS wired-limit helper runs `sysctl`, `sw_vers` and `sudo`, which cannot
run on the Linux machines where tests run. `Platform` turns those calls into two primitives
(`run(argv)` and `read_text(path)`); `RealPlatform` executes them, `FakePlatform` answers them
from outputs recorded on real Macs (`tests/fixtures/macos/*.txt`), so the parsing is tested
against what macOS really prints. `gpu_device_info` is MLX's description of the GPU, the one
device fact the OS commands do not give.

This module is the bottom of system/: wired.py and memory.py build on it; it imports neither.

Test-only: setting `POCKET_MLX_FAKE_PLATFORM=<fixture file>` makes `get_platform()` return a
`FakePlatform` fed by that file, so the CLI can be exercised end to end in a subprocess. Never set
it for real use: nothing is executed then.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

FAKE_PLATFORM_ENV = "POCKET_MLX_FAKE_PLATFORM"


@dataclass(frozen=True)
class CommandResult:
    """What a command printed and returned (returncode 127: the program does not exist)."""

    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Platform:
    """OS queries built on `run` and `read_text`; subclasses provide those two primitives."""

    def run(self, argv: list[str], *, interactive: bool = False) -> CommandResult:
        """Run a command; `interactive` lets it talk to the terminal (sudo's password prompt)."""
        raise NotImplementedError

    def read_text(self, path: str) -> str | None:
        """Contents of a file, or None when it cannot be read."""
        raise NotImplementedError

    def gpu_device_info(self) -> dict:
        """MLX's description of the GPU device ({} when MLX has no GPU here)."""
        return gpu_device_info()

    # -- derived queries ------------------------------------------------------------------------
    def system(self) -> str:
        """Kernel name as `uname -s` prints it: "Darwin", "Linux", ... (asked once)."""
        cached = getattr(self, "_system", None)
        if cached is None:
            res = self.run(["uname", "-s"])
            cached = res.stdout.strip() if res.ok and res.stdout.strip() else "unknown"
            self._system = cached
        return cached

    def is_macos(self) -> bool:
        return self.system() == "Darwin"

    def macos_version(self) -> tuple[int, ...] | None:
        """(14, 5) for macOS 14.5; None when not macOS or `sw_vers` fails."""
        if not self.is_macos():
            return None
        res = self.run(["sw_vers", "-productVersion"])
        if not res.ok:
            return None
        return parse_version(res.stdout)

    def os_label(self) -> str:
        """Label such as `macOS 14.5` or `Linux 6.8.0-45-generic`, for messages only."""
        if self.is_macos():
            res = self.run(["sw_vers", "-productVersion"])
            return f"macOS {res.stdout.strip()}" if res.ok else "macOS (unknown version)"
        system = self.system()
        res = self.run(["uname", "-r"])
        return f"{system} {res.stdout.strip()}" if res.ok and res.stdout.strip() else system

    def sysctl_read(self, key: str) -> str | None:
        """`sysctl -n key` as text, or None when the key does not exist (unknown oid)."""
        res = self.run(["sysctl", "-n", key])
        if not res.ok or "unknown oid" in res.stderr or not res.stdout.strip():
            return None
        return res.stdout.strip()

    def sysctl_write(self, key: str, value: int) -> CommandResult:
        """`sudo sysctl key=value`: may prompt for the user's password on the terminal."""
        return self.run(["sudo", "sysctl", f"{key}={value}"], interactive=True)

    def total_ram_bytes(self) -> int | None:
        """Physical memory in bytes: `sysctl hw.memsize` on macOS, /proc/meminfo on Linux."""
        if self.is_macos():
            res = self.run(["sysctl", "hw.memsize"])
            return parse_sysctl_int(res.stdout, "hw.memsize") if res.ok else None
        text = self.read_text("/proc/meminfo")
        return parse_meminfo_total(text) if text else None


class RealPlatform(Platform):
    """Runs the commands for real (subprocess, no shell)."""

    def run(self, argv: list[str], *, interactive: bool = False) -> CommandResult:
        try:
            if interactive:  # leave stdin/stderr on the terminal so sudo can ask for a password
                proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
                return CommandResult(proc.returncode, proc.stdout or "", "")
            proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
        except FileNotFoundError:
            return CommandResult(127, "", f"{argv[0]}: command not found")
        except (OSError, subprocess.SubprocessError) as e:
            return CommandResult(126, "", f"{argv[0]}: {e}")
        return CommandResult(proc.returncode, proc.stdout or "", proc.stderr or "")

    def read_text(self, path: str) -> str | None:
        try:
            return Path(path).read_text()
        except OSError:
            return None


@dataclass
class FakePlatform(Platform):
    """Answers commands from a recorded transcript; for tests only.

    Transcript format (one file per recorded machine):
        $ <command line>        a command, as typed
        <line>                  its stdout
        [stderr] <line>         a line of its stderr
        [exit N]                its exit status (default 0)
        [mlx.device_info(gpu)] {json}   what MLX reported for the GPU on that machine
    Lines starting with `#` before the first command are comments. Files are read through
    `$ cat <path>` entries. Unrecorded commands fail like a missing program (exit 127).

    `sudo sysctl key=value` is simulated in BSD sysctl's format ("key: old -> new") and updates
    later reads of the key, unless `apply_writes` is False (a write that does not stick) or
    `write_result` forces an answer (e.g. sudo refusing). Every call is kept in `calls`.
    """

    responses: dict[str, CommandResult] = field(default_factory=dict)
    device_info: dict = field(default_factory=dict)
    apply_writes: bool = True
    write_result: CommandResult | None = None
    calls: list[list[str]] = field(default_factory=list)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> FakePlatform:
        responses: dict[str, CommandResult] = {}
        device_info: dict = {}
        cmd: str | None = None
        out: list[str] = []
        err: list[str] = []
        rc = 0

        def flush() -> None:
            if cmd is not None:
                stdout = "".join(line + "\n" for line in out)
                stderr = "".join(line + "\n" for line in err)
                responses[cmd] = CommandResult(rc, stdout, stderr)

        for line in Path(path).read_text().splitlines():
            if line.startswith("$ "):
                flush()
                cmd, out, err, rc = _normalize(line[2:]), [], [], 0
            elif line.startswith("[mlx.device_info(gpu)]"):
                device_info = json.loads(line.split("]", 1)[1])
            elif cmd is None:
                continue  # header comments
            elif line.startswith("[stderr] "):
                err.append(line[len("[stderr] ") :])
            elif m := re.fullmatch(r"\[exit (\d+)\]", line.strip()):
                rc = int(m.group(1))
            else:
                out.append(line)
        flush()
        return cls(responses=responses, device_info=device_info, **kwargs)

    def run(self, argv: list[str], *, interactive: bool = False) -> CommandResult:
        self.calls.append(list(argv))
        if argv[:2] == ["sudo", "sysctl"] and len(argv) == 3 and "=" in argv[2]:
            return self._write(*argv[2].split("=", 1))
        return self.responses.get(
            _normalize(shlex.join(argv)), CommandResult(127, "", f"{argv[0]}: not recorded")
        )

    def read_text(self, path: str) -> str | None:
        res = self.responses.get(_normalize(f"cat {path}"))
        return res.stdout if res and res.ok else None

    def gpu_device_info(self) -> dict:
        return dict(self.device_info)

    def _write(self, key: str, value: str) -> CommandResult:
        if self.write_result is not None:
            return self.write_result
        old = self.responses.get(f"sysctl -n {key}")
        if old is None or not old.ok or "unknown oid" in old.stderr or not old.stdout.strip():
            return CommandResult(1, "", f"sysctl: unknown oid '{key}'\n")
        if self.apply_writes:
            self.responses[f"sysctl -n {key}"] = CommandResult(0, f"{value}\n", "")
        return CommandResult(0, f"{key}: {old.stdout.strip()} -> {value}\n", "")

    @property
    def writes(self) -> list[str]:
        """The `key=value` arguments of every `sudo sysctl` call made."""
        return [c[2] for c in self.calls if c[:2] == ["sudo", "sysctl"]]


def _normalize(command: str) -> str:
    return " ".join(shlex.split(command))


def parse_version(text: str) -> tuple[int, ...] | None:
    """`14.5` -> (14, 5); None when the text does not start with a number."""
    m = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def parse_sysctl_int(text: str, key: str | None = None) -> int | None:
    """Integer from `sysctl key` ("hw.memsize: 34359738368") or `sysctl -n key` ("0")."""
    text = text.strip()
    if key and text.startswith(f"{key}:"):
        text = text[len(key) + 1 :].strip()
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def parse_meminfo_total(text: str) -> int | None:
    """MemTotal of /proc/meminfo, in bytes (the file says kB, meaning KiB)."""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def gpu_device_info() -> dict:
    """MLX's info dict for the GPU device; {} when MLX has no GPU here (Linux CPU wheel)."""
    try:
        if not mx.is_available(mx.gpu):
            return {}
        return dict(mx.device_info(mx.gpu))
    except Exception:  # noqa: BLE001 - any backend trouble means "no GPU info"
        return {}


def get_platform() -> Platform:
    """The platform to use: real, unless the test-only POCKET_MLX_FAKE_PLATFORM is set."""
    fake = os.environ.get(FAKE_PLATFORM_ENV)
    if fake:
        return FakePlatform.from_file(fake)
    return RealPlatform()


def total_ram_bytes(platform: Platform | None = None) -> int | None:
    """Physical memory of this machine in bytes, or None if it cannot be determined."""
    return (platform or get_platform()).total_ram_bytes()
