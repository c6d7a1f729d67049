"""What the decode graphs (executor/cuda_graph.py) and the prefill graphs (executor/
piecewise.py) capture the same way: one function into one CUDA graph in a shared memory
pool, or, without graphs (CPU, tests), the same function kept as plain calls."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

from nanovllm.utils.env import env_flag

if TYPE_CHECKING:
    from nanovllm.config import Config


def plain_call_graphs(device: torch.device) -> bool:
    """Whether the decode graphs run as plain calls over their buffers, packing and padding
    on this CPU device, as CUDA replays them (NANOVLLM_PLAIN_CALL_GRAPHS=1, read by every
    rank as it starts: tests, and a CPU check of the graph path)."""
    return device.type == "cpu" and env_flag("NANOVLLM_PLAIN_CALL_GRAPHS", False)


class GraphPlan(NamedTuple):
    """Which graphs a runner builds (the model's and the draft's decide alike, graph_plan)."""

    graphs: bool  # CUDA graphs; else the graphs built run as plain calls over their buffers
    decode: bool  # decode graphs
    prefill_tokens: int  # the prefill graphs' largest bucket; 0: none


def graph_plan(config: Config, device: torch.device, auto_prefill_tokens: int) -> GraphPlan:
    """CUDA graphs on CUDA unless enforce_eager. On a CPU, plain calls: decode graphs where
    plain_call_graphs, prefill graphs where max_prefill_graph_tokens asks for them. That
    argument's -1 (auto) is auto_prefill_tokens where CUDA graphs run, else 0; a step takes
    at most max_num_batched_tokens."""
    graphs = device.type == "cuda" and not config.enforce_eager
    decode = graphs or plain_call_graphs(device) and not config.enforce_eager
    tokens = config.max_prefill_graph_tokens
    if tokens < 0:
        tokens = auto_prefill_tokens if graphs else 0
    return GraphPlan(graphs, decode, 0 if config.enforce_eager else min(tokens, config.max_num_batched_tokens))


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
