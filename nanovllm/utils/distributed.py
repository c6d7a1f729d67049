"""Tensor-parallel process groups.

Each engine owns one group: rank 0 in the main process, ranks 1..N-1 in its worker
processes. The group is built straight on a TCPStore instead of through
torch.distributed's default group, which is one per process: two engines (and a
tensor_parallel_size 1 engine next to a sharded one) can then live in one process.

Layers take the group that is current while the model is built (`use_tp_group`) and
keep it; a model built outside any group is whole (rank 0 of 1) and never communicates.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a gloo collective may wait for its peers before it fails. A dead peer is
# noticed at once (its socket closes); this only bounds a peer that hangs alive.
GLOO_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's rank among `size` ranks, and the process group joining them."""

    rank: int = 0
    size: int = 1
    pg: dist.ProcessGroup | None = None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """Reduce `tensor` over all ranks, in place."""
        if self.pg is None:
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.pg.allreduce([tensor], opts).wait()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape on all), in rank order, on rank 0; None elsewhere."""
        if self.pg is None:
            return [tensor]
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather(outputs, [tensor], opts).wait()
        return outputs[0] if self.rank == 0 else None

    def shutdown(self, abort: bool = False) -> None:
        """Release the process group; `abort` does not wait for peers (after a failure)."""
        if self.pg is not None:
            if abort:
                self.pg.abort()
            else:
                self.pg.shutdown()


SINGLE_RANK = TPGroup()
_current = SINGLE_RANK


def create_tp_group(store: dist.Store, rank: int, size: int, device: torch.device) -> TPGroup:
    """Join the `size` ranks meeting at `store` (every rank calls this; it returns once all have)."""
    if device.type == "cuda":
        pg = dist.ProcessGroupNCCL(store, rank, size)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, GLOO_TIMEOUT)
    return TPGroup(rank, size, pg)


@contextmanager
def use_tp_group(group: TPGroup) -> Iterator[None]:
    """Make `group` the one layers built inside the block belong to."""
    global _current
    previous, _current = _current, group
    try:
        yield
    finally:
        _current = previous


def get_tp_group() -> TPGroup:
    return _current


def get_tp_size() -> int:
    return _current.size
