"""Writing MLX checkpoints that both pocket-mlx and stock mlx-lm load.

Everything is written into a temporary folder beside the destination and renamed into place at
the end, so an interrupted write never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

from pocket_mlx.config import TOKENIZER_FILES, text_config
from pocket_mlx.errors import PocketError
from pocket_mlx.models.fusion import unfused_parameters

DEFAULT_SHARD_BYTES = 5 << 30  # mlx-lm's and transformers' default shard size
# Room kept at the start of each shard for its JSON header, so the data is written once, in
# place. ~130 bytes a tensor: 1 MiB holds ~8k tensor entries, far more than a 5 GB shard of a
# POCKET model has; a longer header costs one copy of that shard (ShardWriter._finish). The
# room is sized by what the shard will really hold (the build's size when it is smaller than
# a shard): 1/256 of it, 4 KiB at least, so a small build reserves little, and one whose
# header outgrows that is copied once behind an exact header (cheap: it is small).
HEADER_RESERVE = 1 << 20
# Padding a finished shard may keep: beyond max(this, its data / PAD_RATIO) it is copied
# behind an exact header instead, so no shard carries room out of proportion to its size.
MAX_PADDING = 4096
PAD_RATIO = 256


def header_reserve_for(shard_bytes: int) -> int:
    """The header room for a shard of `shard_bytes`: a multiple of 8 (8-aligned data)."""
    return max(4096, min(HEADER_RESERVE, shard_bytes // PAD_RATIO)) // 8 * 8


_ST_DTYPES = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
    mx.uint32: "U32", mx.int32: "I32", mx.uint8: "U8", mx.int8: "I8", mx.int64: "I64",
    mx.uint16: "U16", mx.int16: "I16", mx.bool_: "BOOL", mx.uint64: "U64",
}


OWNER = ".owner"  # in a temporary folder: who writes it (see owner_alive)
_noted: set[Path] = set()  # folders clean_stale has already mentioned in this process


def _boot_id() -> str | None:
    """This boot of this machine: a pid only means something within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        pass
    try:  # macOS: the boot time stands for the boot
        r = subprocess.run(["sysctl", "-n", "kern.boottime"], capture_output=True, text=True,
                           timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _process_start(pid: int) -> str | None:
    """When process `pid` started (None: unknown or gone); tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return None if fields[0] in ("Z", "X") else fields[19]  # zombie: as good as gone
    except (OSError, ValueError, IndexError):
        pass
    if Path("/proc/self").exists():
        return None  # Linux and no /proc/PID: gone
    try:
        r = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True,
                           text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def owner_record(pid: int | None = None) -> dict:
    """What identifies a writing process across pid reuse: pid, host, boot, start time."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "boot": _boot_id(),
            "started": _process_start(pid)}


def owner_alive(rec: dict) -> bool | None:
    """Whether the process of an owner record still runs: None when this host cannot tell
    (another host on a shared disk, a record it cannot read)."""
    pid = rec.get("pid")
    if rec.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    boot = _boot_id()
    if rec.get("boot") and boot and rec["boot"] != boot:
        return False  # rebooted since
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    except OSError:
        return None
    started = _process_start(pid)
    if started is None and Path("/proc/self").exists():
        return False  # a zombie, or gone between the two looks
    if rec.get("started") and started and started != rec["started"]:
        return False  # the pid was reused by another process
    return True


def clean_stale(out: Path, log: Callable[[str], None] | None = None,
                keep: Callable[[Path], bool] | None = None) -> list[Path]:
    """Remove the temporary folders of dead writes of `out` (killed, crashed, power loss);
    mention those it cannot judge; leave those `keep` says a resumed run will take over.
    Returns the folders removed."""
    out = Path(out)
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    removed = []
    try:
        candidates = sorted(out.parent.glob(f".{out.name}.tmp-*"))
    except OSError:
        return removed
    for tmp in candidates:
        if not tmp.is_dir() or tmp.is_symlink():
            continue
        try:
            rec = json.loads((tmp / OWNER).read_text())
        except (OSError, ValueError):
            rec = None
        alive = owner_alive(rec) if isinstance(rec, dict) else None
        if alive is not False and tmp in _noted:
            continue  # check_out runs before the work and again in atomic_dir: say it once
        _noted.add(tmp)
        if alive is False and keep is not None and keep(tmp):
            continue
        if alive is False:
            shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                removed.append(tmp)
                say(f"note: removed {tmp}, left by an interrupted write (pid {rec['pid']})")
        elif alive:
            say(f"note: {tmp} belongs to a write of {out.name} still running (pid {rec['pid']})")
        else:
            say(f"note: {tmp} is left over from an interrupted write; delete it to free "
                "the space")
    return removed


