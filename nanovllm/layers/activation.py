"""SiLU-and-mul: the gated MLP's activation on the fused gate_up projection; compiled by
torch, or on kernels/activation.py (use_kernel), which can quantize its output for an FP8
down_proj (quantize_for)."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import LinearBase
from nanovllm.layers.quantization import QuantizedInput
from nanovllm.utils.compile import maybe_compile


class SiluAndMul(nn.Module):
    kernel = None  # kernels/activation.py's silu_and_mul once use_kernel() is called
    quantize = False  # the kernel's output quantized for an FP8 projection (quantize_for)

    def use_kernel(self) -> None:
        """Run on the Triton kernel instead of the compiled torch ops."""
        from nanovllm.kernels.activation import silu_and_mul  # Triton only where its kernels run

        self.kernel = silu_and_mul

    def quantize_for(self, linear: LinearBase) -> None:
        """Where the kernel runs, hand `linear` (down_proj) its input already quantized (a
        QuantizedInput) if it takes one: no quantizer launched between them."""
        self.quantize = self.kernel is not None and linear.takes_quantized_input()

    def forward(self, x) -> torch.Tensor | QuantizedInput:
        # x: [num_tokens, 2 * intermediate] = [gate | up], or a projection's SplitSum
        # (kernels/split_gemm.py), which the kernel sums as it loads it
        if not isinstance(x, torch.Tensor):
            if self.kernel is not None and not self.quantize:
                return self.kernel(x)
            x = x.dense()
        if self.kernel is not None and x.dim() == 2 and x.stride(-1) == 1:
            if self.quantize:
                return QuantizedInput(*self.kernel(x, quantize=True), x.dtype)
            return self.kernel(x)
        return self.silu_and_mul(x)

    @staticmethod
    @maybe_compile
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
