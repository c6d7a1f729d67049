"""SiLU-and-mul of the gated MLP on Triton kernels: out = silu(gate) * up, with gate
and up the two halves of each row of the fused gate_up projection's output, computed in
float32 and rounded once, as the compiled SiluAndMul (layers/activation.py) and the
gated GEMV (kernels/gemv.py) do. silu_mul is the formula the gated GEMV and the fused MoE
kernel share.

    out = silu_and_mul(x)                          program (row, column block)
    q, scales = silu_and_mul(x, quantize=True)     FP8 for a per-channel down_proj, a scale per row
    out = silu_and_mul(split_sum)                  x a projection's SplitSum (kernels/split_gemm.py)

Quantized, the output is bit for bit the plain one put through quantize_activations(., N).
A scale per row needs the whole row: up to _BLOCKED_ROWS rows (and rows wider than
_MAX_ROW_PROGRAM) two kernels over (row, column block), the output with each block's max
|value| and then the blocks quantized, and a row a program beyond. A SplitSum is summed as
it is loaded and rounded to its dtype first.

The quantizing forms are not PDL-launched: with PDL on SiLU-and-mul, the quantizer and the
decode GEMM, the FP8 8B workload ran slower (benchmarks/RESULTS.md, session 21). The
SplitSum form is: the split GEMM after it (down_proj) fetches its weight tiles while it runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import fp8_scale, store_fp8_row, to_fp8
from nanovllm.kernels.launch import launch
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.kernels.split_gemm import SplitSum, kernel_args, load_output
from nanovllm.utils.fp8 import FP8_DTYPE, FP8_MAX

_BLOCK = 1024
# Columns a program on a SplitSum, whose every column is read from each split: twice the
# programs (RESULTS.md, session 31).
_SPLIT_BLOCK = 512
# The quantizing form for decode batches of up to _BLOCKED_ROWS rows: a pair of kernels over
# column blocks of _QUANTIZED_BLOCK, because a row a program left most SMs idle there and
# was slower at every such batch (RESULTS.md, session 39). More rows (prefill) fill the SMs
# a row a program, without the pair's round trip of the output through memory, as do rows
# of up to _MAX_ROW_PROGRAM columns (one warp per 128, up to 32; wider rows always take the
# pair).
_BLOCKED_ROWS = 256
_QUANTIZED_BLOCK = 1024
_MAX_ROW_PROGRAM = 32768


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up on float32 values."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, split_stride, N: tl.constexpr, BLOCK: tl.constexpr,
                         SPLITS: tl.constexpr, PDL: tl.constexpr):
    """SPLITS > 0: x is a SplitSum's parts, rounded to out's dtype once summed."""
    if PDL:  # launched early (kernels/pdl.py): the split GEMM after it fetches its weights meanwhile
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    gate = load_output(x_ptr + row * x_stride, cols, ok, dtype, SPLITS, split_stride)
    up = load_output(x_ptr + row * x_stride + N, cols, ok, dtype, SPLITS, split_stride)
    tl.store(out_ptr + row * N + cols, silu_mul(gate.to(tl.float32), up.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _silu_and_mul_quantize_kernel(x_ptr, q_ptr, scale_ptr, x_stride, N: tl.constexpr, NP: tl.constexpr,
                                  FP8_MAX: tl.constexpr):
    """Program (row): the whole row's output at once (its loads all in flight together),
    rounded as silu_and_mul rounds it, then quantize_activations' arithmetic on it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, NP)
    ok = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=ok, other=0.0)
    y = silu_mul(gate.to(tl.float32), up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    store_fp8_row(y, q_ptr + row * N + cols, ok, scale_ptr + row, FP8_MAX)


@triton.jit
def _silu_and_mul_amax_kernel(x_ptr, y_ptr, amax_ptr, x_stride, N, BLOCKS, BLOCK: tl.constexpr):
    """Program (row, column block): the output, rounded as _silu_and_mul_kernel rounds it, to
    y, and its block's largest |value| to amax [row, block]."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=ok, other=0.0)
    y = silu_mul(gate.to(tl.float32), up.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * N + cols, y, mask=ok)
    tl.store(amax_ptr + row * BLOCKS + block, tl.max(tl.abs(y.to(tl.float32)), axis=0))


@triton.jit
def _quantize_blocks_kernel(y_ptr, amax_ptr, q_ptr, scale_ptr, N, BLOCKS, BLOCK: tl.constexpr, BLOCKS_P: tl.constexpr,
                            FP8_MAX: tl.constexpr):
    """Program (row, column block): the row's scale from its blocks' maxima, then the block
    quantized as quantize_activations quantizes a per-token group (block 0 stores the scale)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    blocks = tl.arange(0, BLOCKS_P)
    amax = tl.max(tl.load(amax_ptr + row * BLOCKS + blocks, mask=blocks < BLOCKS, other=0.0), axis=0)
    scale = fp8_scale(amax, FP8_MAX)
    if block == 0:
        tl.store(scale_ptr + row, scale)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    y = tl.load(y_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * N + cols, to_fp8(tl.div_rn(y, scale), q_ptr.dtype.element_ty, FP8_MAX), mask=ok)


def silu_and_mul(x: torch.Tensor | SplitSum, quantize: bool = False):
    """x [M, 2N] = [gate | up] with unit stride in its last dimension; returns [M, N], or
    with quantize (FP8 [M, N], fp32 scales [M, 1]). x may be a SplitSum (not quantized)."""
    if isinstance(x, SplitSum):
        if quantize:
            raise ValueError("silu_and_mul does not quantize a SplitSum")
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.parts.device)
        first, splits, split_stride = kernel_args(x)
        _plain(first, out, splits, split_stride)
        return out
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul takes x [M, 2N] with unit stride in its last dimension, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    rows, n = x.shape[0], x.shape[1] // 2
    if quantize and not n:
        raise ValueError("silu_and_mul quantizes rows of at least one value")
    out = torch.empty(rows, n, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    if not quantize:
        _plain(x, out)
        return out
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    np2 = triton.next_power_of_2(n)
    if rows > _BLOCKED_ROWS and np2 <= _MAX_ROW_PROGRAM:
        launch(_silu_and_mul_quantize_kernel, (rows,), x, out, scales, x.stride(0), N=n, NP=np2, FP8_MAX=FP8_MAX,
               num_warps=max(4, min(32, np2 // 128)))
    elif rows:
        blocks = triton.cdiv(n, _QUANTIZED_BLOCK)
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        amax = torch.empty(rows, blocks, dtype=torch.float32, device=x.device)
        launch(_silu_and_mul_amax_kernel, (rows, blocks), x, y, amax, x.stride(0), n, blocks,
               BLOCK=_QUANTIZED_BLOCK, num_warps=4)
        launch(_quantize_blocks_kernel, (rows, blocks), y, amax, out, scales, n, blocks, BLOCK=_QUANTIZED_BLOCK,
               BLOCKS_P=triton.next_power_of_2(blocks), FP8_MAX=FP8_MAX, num_warps=4)
    return out, scales


def _plain(x: torch.Tensor, out: torch.Tensor, splits: int = 0, split_stride: int = 0) -> None:
    """_silu_and_mul_kernel from x (a SplitSum's parts where splits > 0, then PDL-launched) to out [M, N]."""
    rows, n = out.shape
    if rows and n:
        pdl = splits > 0 and pdl_enabled(out.device)
        block = _SPLIT_BLOCK if splits else _BLOCK
        launch(_silu_and_mul_kernel, (rows, triton.cdiv(n, block)), x, out, x.stride(0), split_stride, N=n,
               BLOCK=block, SPLITS=splits, PDL=pdl, num_warps=4, **launch_options(pdl))
