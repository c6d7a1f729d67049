"""Projections of decode batches (up to GEMV_MAX_ROWS rows): y = x W^T (+ b), and the MLP's
gate_up projection with SiLU-and-mul in its epilogue.

At batch 1 a projection reads megabytes of weights to do a few flops per weight, and
cuBLAS's small-batch tiles stream them at about a quarter of the copy bandwidth (Qwen3-0.6B's
four projections per layer). Here each program holds one slab of BLOCK_N whole weight rows
in registers, so a launch issues all its loads at once, and with programmatic dependent
launch (PDL, Hopper) it issues them before it waits for the kernel that writes x: the next
projection's weights stream in while the one before finishes. benchmarks/bench_pdl.py
measures it (RESULTS.md, session 10).

PDL here (kernels/pdl.py): the kernel tells the next kernel it may start at once, loads its
weights and bias, and only then waits for the kernel before it to read x.

    y = gemv(x, weight, bias)                       x [M, K], weight [N, K] -> [M, N]
    y = gemv(x, gate_up, bias, gated=True)          gate_up [2 I, K] = [gate | up] -> [M, I]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.activation import silu_mul
from nanovllm.kernels.gpu import is_float_matrix
from nanovllm.kernels.launch import launch
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.utils.env import env_int

# Rows up to which the layers send projections here; each row costs a pass of CUDA-core FMAs over the program's
# slab, so where a projection's reader sums split-K tiles, those take it from
# split_gemm.SPLIT_MIN_ROWS rows (RESULTS.md, session 32).
# NANOVLLM_GEMV_MAX_ROWS (A/B measurements) moves the limit.
GEMV_MAX_ROWS = env_int("NANOVLLM_GEMV_MAX_ROWS", 8)
# Weight elements one program holds (its whole slab of rows, over all of K); a layer whose
# rows do not fit stays with cuBLAS. 8,192 elements with four warps was the best of
# 4,096-16,384 x 4-8 warps on the H200 (bench_pdl.py).
_TILE = 8192
_NUM_WARPS = 4


def supports(weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether gemv takes this weight: a contiguous floating-point [N, K] weight (not FP8)
    whose program slab fits _TILE elements (K up to 8,192; gated, whose programs hold a
    gate and an up slab, up to 4,096), gated with an even number of rows."""
    return (is_float_matrix(weight) and triton.next_power_of_2(weight.shape[1]) * (2 if gated else 1) <= _TILE
            and not (gated and weight.shape[0] % 2))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, x_stride, y_stride,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
):
    """Program p: outputs [p BLOCK_N, (p + 1) BLOCK_N) of every row of x. GATED: the weight's
    rows [0, N) are the gate's and [N, 2 N) the up projection's; out = silu(gate) * up."""
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, KP)
    n_ok = offs_n < N
    k_ok = offs_k < K
    tile = offs_n[:, None] * K + offs_k[None, :]
    mask = n_ok[:, None] & k_ok[None, :]
    # Nothing here depends on the kernel before: loaded before the wait.
    w = tl.load(w_ptr + tile, mask=mask, other=0.0)
    if GATED:
        w_up = tl.load(w_ptr + N * K + tile, mask=mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(b_ptr + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    dtype = y_ptr.dtype.element_ty
    for m in range(M):
        x = tl.load(x_ptr + m * x_stride + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        if GATED:
            up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
            if HAS_BIAS:
                up += bias_up
            # The projection's outputs rounded as the unfused path rounds them, then silu * up
            # in fp32 and rounded once, as the compiled SiluAndMul does.
            gate = acc.to(dtype).to(tl.float32)
            acc = silu_mul(gate, up.to(dtype).to(tl.float32))
        tl.store(y_ptr + m * y_stride + offs_n, acc.to(dtype), mask=n_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS, unit stride in K) times weight [N, K] (supports(weight))
    -> [M, N] in x's dtype; gated: [M, N / 2], silu(x gate^T) * (x up^T)."""
    m, k = x.shape
    n = weight.shape[0] // (2 if gated else 1)
    if m > GEMV_MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or not supports(weight, gated):
        raise ValueError(f"gemv takes up to {GEMV_MAX_ROWS} rows of a supported weight; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    kp = triton.next_power_of_2(k)
    block_n = max(1, _TILE // kp // (2 if gated else 1))
    pdl = pdl_enabled(x.device)
    launch(_gemv_kernel, (triton.cdiv(n, block_n),),
        x, weight, bias if bias is not None else weight, y, m, n, x.stride(0), y.stride(0),
        K=k, KP=kp, BLOCK_N=block_n, HAS_BIAS=bias is not None, GATED=gated,
        PDL=pdl, num_warps=_NUM_WARPS, **launch_options(pdl))
    return y
