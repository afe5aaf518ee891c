"""The macOS GPU wired-memory limit: read it, recommend a value, set it, make it survive reboots.

Why: Apple-silicon Macs let the GPU wire only ~65-75% of RAM by default. A model near that size
runs far slower (pages are evicted and re-wired) until the limit is raised with
`sudo sysctl iogpu.wired_limit_mb=N` (macOS 14+) or `debug.iogpu.wired_limit=<bytes>` (macOS 13).
The value resets at reboot; a LaunchDaemon can re-apply it. Sizes here are binary and labelled so
(pocket_mlx.units): the `_mb` sysctl counts MiB (2**20 bytes).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from pocket_mlx.config import (
    checkpoint_dtype,
    dtype_bytes,
    layer_types,
    read_config,
    text_config,
    weight_files,
    weights_bytes,
)
from pocket_mlx.errors import PocketError
from pocket_mlx.system.host import Platform, parse_sysctl_int
from pocket_mlx.units import GiB, MiB, size

MIN_RESERVE_BYTES = 4 * GiB
RESERVE_FRACTION = 0.15
HEADROOM_BYTES = 2 * GiB  # a limit above total RAM minus this is refused
LAUNCHD_LABEL = "com.pocket-mlx.wired-limit"
LAUNCHD_PATH = f"/Library/LaunchDaemons/{LAUNCHD_LABEL}.plist"
FIX_COMMAND = "pocket-mlx wired --set auto"


@dataclass(frozen=True)
class WiredKey:
    """A wired-limit sysctl and the unit of its value (bytes per unit)."""

    name: str
    unit: int

    def to_mb(self, raw: int) -> int:
        return raw * self.unit // MiB

    def from_mb(self, mb: int) -> int:
        return mb * MiB // self.unit


KEY_MB = WiredKey("iogpu.wired_limit_mb", MiB)  # macOS 14+
KEY_BYTES = WiredKey("debug.iogpu.wired_limit", 1)  # macOS 13


def find_key(platform: Platform) -> WiredKey | None:
    """The wired-limit sysctl this Mac has (probed, the version only orders the tries)."""
    version = platform.macos_version()
    if version is None:
        return None
    order = [KEY_BYTES, KEY_MB] if version[0] == 13 else [KEY_MB, KEY_BYTES]
    for key in order:
        if platform.sysctl_read(key.name) is not None:
            return key
    return None


def read_limit(platform: Platform, key: WiredKey) -> int | None:
    """Current raw value of the key (0 = system default), None if unreadable."""
    text = platform.sysctl_read(key.name)
    return parse_sysctl_int(text) if text is not None else None


def default_reserve_bytes(total_ram: int) -> int:
    """RAM left to macOS and apps: max(4 GiB, 15% of RAM)."""
    return max(MIN_RESERVE_BYTES, int(total_ram * RESERVE_FRACTION))


def recommended_limit_mb(total_ram: int, reserve_bytes: int | None = None) -> int:
    """Total RAM minus the reserve, in MiB, never above total RAM minus 2 GiB."""
    reserve = default_reserve_bytes(total_ram) if reserve_bytes is None else reserve_bytes
    mb = min((total_ram - reserve) // MiB, max_limit_mb(total_ram))
    if mb <= 0:
        raise PocketError(
            f"a reserve of {size(reserve)} leaves nothing of {size(total_ram)} RAM for the GPU"
        )
    return mb


def max_limit_mb(total_ram: int) -> int:
    return (total_ram - HEADROOM_BYTES) // MiB


def parse_limit_arg(text: str) -> int | None:
    """`--set` value: a positive whole number of MiB, or "auto" (returned as None)."""
    text = text.strip()
    if text.lower() == "auto":
        return None
    try:
        mb = int(text)
    except ValueError:
        raise PocketError(f"--set expects a whole number of MiB or 'auto', not {text!r}") from None
    if mb < 0:
        raise PocketError(f"--set {mb}: the limit must be positive")
    if mb == 0:
        raise PocketError("--set 0 means the system default: use --reset")
    return mb


def check_limit_mb(mb: int, total_ram: int) -> None:
    """Refuse limits that would starve macOS itself."""
    top = max_limit_mb(total_ram)
    if mb > top:
        raise PocketError(
            f"--set {mb}: above total RAM ({size(total_ram)}) minus 2 GiB = {top} MiB; refused"
        )


def sysctl_argv(key: WiredKey, mb: int) -> list[str]:
    """The exact command that sets the limit to `mb` MiB (0 = system default)."""
    return ["sudo", "sysctl", f"{key.name}={key.from_mb(mb)}"]


def sysctl_command(key: WiredKey, mb: int) -> str:
    return shlex.join(sysctl_argv(key, mb))


@dataclass(frozen=True)
class ApplyResult:
    ok: bool
    expected: int  # raw value written
    actual: int | None  # raw value read back
    output: str  # what sysctl printed


def apply_limit(platform: Platform, key: WiredKey, mb: int) -> ApplyResult:
    """Run `sudo sysctl`, then read the value back to confirm it stuck."""
    expected = key.from_mb(mb)
    res = platform.sysctl_write(key.name, expected)
    if not res.ok:
        detail = (res.stderr or res.stdout).strip().splitlines()
        reason = detail[-1] if detail else f"exit status {res.returncode}"
        raise PocketError(f"{sysctl_command(key, mb)} failed: {reason}")
    actual = read_limit(platform, key)
    return ApplyResult(actual == expected, expected, actual, res.stdout.strip())


def describe_limit(key: WiredKey, raw: int | None) -> str:
    """'system default (iogpu.wired_limit_mb = 0)' or '24576 MiB = 24.0 GiB (...)'."""
    if raw is None:
        return f"unreadable ({key.name})"
    if raw == 0:
        return f"system default ({key.name} = 0)"
    mb = key.to_mb(raw)
    unit = "" if key.unit == MiB else " bytes"
    return f"{mb} MiB = {size(mb * MiB)} ({key.name} = {raw}{unit})"


def launchd_plist(key: WiredKey, mb: int) -> str:
    """A LaunchDaemon that re-applies the limit at every boot (printed, never installed)."""
    return launchd_job_plist(LAUNCHD_LABEL, ["/usr/sbin/sysctl", f"{key.name}={key.from_mb(mb)}"],
                             RunAtLoad=True)


def launchd_job_plist(label: str, argv: list[str], **keys: str | bool | list | dict) -> str:
    """A launchd job's plist: `Label`, `ProgramArguments` and the other `keys` in order (strings,
    booleans, lists, dicts of them), strings XML-escaped. Shared by `wired --print-launchd` (a
    LaunchDaemon) and `serve --print-launchd` (a LaunchAgent)."""

    def value(v: str | bool | list | dict, pad: str) -> list[str]:
        if isinstance(v, bool):
            return [f"{pad}<{'true' if v else 'false'}/>"]
        if isinstance(v, list):
            return [f"{pad}<array>", *(x for item in v for x in value(item, pad + "    ")),
                    f"{pad}</array>"]
        if isinstance(v, dict):
            return [f"{pad}<dict>", *entries(v, pad + "    "), f"{pad}</dict>"]
        return [f"{pad}<string>{escape(v)}</string>"]

    def entries(d: dict, pad: str) -> list[str]:
        out = []
        for name, v in d.items():
            out.append(f"{pad}<key>{escape(name)}</key>")
            out.extend(value(v, pad))
        return out

    body = "\n".join(entries({"Label": label, "ProgramArguments": argv, **keys}, "    "))
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0">
<dict>
{body}
</dict>
</plist>
"""


