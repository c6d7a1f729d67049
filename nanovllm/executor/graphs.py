"""What the decode graphs (executor/cuda_graph.py) and the prefill graphs (executor/
piecewise.py) capture the same way: one function into one CUDA graph in a shared memory
pool, or, without graphs (CPU, tests), the same function kept as plain calls."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from nanovllm.utils.env import env_flag


def plain_call_graphs(device: torch.device) -> bool:
    """Whether the decode graphs run as plain calls over their buffers, packing and padding
    on this CPU device, as CUDA replays them (NANOVLLM_PLAIN_CALL_GRAPHS=1, read by every
    rank as it starts: tests, and a CPU check of the graph path)."""
    return device.type == "cpu" and env_flag("NANOVLLM_PLAIN_CALL_GRAPHS", False)


class EagerPiece:
    """A function that stands in for a graph: replay() calls it, with the same buffers and
    in the same order as the graph would run."""

    def __init__(self, fn: Callable[[], None]):
        self.replay = fn


Replayable = torch.cuda.CUDAGraph | EagerPiece


def capture_graph(fn: Callable[[], None], pool: tuple | None) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """fn once outside capture (Triton and torch.compile compile there, cuBLAS sets up its
    workspaces), then captured into a graph in `pool` (None: a new one). Returns the graph
    and the pool, for the next capture to share: capture the largest shapes first and the
    smaller ones reuse their memory."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        fn()
    return graph, pool if pool is not None else graph.pool()


def release_graphs(graphs: Iterable[Replayable]) -> None:
    """Free captured graphs once the device is idle. A graph that captured NCCL calls holds
    its communicator, whose teardown blocks until the graph is gone: release the graphs
    before the process group."""
    graphs = [graph for graph in graphs if isinstance(graph, torch.cuda.CUDAGraph)]
    if graphs:
        torch.cuda.synchronize()
    for graph in graphs:
        graph.reset()
