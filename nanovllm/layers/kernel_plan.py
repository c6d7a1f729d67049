"""Which layers run on the Triton kernels, decided once for a loaded model (the ModelRunner
calls use_triton_kernels where config.kernels is "triton": on CUDA whatever the attention
backend, and on CPU under the interpreter with the Triton attention):

- the projections (LinearBase.use_small_batch_kernels): decode batches on kernels/gemv.py,
  split_gemm.py and wide_gemm.py by their rows (layers/linear.py has the map);
  NANOVLLM_GEMV=0 keeps cuBLAS for every projection, for A/B measurements;
- every RMSNorm and SiLU-and-mul on kernels/rmsnorm.py and activation.py, at every batch size;
- then, where a projection takes FP8 inputs, the norm or SiLU-and-mul before it quantizes
  what it writes (quantize_in_kernels: it must know both kernels first).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import LinearBase
from nanovllm.utils.env import env_flag


@runtime_checkable
class QuantizesInKernels(Protocol):
    """A block whose norm or SiLU-and-mul can quantize for the FP8 projection it feeds
    (models/llama.py's LlamaDecoderLayer)."""

    def quantize_in_kernels(self) -> None: ...


def use_triton_kernels(model: nn.Module) -> None:
    """Switch model's layers to the Triton kernels as the module docstring says."""
    gemv = env_flag("NANOVLLM_GEMV", True)
    for layer in model.modules():
        if isinstance(layer, LinearBase) and gemv:
            layer.use_small_batch_kernels()
        elif isinstance(layer, (RMSNorm, SiluAndMul)):
            layer.use_kernel()
    for layer in model.modules():  # once every norm and activation has its kernel
        if isinstance(layer, QuantizesInKernels):
            layer.quantize_in_kernels()