def launchd_instructions(plist_file: str = "wired-limit.plist") -> str:
    return f"""To install (re-applies the limit at every boot):
  pocket-mlx wired --print-launchd > {plist_file}
  sudo cp {plist_file} {LAUNCHD_PATH}
  sudo chown root:wheel {LAUNCHD_PATH}
  sudo chmod 644 {LAUNCHD_PATH}
  sudo launchctl bootstrap system {LAUNCHD_PATH}
To remove:
  sudo launchctl bootout system/{LAUNCHD_LABEL}
  sudo rm {LAUNCHD_PATH}"""


# -- model footprint -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEstimate:
    context: int
    full_layers: int
    linear_layers: int
    full_bytes: int  # K and V of all full-attention layers at `context` tokens
    linear_bytes: int  # recurrent + conv state of all linear-attention layers
    act_bytes: int  # bytes per element of K, V and the conv state (the activation dtype)

    @property
    def total(self) -> int:
        return self.full_bytes + self.linear_bytes


def kv_cache_bytes(config: dict, context: int | None = None,
                   act_bytes: int | None = None) -> KVEstimate:
    """KV cache at `context` tokens (default max_position_embeddings). K, V and the conv
    window are in the activation dtype, `act_bytes` per element: 4 on the CPU (float32 under
    engine.devices.policy_dtype), the checkpoint's dtype on the GPU (None: that one, e.g. 2
    for bf16); the delta-rule state is float32 on both."""
    act = act_bytes or dtype_bytes(checkpoint_dtype(config))
    cfg = text_config(config)
    types = layer_types(config)
    linear = sum(1 for t in types if t == "linear_attention")
    full = len(types) - linear
    try:
        ctx = int(context or cfg["max_position_embeddings"])
        full_bytes = 0
        if full:
            kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
            full_bytes = full * 2 * kv_heads * head_dim * ctx * act
        linear_bytes = 0
        if linear:
            kh, kd = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
            vh, vd = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
            kernel = int(cfg["linear_conv_kernel_dim"])
            conv_dim = 2 * kh * kd + vh * vd
            linear_bytes = linear * (vh * vd * kd * 4 + (kernel - 1) * conv_dim * act)
    except KeyError as e:
        raise PocketError(f"config.json lacks {e.args[0]!r}: cannot size the KV cache") from None
    except (TypeError, ValueError) as e:
        raise PocketError(f"config.json has an unexpected value: {e}") from None
    return KVEstimate(ctx, full, linear, full_bytes, linear_bytes, act)


