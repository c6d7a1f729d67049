"""Every Triton kernel launch goes through `launch`, so that start-up can compile the kernels'
variants side by side before it runs them.

A machine's first start compiles ~30 kernel variants (shapes, batch sizes, launch options),
one after another as each is first launched. Inside `precompiling()`, a launch only
queues its variant's compile (Triton's `warmup` under its AsyncCompileMode: once per
variant, on a thread pool, where Triton's compiler runs mostly without the interpreter
lock): start-up walks the forward passes it is about to capture, and the real runs then
find every variant compiled. The walk's other work (cuBLAS, torch ops) runs on whatever
the skipped kernels left in their outputs, which is why only code that never reads device
values on the host (what CUDA graphs capture) is walked.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from nanovllm.utils.env import env_flag

_precompiling = False


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs); inside precompiling(), its variant's compile, queued instead."""
    if _precompiling:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def precompile_wanted() -> bool:
    """NANOVLLM_PRECOMPILE=1: compile the start-up's kernels side by side first (off by
    default: a cold start gained 2.7 s once, RESULTS.md session 17, a warm one is not measured)."""
    return env_flag("NANOVLLM_PRECOMPILE", False)


def async_compile_mode():
    """Triton's own deferred compiles (3.6 and later), or None. Imported here, not with this
    module: a CPU engine never imports Triton."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


@contextmanager
def precompiling(threads: int | None = None):
    """Launches inside queue their variants' compiles on `threads` threads (default: the
    CPUs, up to 16) instead of running; on leaving, waits for every compile and raises the
    first one's error. Without Triton's AsyncCompileMode the launches simply run."""
    global _precompiling
    if _precompiling:
        raise RuntimeError("precompiling() is already active")
    AsyncCompileMode = async_compile_mode()
    if AsyncCompileMode is None:
        yield
        return
    with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1), thread_name_prefix="nanovllm-compile") as pool:
        with AsyncCompileMode(pool):
            _precompiling = True
            try:
                yield
            finally:
                _precompiling = False
