"""kernels/launch.py: a launch runs the kernel; inside precompiling() it queues the
kernel's variant's compile instead (Triton's warmup, under Triton's AsyncCompileMode: once
per variant, on a thread pool). The engine's pre-compile pass on CUDA
(NANOVLLM_PRECOMPILE=1, ModelRunner._precompile) is checked in the GPU check
(tests/executor/test_gpu.py, the triton_precompiled variant)."""
from __future__ import annotations

import pytest

from nanovllm.kernels import launch as launch_module
from nanovllm.kernels.launch import launch, precompiling


class FakeKernel:
    """Records launches (kernel[grid](...)) and warm-ups (kernel.warmup(..., grid=...))."""

    def __init__(self):
        self.launched, self.warmed = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((grid, args, kwargs))


def test_a_launch_runs_the_kernel_outside_precompiling():
    kernel = FakeKernel()
    launch(kernel, (4, 2), 1, "x", BLOCK=16, num_warps=4)
    assert kernel.launched == [((4, 2), (1, "x"), {"BLOCK": 16, "num_warps": 4})] and not kernel.warmed


@pytest.mark.skipif(launch_module.async_compile_mode() is None, reason="this Triton has no AsyncCompileMode")
def test_inside_precompiling_launches_queue_their_compiles_instead():
    kernel = FakeKernel()
    with precompiling(threads=2):
        for n in range(3):
            launch(kernel, (n,), n, BLOCK=16, num_warps=4)
        with pytest.raises(RuntimeError, match="already active"):
            with precompiling(threads=1):
                pass
    assert kernel.warmed == [((n,), (n,), {"BLOCK": 16, "num_warps": 4}) for n in range(3)]
    assert not kernel.launched
    launch(kernel, (1,), 0)  # afterwards launches run again
    assert len(kernel.launched) == 1


def test_without_async_compiles_precompiling_lets_launches_run(monkeypatch):
    monkeypatch.setattr(launch_module, "async_compile_mode", lambda: None)
    kernel = FakeKernel()
    with precompiling():
        launch(kernel, (2,), 7)
    assert kernel.launched == [((2,), (7,), {})] and not kernel.warmed
