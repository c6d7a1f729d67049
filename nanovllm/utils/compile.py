"""torch.compile for the small element-wise ops, switched on per engine.

The layers decorate their hot functions with `maybe_compile`; the ModelRunner turns
compilation on where a CUDA-graph step runs one of them (compile_needed: not with the
Triton kernels). Off (on CPU, with enforce_eager, with the
Triton kernels), the plain function runs. Compiling fuses each op's handful of
element-wise kernels (casts, square, mean, rsqrt, multiply) into one, which matters at
decode batch sizes where these ops are memory-bound and launch-bound.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch


F = TypeVar("F", bound=Callable)

_enabled = False


def compile_needed(use_graphs: bool, fused_attention: bool, sampler_kernel: bool) -> bool:
    """Whether an engine turns maybe_compile on: with CUDA graphs, where a step runs
    through a compiled function (the q/k split of an attention backend that does not fuse
    it into its kernel, the sampler's filtered paths without their Triton kernel). The Triton
    kernels take every norm and SiLU-and-mul (the same throughput as compiling them, a start-up
    without torch.compile: benchmarks/RESULTS.md, session 16), and only the start-up's prefills,
    run before the KV cache exists, take the unfused split: compiling it would serve no later
    step and import torch._dynamo (session 18)."""
    return use_graphs and (not fused_attention or not sampler_kernel)


def set_compile_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def compile_enabled() -> bool:
    return _enabled


def maybe_compile(fn: F) -> F:
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if not _enabled or torch.compiler.is_compiling():  # inside a compiled caller: trace through
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
