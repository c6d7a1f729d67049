"""Tensor-parallel process groups.

Each engine owns one group: rank 0 in the main process, ranks 1..N-1 in its worker
processes. The group is built straight on a TCPStore instead of through
torch.distributed's default group, which is one per process: two engines (and a
tensor_parallel_size 1 engine next to a sharded one) can then live in one process.

Layers take the group that is current while the model is built (`use_tp_group`) and
keep it; a model built outside any group is whole (rank 0 of 1) and never communicates.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.utils.build_setting import BuildSetting

logger = logging.getLogger(__name__)

# How long a gloo collective may wait for its peers before it fails. A dead peer is
# noticed at once (its socket closes); this only bounds a peer that hangs alive.
GLOO_TIMEOUT = timedelta(minutes=10)
# How long shutting a group down may take before it is left to process exit.
TEARDOWN_TIMEOUT_S = 10.0


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

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape on all), in place."""
        if self.pg is None:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape on all), in rank order, on rank 0; None elsewhere."""
        if self.pg is None:
            return [tensor]
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather(outputs, [tensor], opts).wait()
        return outputs[0] if self.rank == 0 else None

    def shutdown(self, abort: bool = False, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
        """Release the process group; `abort` does not wait for peers (after a failure).

        NCCL groups are always aborted (with nothing in flight, as at every shutdown here, a
        local teardown): NCCL's own shutdown finalizes the communicator together with the
        peers. Either can still block, on a peer or on work a CUDA graph holds, so the
        teardown runs in a daemon thread and is given up on after `timeout_s`, with a
        warning: a stuck communicator must not hang the engine's shutdown, and the process's
        exit reclaims it."""
        if self.pg is None:
            return
        teardown = self.pg.abort if abort or self.pg.name() == "nccl" else self.pg.shutdown
        thread = threading.Thread(target=teardown, name="nanovllm-tp-teardown", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("rank %d: the %s process group did not tear down within %.0f s; leaving it to process exit",
                           self.rank, self.pg.name(), timeout_s)


SINGLE_RANK = TPGroup()
_CURRENT = BuildSetting(SINGLE_RANK)
use_tp_group = _CURRENT.use  # make a group the one layers built inside the block belong to


def create_tp_group(store: dist.Store, rank: int, size: int, device: torch.device) -> TPGroup:
    """Join the `size` ranks meeting at `store` (every rank calls this; it returns once all have)."""
    if device.type == "cuda":
        pg = dist.ProcessGroupNCCL(store, rank, size)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, GLOO_TIMEOUT)
    return TPGroup(rank, size, pg)


def get_tp_group() -> TPGroup:
    return _CURRENT.value


def get_tp_size() -> int:
    return _CURRENT.value.size
