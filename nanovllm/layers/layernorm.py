"""RMSNorm, with the residual add fused in (one pass over the hidden states). Where
layers/kernel_plan.py called `use_kernel` (the Triton kernels), every batch goes to
kernels/rmsnorm.py; the torch backend runs the compiled torch ops."""
import sys

import torch
from torch import nn

from nanovllm.layers.linear import LinearBase, fits_small_batch
from nanovllm.layers.quantization import QuantizedInput
from nanovllm.utils.compile import maybe_compile


class RMSNorm(nn.Module):
    kernel_rows = 0  # the most rows that go to kernels/rmsnorm.py: none until use_kernel
    quantize = False  # the kernel's output quantized for an FP8 projection (quantize_for)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    @maybe_compile
    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    @maybe_compile
    def add_rms_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = x.dtype
        x = x.float() + residual.float()
        residual = x.to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight, residual

    def use_kernel(self) -> None:
        """Every batch on kernels/rmsnorm.py."""
        from nanovllm.kernels.rmsnorm import rms_norm  # Triton only where its kernels run

        self._rms_norm, self.kernel_rows = rms_norm, sys.maxsize

    def quantize_for(self, linear: LinearBase) -> None:
        """Where the kernel runs, hand `linear` (the norm's one consumer) its input already
        quantized (a QuantizedInput) if it takes one: one kernel where there were two."""
        self.quantize = self.kernel_rows > 0 and linear.takes_quantized_input()

    def forward(self, x, residual: torch.Tensor | None = None):
        """x: a tensor, or a projection's SplitSum (kernels/split_gemm.py, which the kernel
        sums as it loads it, with the residual add)."""
        if not isinstance(x, torch.Tensor):  # a SplitSum
            if (residual is not None and residual.stride(-1) == 1 and x.shape[0] <= self.kernel_rows
                    and not self.quantize):
                return self._rms_norm(x, self.weight, self.eps, residual)
            x = x.dense()
        if fits_small_batch(x, self.kernel_rows) and (residual is None or residual.stride(-1) == 1):
            if self.quantize:
                out = self._rms_norm(x, self.weight, self.eps, residual, quantize=True)
                if residual is None:
                    return QuantizedInput(*out, x.dtype)
                (q, scales), residual = out
                return QuantizedInput(q, scales, x.dtype), residual
            return self._rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)
