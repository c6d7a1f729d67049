"""kernels/launch.py: a launch runs the kernel; inside precompiling() it compiles the
kernel's variant on a thread pool instead (Triton's warmup), and leaving waits for every
compile, raising the first error. The engine's pre-compile pass on CUDA
(NANOVLLM_PRECOMPILE=1, ModelRunner._precompile) is checked in the GPU check."""
from __future__ import annotations

import threading

import pytest

from nanovllm.kernels.launch import launch, precompiling


class FakeKernel:
    """Records launches (kernel[grid](...)) and warm-ups (kernel.warmup(..., grid=...))."""

    def __init__(self, fail: bool = False):
        self.launched, self.warmed, self.threads, self.fail = [], [], set(), fail

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("compile failed")
        self.warmed.append((grid, args, kwargs))


def test_a_launch_runs_the_kernel_outside_precompiling():
    kernel = FakeKernel()
    launch(kernel, (4, 2), 1, "x", BLOCK=16, num_warps=4)
    assert kernel.launched == [((4, 2), (1, "x"), {"BLOCK": 16, "num_warps": 4})] and not kernel.warmed


def test_inside_precompiling_launches_compile_on_the_pool_instead():
    kernel = FakeKernel()
    with precompiling(threads=2):
        for n in range(6):
            launch(kernel, (n,), n, BLOCK=16)
    # Every compile is done on leaving, none ran, and none on this thread.
    assert sorted(kernel.warmed) == [((n,), (n,), {"BLOCK": 16}) for n in range(6)]
    assert not kernel.launched and threading.current_thread().name not in kernel.threads
    launch(kernel, (1,), 0)  # and afterwards launches run again
    assert len(kernel.launched) == 1


def test_a_failed_compile_raises_on_leaving_and_precompiling_does_not_nest():
    with pytest.raises(RuntimeError, match="compile failed"):
        with precompiling(threads=1):
            launch(FakeKernel(fail=True), (1,))
    with precompiling(threads=1):
        with pytest.raises(RuntimeError, match="already active"):
            with precompiling(threads=1):
                pass
    kernel = FakeKernel()
    launch(kernel, (1,))  # the pool is gone either way
    assert kernel.launched
