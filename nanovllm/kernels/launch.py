"""Every Triton kernel launch goes through `launch`, so that start-up can compile the kernels'
variants on a thread pool before it runs them.

A machine's first start compiles ~30 kernel variants (shapes, batch sizes, launch options),
one after another as each is first launched. Inside `precompiling()`, a launch compiles
its variant on a thread pool instead of running it (Triton's `warmup`): start-up walks the
forward passes it is about to capture with the kernels compiling side by side, and the
real runs then find them compiled. The walk's other work (cuBLAS, torch ops) runs on
whatever the skipped kernels left in their outputs, which is why only code that never
reads device values on the host (what CUDA graphs capture) is walked.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import torch

from nanovllm.utils.env import env_int

_pool: ThreadPoolExecutor | None = None
_pending: list[Future] = []


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs); inside precompiling(), its compile, queued instead."""
    if _pool is None:
        kernel[grid](*args, **kwargs)
        return
    # A thread starts on device 0: compile for this thread's device.
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    _pending.append(_pool.submit(_warm_up, device, kernel, grid, args, kwargs))


def _warm_up(device: int | None, kernel, grid, args, kwargs) -> None:
    with torch.cuda.device(device) if device is not None else nullcontext():
        kernel.warmup(*args, grid=grid, **kwargs)


def precompile_wanted() -> bool:
    """NANOVLLM_PRECOMPILE=1: compile the start-up's kernels on a thread pool first (an A/B
    switch while it is measured; default 0)."""
    return env_int("NANOVLLM_PRECOMPILE", 0, least=0) != 0


@contextmanager
def precompiling(threads: int | None = None):
    """Launches inside compile on `threads` threads (default: the CPUs, up to 16) instead of
    running; on leaving, waits for every compile and raises the first one's error."""
    global _pool
    if _pool is not None:
        raise RuntimeError("precompiling() is already active")
    _pool = ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1), thread_name_prefix="nanovllm-compile")
    try:
        yield
    finally:
        pool, _pool = _pool, None
        pending, _pending[:] = list(_pending), []
        pool.shutdown(wait=True)
    for future in pending:
        future.result()
