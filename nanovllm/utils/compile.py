"""torch.compile for the small element-wise ops, switched on per engine.

The layers decorate their hot functions with `maybe_compile`; the ModelRunner turns
compilation on where a CUDA-graph step runs one of them (compile_needed: not with the
Triton kernels, unless an A/B switch asks). Off (on CPU, with enforce_eager, with the
Triton kernels), the plain function runs. Compiling fuses each op's handful of
element-wise kernels (casts, square, mean, rsqrt, multiply) into one, which matters at
decode batch sizes where these ops are memory-bound and launch-bound.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

from nanovllm.utils.env import env_flag

F = TypeVar("F", bound=Callable)

_enabled = False


def torch_compile_wanted() -> bool:
    """Where the Triton kernels run, the norms and SiLU-and-mul take kernels/rmsnorm.py and
    activation.py at every batch size and torch compiles nothing: the same throughput as
    compiling them, start-up without torch.compile (benchmarks/RESULTS.md, session 16).
    NANOVLLM_TORCH_COMPILE=1 compiles SiLU-and-mul, and the norms of more rows than the
    GEMV kernels take, instead (an A/B switch; layers/kernel_plan.py)."""
    return env_flag("NANOVLLM_TORCH_COMPILE", False)


def compile_needed(use_graphs: bool, fused_attention: bool, sampler_kernel: bool) -> bool:
    """Whether an engine turns maybe_compile on: with CUDA graphs, where a step runs
    through a compiled function (the q/k split of an attention backend that does not fuse
    it into its kernel, the sampler's filtered paths without their Triton kernel) or
    torch_compile_wanted() asks for the compiled norms. With the Triton kernels only the
    start-up's prefills, run before the KV cache exists, take the unfused split: compiling
    it would serve no later step and import torch._dynamo (benchmarks/RESULTS.md, session 18)."""
    return use_graphs and (not fused_attention or not sampler_kernel or torch_compile_wanted())


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
