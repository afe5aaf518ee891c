"""This process's place in a distributed run (`Group`), its collectives, and its errors.

Errors are `DistributedError`s (a `PocketError`: the CLI prints one line and exits 2); a peer
gone mid-run is `RankLost`, raised from MLX's ring error ("connection to a peer was lost").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from pocket_mlx.engine.distributed.watchdog import Watchdog
from pocket_mlx.errors import PocketError

MODES = ("pipeline", "experts")
DEFAULT_TIMEOUT_S = 120.0
# Loading can take minutes on a big model, and the ranks finish at different times: the first
# collective after loading waits this much longer than the per-token watchdog.
LOAD_TIMEOUT_S = 900.0


class DistributedError(PocketError):
    """A distributed run cannot start or go on (one line, exit 2, like every PocketError)."""


class RankLost(DistributedError):
    """Another rank closed its connection (died, or was stopped) during a collective."""


@dataclass
class Group:
    """This process's place in the distributed run."""

    mode: str
    group: mx.distributed.Group
    timeout: float
    watchdog: Watchdog
    rank: int = 0
    size: int = 1
    info: dict = field(default_factory=dict)  # what the mode decided (ranges, experts)

    def barrier(self, seconds: float, what: str) -> None:
        """A tiny all_sum every rank must reach within `seconds`."""
        self.watchdog.arm(seconds, what)
        try:
            mx.eval(mx.distributed.all_sum(mx.ones(1), group=self.group, stream=mx.cpu))
        except RuntimeError as e:
            raise lost(self.rank, e) from None
        finally:
            self.watchdog.disarm()

    def broadcast_ints(self, values: list[int] | None) -> list[int]:
        """Rank 0's list of ints on every rank (the others pass None)."""
        n = mx.array([len(values) if self.rank == 0 else 0], mx.int32)
        n = int(mx.distributed.all_sum(n, group=self.group, stream=mx.cpu).item())
        a = (mx.array(values, mx.int32) if self.rank == 0 else mx.zeros((n,), mx.int32))
        return mx.distributed.all_sum(a, group=self.group, stream=mx.cpu).tolist()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's list (same length on all) on every rank, in rank order."""
        a = mx.array([values], mx.float64)  # byte counts above 2**24 stay exact
        out = mx.distributed.all_gather(a, group=self.group, stream=mx.cpu)
        return out.tolist()

    def share_token(self, y: mx.array) -> mx.array:
        """Rank 0's sampled token(s) on every rank: the ranks then feed, stop and detokenize
        alike with no further messages (in pipeline mode only rank 0 has real logits)."""
        mine = y if self.rank == 0 else mx.zeros_like(y) * y  # keeps y (and its sends) in the graph
        return mx.distributed.all_sum(mine.astype(mx.int32), group=self.group).astype(y.dtype)


def lost(rank: int, e: Exception) -> RankLost:
    return RankLost(f"rank {rank}: lost the connection to another rank ({e}); "
                       "check that every rank is running and the hosts can reach each other")
