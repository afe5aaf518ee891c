"""Joining the group: the environment `mlx.launch` (or `use_hostfile`) sets, and `init`.

A rank that never connects ends the others after `--distributed-timeout` seconds with one line
(the watchdog: MLX's ring has no timeout of its own); every other failure to start is raised as
a `DistributedError`.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx

from pocket_mlx.engine.distributed.group import (
    DEFAULT_TIMEOUT_S,
    MODES,
    DistributedError,
    Group,
)
from pocket_mlx.engine.distributed.watchdog import Watchdog

_LAUNCH_ENV = ("MLX_HOSTFILE", "MLX_RANK", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_RANK",
               "NCCL_HOST_IP")

RING_PORT = 32323  # mlx.launch's default --starting-port


def use_hostfile(path: str, rank: int) -> str | None:
    """Join a ring without mlx.launch (`chat --distributed --hostfile F --rank R`): set the two
    variables MLX's ring backend reads, as mlx.launch would (MLX_RANK, and MLX_HOSTFILE: a JSON
    list, one entry per rank, of that rank's "ip:port" strings). `path` holds either that list
    or mlx.launch's own hostfile ([{"ssh": ..., "ips": [...]}, ...]), whose ports are numbered
    as mlx.launch numbers them (from 32323, one per host in order). Returns the temporary
    file written for the latter (remove it once `init` has joined), else None."""
    import tempfile
    from pathlib import Path

    try:
        hosts = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DistributedError(f"--hostfile {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise DistributedError(f"--hostfile {path} is not valid JSON: {e}") from None
    ring = None
    if isinstance(hosts, list) and len(hosts) >= 2:
        if all(isinstance(h, list) and h and all(isinstance(a, str) and ":" in a for a in h)
               for h in hosts):
            ring = hosts
        elif all(isinstance(h, dict) and h.get("ips") for h in hosts):
            ring = [[f"{h['ips'][0]}:{RING_PORT + i}"] for i, h in enumerate(hosts)]
    if ring is None:
        raise DistributedError(f"--hostfile {path}: expected a list of 2 or more hosts, either "
                               '[["10.10.0.1:32323"], ["10.10.0.2:32323"]] (the ring\'s own) or '
                               '[{"ssh": "mini1.local", "ips": ["10.10.0.1"]}, ...] '
                               "(mlx.launch's)")
    if not 0 <= rank < len(ring):
        raise DistributedError(f"--rank {rank}: the hostfile has {len(ring)} hosts, so 0 to "
                               f"{len(ring) - 1}")
    temp = None
    if ring is hosts:
        target = os.path.abspath(path)
    else:  # MLX reads the file when the group starts; a temporary copy in the ring's format
        fd, target = tempfile.mkstemp(prefix="pocket-mlx-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(ring, f)
        temp = target
    os.environ["MLX_HOSTFILE"] = target
    os.environ["MLX_RANK"] = str(rank)
    return temp


def launch_rank() -> int | None:
    """This process's rank as its launcher set it (None: not launched for a distributed run)."""
    if not any(os.environ.get(k) for k in _LAUNCH_ENV):
        return None
    for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(k, "").strip().isdigit():
            return int(os.environ[k])
    return 0


def init(mode: str, timeout: float = DEFAULT_TIMEOUT_S) -> Group:
    """Join the group `mlx.launch` started (its environment says where the peers are). Exits
    with one line after `timeout` seconds when a peer never connects."""
    if mode not in MODES:
        raise DistributedError(f"unknown --distributed mode {mode!r}: use pipeline or experts")
    if timeout <= 0:
        raise DistributedError(f"--distributed-timeout must be > 0 seconds, got {timeout}")
    if not any(os.environ.get(k) for k in _LAUNCH_ENV):
        raise DistributedError("--distributed runs under mlx.launch, e.g. `mlx.launch -n 2 "
                               "--backend ring -- $(which python) -m pocket_mlx generate "
                               f"--distributed {mode} ...` (see docs/DISTRIBUTED.md)")
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    dog = Watchdog(rank)
    dog.arm(timeout, f"the other ranks did not connect within {timeout:g} s (--distributed-"
                     "timeout); is every rank started, with the same hostfile?")
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: cannot join the distributed group: {e}") from None
    finally:
        dog.disarm()
    g = Group(mode, group, timeout, dog, group.rank(), group.size())
    dog.rank = g.rank
    if g.size < 2:
        raise DistributedError("--distributed needs at least 2 ranks (mlx.launch -n 2 or a "
                               "hostfile with 2 hosts)")
    return g