def check_out(out: Path, force: bool = False, log: Callable[[str], None] | None = None,
              keep: Callable[[Path], bool] | None = None) -> None:
    """Fail before any work when `out` cannot be written (exists without `force`, under a
    file, in a folder this process cannot write), and clear what dead writes left there
    (but those `keep` picks: see clean_stale)."""
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not force:
        raise PocketError(f"{out} already exists (use --force to replace it)")
    base = out.parent
    while not base.exists() and base != base.parent:  # exists() is False under a file too
        base = base.parent
    if not base.is_dir():
        raise PocketError(f"cannot write {out}: {base} is a file, not a folder")
    try:  # the real test (permissions, read-only mounts, ACLs): make and drop a folder
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=base))
    except OSError as e:
        raise PocketError(f"cannot write {out}: {base} is not writable "
                          f"({e.strerror or e}); choose another output folder") from None
    if base == out.parent:
        clean_stale(out, log, keep)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` onto `out`; an existing `out` (folder or file) is moved aside first and
    deleted after, or put back when the rename fails: no `.old` leftovers either way."""
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    _remove(old)


def resumable(out: Path, accept: Callable[[Path], bool]) -> Path | None:
    """The temporary folder of a dead write of `out` that `accept` takes (the newest first),
    for a resumed run to continue in; None when there is none."""
    out = Path(out)
    try:
        found = sorted(out.parent.glob(f".{out.name}.tmp-*"), key=lambda p: p.stat().st_mtime,
                       reverse=True)
    except OSError:
        return None
    for tmp in found:
        try:
            rec = json.loads((tmp / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if tmp.is_dir() and not tmp.is_symlink() and isinstance(rec, dict) \
                and owner_alive(rec) is False and accept(tmp):
            return tmp
    return None


@contextmanager
def atomic_dir(out: Path, force: bool = False, log: Callable[[str], None] | None = None,
               resume: Callable[[Path], bool] | None = None):
    """Yield a temporary folder next to `out`; on success it replaces `out` in one rename.

    The folder holds an owner record (pid, host, boot, start time) until the rename, so a
    later write of the same `out` removes it when this process died without cleaning up
    (kill -9, power loss): see clean_stale. `resume`: take over the folder of a dead write
    that it accepts (see `resumable`) instead of starting an empty one; the other dead ones
    are removed as usual."""
    out = Path(out)
    tmp = resumable(out, resume) if resume is not None else None
    check_out(out, force, log, keep=(lambda p: p == tmp) if tmp is not None else None)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise PocketError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        (tmp / OWNER).write_text(json.dumps(owner_record()))
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary folder
        yield tmp
        (tmp / OWNER).unlink(missing_ok=True)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# Keys that make transformers import and run Python shipped with a checkpoint. pocket-mlx and
# mlx-lm never need that code, so a converted model must not carry an invitation to run it.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code", "model_file")


def strip_remote_code(value: Any) -> tuple[Any, list[str]]:
    """A copy of a JSON value without REMOTE_CODE_KEYS at any depth, and the keys removed."""
    found: set[str] = set()

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            found.update(k for k in v if k in REMOTE_CODE_KEYS)
            return {k: walk(x) for k, x in v.items() if k not in REMOTE_CODE_KEYS}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(value), sorted(found)


def remote_code_note(removed: dict[str, list[str]]) -> str | None:
    """One line for the user: which remote-code keys left which file."""
    if not removed:
        return None
    parts = [f"{', '.join(keys)} from {name}" for name, keys in removed.items()]
    return "note: removed remote-code keys " + "; ".join(parts) + " (not needed to run it)"


def mlx_config(config: dict, quantization: dict | None = None) -> dict:
    """A flat text config with model_type `qwen3_5_moe`: the form mlx-lm's loader accepts.
    Remote-code keys are dropped (see REMOTE_CODE_KEYS)."""
    text = strip_remote_code(text_config(config))[0]
    for k in ("quantization", "quantization_config", "text_config", "vision_config",
              "architectures"):
        text.pop(k, None)
    text["model_type"] = "qwen3_5_moe"
    if quantization:
        text["quantization"] = quantization
        text["quantization_config"] = quantization
    return text


class ShardWriter:
    """Streams tensors into safetensors shards of at most `shard_bytes` (a tensor larger than
    that gets a shard of its own), writing each weight byte once: a shard is written in place
    to a hidden `.shard-N.safetensors` file whose first `header_reserve` bytes are left for the
    header and whose tensor data follows from there as it comes. `close` writes the 8-byte
    length and the JSON header padded with spaces (safetensors allows it) to fill that region
    exactly, renames the shards as mlx-lm and transformers name them and writes the index. A
    header too long for the region (more tensors than it was sized for), or a shard with less
    data than the padding, falls back, for that shard only, to writing a new file (exact
    header, then the data copied over).
    Memory use: the tensor being written."""

    def __init__(self, folder: Path, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 header_reserve: int | None = None, expected_bytes: int | None = None):
        if header_reserve is None:  # sized by what a shard will hold, not by the limit
            header_reserve = header_reserve_for(min(shard_bytes, expected_bytes or shard_bytes))
        if header_reserve < 16 or header_reserve % 8:
            raise ValueError(f"header_reserve must be a multiple of 8 from 16, got "
                             f"{header_reserve}")  # 8-aligned data, room for "{}"
        self.folder, self.shard_bytes = Path(folder), shard_bytes
        self.header_reserve = header_reserve
        self.shards: list[dict] = []  # {"file": Path, "header": {}, "size": int}
        self._f = None

    def state(self) -> dict:
        """What `resumed` needs to continue after this point (the data so far is flushed and
        synced): the shards' headers and sizes. JSON-serializable."""
        if self._f:
            self._f.flush()
            os.fsync(self._f.fileno())
        return {"shard_bytes": self.shard_bytes, "header_reserve": self.header_reserve,
                "shards": [{"file": s["file"].name, "header": s["header"], "size": s["size"]}
                           for s in self.shards]}

    @classmethod
    def resumed(cls, folder: Path, state: dict) -> ShardWriter:
        """A writer that continues from `state` (see `state`) in `folder`: the last shard is
        cut back to the data the state counts (a dead run may have written more) and reopened
        at its end."""
        w = cls(folder, state["shard_bytes"], state["header_reserve"])
        w.shards = [{"file": Path(folder) / s["file"], "header": s["header"], "size": s["size"]}
                    for s in state["shards"]]
        if w.shards:
            last = w.shards[-1]
            w._f = open(last["file"], "r+b")
            w._f.truncate(w.header_reserve + last["size"])
            w._f.seek(w.header_reserve + last["size"])
        return w

    def _new_shard(self) -> None:
        if self._f:
            self._f.close()
        file = self.folder / f".shard-{len(self.shards)}.safetensors"
        self.shards.append({"file": file, "header": {}, "size": 0})
        self._f = open(file, "wb")
        self._f.seek(self.header_reserve)  # the header goes here at close (a hole until then)

    def add(self, name: str, arr: mx.array) -> None:
        """Evaluate `arr` and append it to the current shard (starting a new one when full)."""
        if arr.dtype not in _ST_DTYPES:
            raise PocketError(f"cannot write {name}: dtype {arr.dtype} has no safetensors type")
        mx.eval(arr)
        nbytes = arr.nbytes
        if not self.shards or (self.shards[-1]["size"]
                               and self.shards[-1]["size"] + nbytes > self.shard_bytes):
            self._new_shard()
        shard = self.shards[-1]
        mv = memoryview(arr)
        if not mv.c_contiguous:
            arr = mx.contiguous(arr)
            mx.eval(arr)
            mv = memoryview(arr)
        self._f.write(mv)
        start = shard["size"]
        shard["header"][name] = {"dtype": _ST_DTYPES[arr.dtype], "shape": list(arr.shape),
                                 "data_offsets": [start, start + nbytes]}
        shard["size"] += nbytes

    def _finish(self, shard: dict, dest: Path) -> None:
        """Put the header in front of a shard's data and move it to `dest`."""
        header = {"__metadata__": {"format": "mlx"}, **shard["header"]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        room = self.header_reserve - 8
        # The usual case: fill the reserved room, no data moves. A shard whose padding would be
        # out of proportion to its data (more than the data, or than MAX_PADDING and 1/PAD_RATIO
        # of it: a small build, a short last shard) is copied instead: few bytes to copy, and
        # no padding.
        pad, data = room - len(raw), shard["size"]
        if 0 <= pad <= min(data, max(MAX_PADDING, data // PAD_RATIO)):
            with open(shard["file"], "r+b") as f:
                f.write(room.to_bytes(8, "little"))
                f.write(raw + b" " * (room - len(raw)))
            shard["file"].rename(dest)
            return
        raw += b" " * (-len(raw) % 8)  # too long: a new file, the data copied after it
        with open(dest, "wb") as out, open(shard["file"], "rb") as data:
            out.write(len(raw).to_bytes(8, "little"))
            out.write(raw)
            data.seek(self.header_reserve)
            shutil.copyfileobj(data, out, 64 << 20)
        shard["file"].unlink()

    def close(self) -> dict[str, str]:
        """Write the shards' headers and `model.safetensors.index.json`; returns the weight
        map."""
        if self._f:
            self._f.close()
            self._f = None
        n = len(self.shards)
        weight_map, total = {}, 0
        for i, shard in enumerate(self.shards):
            fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            self._finish(shard, self.folder / fname)
            for k in shard["header"]:
                weight_map[k] = fname
            total += shard["size"]
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return weight_map


def save_weights(folder: Path, weights: Iterable[tuple[str, mx.array]],
                 shard_bytes: int = DEFAULT_SHARD_BYTES,
                 on_bytes: Callable[[int], None] | None = None,
                 header_reserve: int | None = None,
                 expected_bytes: int | None = None) -> dict[str, str]:
    """Write `weights` as safetensors shards plus the index into `folder` (meant to be an
    `atomic_dir`), one tensor in memory at a time, each byte written once; `on_bytes` is told
    each tensor's size (progress bars); `header_reserve`: see ShardWriter (None: sized from
    `shard_bytes`, or from `expected_bytes`, about what all of `weights` comes to, when that
    is less). Returns the weight map."""
    writer = ShardWriter(folder, shard_bytes, header_reserve, expected_bytes)
    for name, arr in weights:
        writer.add(name, arr)
        if on_bytes is not None:
            on_bytes(arr.nbytes)
    return writer.close()


def copy_tokenizer(src: Path, dst: Path) -> dict[str, list[str]]:
    """Copy the tokenizer files, JSON ones without remote-code keys; returns {file: keys
    removed} for the files that had some."""
    removed = {}
    for name in TOKENIZER_FILES:
        if not (src / name).is_file():
            continue
        if name.endswith(".json"):
            try:
                data = json.loads((src / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = None  # not ours to judge: copied as it is
            clean, keys = strip_remote_code(data)
            if keys:
                (dst / name).write_text(json.dumps(clean, indent=2, ensure_ascii=False),
                                        encoding="utf-8")
                removed[name] = keys
                continue
        shutil.copyfile(src / name, dst / name)  # not copy2: keep no read-only modes
    return removed


def save_model(model, config: dict, out: Path, *, src: Path | None = None,
               quantization: dict | None = None, force: bool = False,
               extra_files: dict[str, str] | None = None) -> Path:
    """Save a loaded model as an MLX checkpoint (atomic)."""
    with atomic_dir(out, force=force) as tmp:
        params = dict(unfused_parameters(model))  # the checkpoint's names, fused or not
        save_weights(tmp, params.items(),
                     expected_bytes=sum(v.nbytes for v in params.values()))
        (tmp / "config.json").write_text(json.dumps(mlx_config(config, quantization), indent=2))
        if src is not None:
            copy_tokenizer(src, tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(out)