def serve_ram_bytes(config: dict, context: int, weight_bytes: int,
                    act_bytes: int | None = None, prompt_cache_bytes: int = 0) -> int:
    """What `serve` holds with one sequence at a full `context`: the weights, its cache (KV and
    linear state), and, with the prompt cache on (`prompt_cache_bytes`, its RAM budget, > 0),
    the larger of that budget and one snapshot of a full window (a copy of that cache): the
    store spills colder entries before it copies a snapshot (engine/prompt_cache.py), and one
    larger than the budget is written to disk and dropped after. Measured on the 35B shape
    (scripts/bench_serve.py --parts l, docs/SERVE.md)."""
    kv = kv_cache_bytes(config, context, act_bytes).total
    return weight_bytes + kv + (max(prompt_cache_bytes, kv) if prompt_cache_bytes > 0 else 0)


def fitting_context(config: dict, weight_bytes: int, total_ram: int | None,
                    act_bytes: int | None = None, prompt_cache_bytes: int = 0) -> int | None:
    """The longest window whose KV cache (one sequence's, as `info` sizes it) fits beside the
    weights in usable RAM (total less the default reserve, the `fits` test of `info`), with
    the prompt cache's share when it is on (`serve_ram_bytes`): the window `serve` offers
    when no --ctx-size is given, so that a full window cannot swap. None when RAM is unknown
    or the cache does not grow with the window (no full attention); 0 when the weights alone
    leave no room."""
    if not total_ram:
        return None
    one = kv_cache_bytes(config, 1, act_bytes)
    if one.full_bytes == 0:
        return None
    room = total_ram - default_reserve_bytes(total_ram) - weight_bytes - one.linear_bytes
    fit = room // one.full_bytes
    if prompt_cache_bytes > 0:  # the budget beside the cache, and a snapshot as large as it
        fit = min((room - prompt_cache_bytes) // one.full_bytes,
                  (room - one.linear_bytes) // (2 * one.full_bytes))
    return max(0, fit)


# The planner never shrinks the window below this (or the model's own, if smaller): where the
# weights leave less, such a window is still more use than none, and --ctx-size decides.
MIN_PLANNED_CONTEXT = 2048


def planned_context(config: dict, own: int, weight_bytes: int, total_ram: int | None,
                    act_bytes: int | None = None, prompt_cache_bytes: int = 0) -> int:
    """The window `serve` offers without --ctx-size (and `info` reports): the model's own,
    capped by `fitting_context`, never below MIN_PLANNED_CONTEXT (or the model's own)."""
    fit = fitting_context(config, weight_bytes, total_ram, act_bytes, prompt_cache_bytes)
    if fit is None or fit >= own:
        return own
    return max(fit, min(own, MIN_PLANNED_CONTEXT))


@dataclass(frozen=True)
class ModelFootprint:
    path: Path
    weight_bytes: int
    kv: KVEstimate | None

    @property
    def total(self) -> int:
        return self.weight_bytes + (self.kv.total if self.kv else 0)


def model_footprint(model: str | Path, context: int | None = None) -> ModelFootprint:
    """Weights (tensor bytes of its *.safetensors) plus KV cache, from a local model directory.
    The KV cache is sized in the checkpoint's dtype: GPU wired memory is what this is about."""
    path = Path(model).expanduser()
    if not path.is_dir():
        raise PocketError(f"--model {model}: not a local model directory")
    files = weight_files(path)  # the index's shards, not every *.safetensors there
    if not files:
        raise PocketError(f"--model {model}: no *.safetensors files there")
    weights = weights_bytes(path)
    kv = None
    if (path / "config.json").is_file():
        config = read_config(path)
        kv = kv_cache_bytes(config, context, dtype_bytes(checkpoint_dtype(config)))
    return ModelFootprint(path, weights, kv)
