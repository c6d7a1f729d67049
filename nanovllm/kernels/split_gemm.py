"""Projections of decode batches of SPLIT_MIN_ROWS to SPLIT_MAX_ROWS rows as split-K tiles
whose sum is left to the kernel that reads the output (65-256 rows: kernels/wide_gemm.py).

At these sizes a projection is latency-bound, whoever computes it: cuBLAS runs one wave of
32-128 programs per GEMM and reads the weights at well under half the copy bandwidth
(benchmarks/RESULTS.md, session 20). Here program (tile, split) multiplies BLOCK_N weight
rows by every row of the batch over BLOCK_K columns of K, so even a 1,024-output projection
runs dozens of programs (Qwen3-0.6B's o_proj: 16 tiles x 4 splits). Its weight tile arrives
by TMA (one descriptor load) issued before the PDL wait (kernels/pdl.py), while the kernel
before it still runs; then it reads its slice of x, multiplies on the tensor cores and
stores its fp32 partial. Nothing in this kernel sums the splits: a last-to-finish merge (an
atomic per tile, the partials read back) cost about as much as the tiles saved (RESULTS.md,
session 30). The output is a SplitSum, and the kernel
that reads it (RMSNorm with the residual add, SiLU-and-mul, rotary_store or decode attention
with rotary_store inside) adds the splits in split order as it loads them and rounds once,
where the projection's output would have been rounded.

    out = split_gemm(x, weight, descriptor, bias)       x [M, K], weight [N, K] -> SplitSum
    out.dense()                                          [M, N] in x's dtype, for any reader

A kernel that reads a projection's output in either form is launched with `x, splits,
split_stride = kernel_args(out)` (splits = 0: a tensor) and loads it with
`load_output(ptr, offsets, mask, dtype, SPLITS, split_stride)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.gpu import is_float_matrix, is_hopper_or_later
from nanovllm.kernels.launch import launch
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.utils.env import env_int

# Rows up to which the layers send projections here; 0 keeps cuBLAS (NANOVLLM_SPLIT_GEMM_MAX_ROWS,
# for A/B measurements). The batch's rows are one operand of the tensor cores, so at most
# MOST_ROWS; from 128 rows cuBLAS beat every form of these tiles tried (RESULTS.md, session 31).
MOST_ROWS = 64
SPLIT_MAX_ROWS = min(env_int("NANOVLLM_SPLIT_GEMM_MAX_ROWS", MOST_ROWS, least=0), MOST_ROWS)
# Rows from which the tiles take a projection the GEMV (kernels/gemv.py) would also take:
# from 3 rows they won at 32 requests (RESULTS.md, sessions 32-33), and with session 56's
# deeper tiles from 2 (one row stays faster on the GEMV; session 57;
# NANOVLLM_SPLIT_GEMM_MIN_ROWS). A projection the GEMV does not take comes here from one row.
SPLIT_MIN_ROWS = env_int("NANOVLLM_SPLIT_GEMM_MIN_ROWS", 2, least=1)
# A program's weight tile: BLOCK_N = 64 rows (one warpgroup's MMA height) x ROW_BYTES of each
# row: 512 columns of a 16-bit weight (64 KiB), 256 of an fp32 one. Session 30 found 64 x 256
# the best of 64-128 x 128-256 tiles in four or eight warps; session 56 measured 64 x 512 faster
# at 4-32 rows and on the 32-request workload, and 64 x 1,024 beyond shared memory (RESULTS.md).
# NANOVLLM_SPLIT_GEMM_ROW_BYTES (a power of two from 64) moves it, for A/B measurements.
BLOCK_N = 64
ROW_BYTES = env_int("NANOVLLM_SPLIT_GEMM_ROW_BYTES", 1024, least=64)
if ROW_BYTES & (ROW_BYTES - 1):
    raise ValueError(f"NANOVLLM_SPLIT_GEMM_ROW_BYTES must be a power of two, got {ROW_BYTES}")
_NUM_WARPS = 4


@dataclass(frozen=True, slots=True)
class SplitSum:
    """A projection's output as fp32 partial sums over splits of K: parts [S, M, N]. The
    output is their sum in split order, rounded to dtype (dense)."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def dense(self) -> torch.Tensor:
        """The output as one [M, N] tensor (summed as the reading kernels sum it)."""
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        return total.to(self.dtype)


