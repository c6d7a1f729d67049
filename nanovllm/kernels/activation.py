"""SiLU-and-mul of the gated MLP as one Triton kernel: out = silu(gate) * up, with gate
and up the two halves of each row of the fused gate_up projection's output, computed in
float32 and rounded once, as the compiled SiluAndMul (layers/activation.py) and the
gated GEMV (kernels/gemv.py) do. Program (row, column block). silu_mul is the formula
the gated GEMV and the fused MoE kernel share."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up on float32 values."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * N + cols, silu_mul(gate.to(tl.float32), up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2N] = [gate | up] with unit stride in its last dimension; returns [M, N]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul takes x [M, 2N] with unit stride in its last dimension, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        launch(_silu_and_mul_kernel, (rows, triton.cdiv(n, _BLOCK)), x, out, x.stride(0), N=n, BLOCK=_BLOCK, num_warps=4)
    return out