@triton.jit
def load_split_sum(ptr, offsets, mask, SPLITS: tl.constexpr, split_stride):
    """The fp32 sum, in split order, of SPLITS partials at ptr + offsets, split_stride apart."""
    total = tl.load(ptr + offsets, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(ptr + s * split_stride + offsets, mask=mask, other=0.0)
    return total


@triton.jit
def load_output(ptr, offsets, mask, dtype: tl.constexpr, SPLITS: tl.constexpr, split_stride):
    """A projection's output at ptr + offsets, in dtype: the tensor's values (SPLITS = 0), or
    a SplitSum's parts summed in split order and rounded to dtype."""
    if SPLITS:
        x = load_split_sum(ptr, offsets, mask, SPLITS, split_stride).to(dtype)
    else:
        x = tl.load(ptr + offsets, mask=mask, other=0.0)
    return x


def kernel_args(x: torch.Tensor | SplitSum) -> tuple[torch.Tensor, int, int]:
    """What a kernel reading x takes: (a tensor whose strides index x's rows, the number of
    splits, the stride between them): a SplitSum's first part, or x itself with 0 splits."""
    if isinstance(x, SplitSum):
        return x.parts[0], x.parts.shape[0], x.parts.stride(0)
    return x, 0, 0


def supports(weight: torch.Tensor) -> bool:
    """Whether split_gemm takes this weight: a contiguous 16-bit or fp32 [N, K] weight (not
    FP8) whose rows a TMA copy can address (16-byte multiples), on a Hopper or later GPU (or
    a CPU, under the Triton interpreter)."""
    return ((weight.device.type == "cpu" or is_hopper_or_later(weight.device)) and is_float_matrix(weight)
            and tma_addressable(weight))


def weight_descriptor(weight: torch.Tensor):
    """The TMA descriptor of a weight's tiles (made once per weight; supports(weight))."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(weight, [BLOCK_N, block_k(weight.shape[1], weight.element_size())])


def tma_addressable(x: torch.Tensor) -> bool:
    """Whether a TMA copy can address x's rows (16-byte aligned start and stride)."""
    return x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0


def block_k(k: int, itemsize: int) -> int:
    """The columns of K a program takes (one split): ROW_BYTES' worth, fewer for a short K
    (at least 16)."""
    return min(ROW_BYTES // itemsize, max(16, triton.next_power_of_2(k)))


@triton.jit
def _split_gemm_kernel(x, w_desc, b_ptr, part_ptr, M, N, K, x_stride,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (tile, split): parts[split, :, tile] = x[:, split] W[tile, split]^T (+ the bias,
    in split 0). Weight rows and columns past N and K arrive as zeros from the TMA copy. x by
    loads, not a TMA copy of its own: that halved the instructions after the PDL wait and
    measured the same (RESULTS.md, session 32)."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = w_desc.load([tile * BLOCK_N, split * BLOCK_K])  # [BLOCK_N, BLOCK_K]: depends on nothing
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) * (split == 0).to(tl.float32)
    if PDL:
        gdc_wait()
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    x_tile = tl.load(x + rows[:, None] * x_stride + offs_k[None, :], mask=r_ok[:, None] & (offs_k < K)[None, :],
                     other=0.0)
    precision: tl.constexpr = "ieee" if w.dtype == tl.float32 else "tf32"
    acc = tl.dot(w, tl.trans(x_tile), input_precision=precision)  # [BLOCK_N, ROWS]
    if HAS_BIAS:
        acc += bias[:, None]
    out = part_ptr + split * M * N + rows[None, :] * N + offs_n[:, None]
    tl.store(out, acc, mask=n_ok[:, None] & r_ok[None, :])


def split_gemm(x: torch.Tensor, weight: torch.Tensor, descriptor, bias: torch.Tensor | None = None) -> SplitSum:
    """x [M, K] (M <= MOST_ROWS, unit stride in K) times weight [N, K] (supports(weight);
    descriptor = weight_descriptor(weight)) -> SplitSum of [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MOST_ROWS or weight.shape[1] != k or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"split_gemm takes 1 to {MOST_ROWS} rows of x in the weight's dtype; got x {tuple(x.shape)} "
                         f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    columns = block_k(k, weight.element_size())
    splits = triton.cdiv(k, columns)
    rows = max(16, triton.next_power_of_2(m))
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x.device)
    launch(_split_gemm_kernel, (triton.cdiv(n, BLOCK_N), splits),
           x, descriptor, bias if bias is not None else parts, parts, m, n, k, x.stride(0),
           HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=columns, ROWS=rows, PDL=pdl,
           num_warps=_NUM_WARPS, **launch_options(pdl))
    return SplitSum(parts, x.dtype)
