"""Projections of decode batches of SPLIT_MIN_ROWS to SPLIT_MAX_ROWS rows (and, with an
output narrow beside the reduction, up to WIDE_MAX_ROWS) as split-K tiles whose sum is left
to the kernel that reads the output.

At these sizes a projection is latency-bound, whoever computes it: cuBLAS runs one wave of
32-128 programs per GEMM and reads the weights at well under half the copy bandwidth
(benchmarks/RESULTS.md, session 20). Here program (tile, split) multiplies BLOCK_N weight
rows by every row of the batch over BLOCK_K columns of K, so even a 1,024-output projection
runs over a hundred programs. Its weight tile arrives in one TMA copy issued before the PDL
wait (kernels/pdl.py), while the kernel before it still runs; then it reads its slice of x,
multiplies on the tensor cores and stores its fp32 partial. Nothing in this kernel sums the
splits: a last-to-finish merge (an atomic per tile, the partials read back) cost about as
much as the tiles saved (RESULTS.md, session 30). The output is a SplitSum, and the kernel
that reads it (RMSNorm with the residual add, SiLU-and-mul, rotary_store or decode attention
with rotary_store inside) adds the splits in split order as it loads them and rounds once,
where the projection's output would have been rounded.

    out = split_gemm(x, weight, descriptor, bias)       x [M, K], weight [N, K] -> SplitSum
    out.dense()                                          [M, N] in x's dtype, for any reader

A kernel that reads a projection's output in either form is launched with `x, splits,
split_stride = kernel_args(out)` (splits = 0: a tensor) and loads it with
`load_output(ptr, offsets, mask, dtype, SPLITS, split_stride)`.

Row-parallel projections (o_proj, down_proj) of more rows, up to WIDE_MAX_ROWS, whose output
is narrow beside their reduction (K >= 2 N, as Qwen3's are) take the wide tiles: x is the
MMA's row operand in tiles of 64 or 128 rows, both operands arrive by TMA copies in a
pipelined loop over K, and K is cut into WIDE_SPLITS splits so that the few output tiles
still fill the SMs. cuBLAS runs such a projection as a handful of output tiles and was slower
at 128 and 256 rows; it kept q/k/v and gate_up, whose wide outputs fill the SMs without
splits (RESULTS.md, session 38). The wide kernel waits for the kernel before it at its
start: no weights are fetched early, as the smaller tiles' are.

    out = wide_split_gemm(x, weight, wide_descriptor(weight), bias)   x [65-256, K] -> SplitSum
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.gpu import is_hopper_or_later
from nanovllm.kernels.launch import launch
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.utils.env import env_int

# Rows up to which the layers send projections here; 0 keeps cuBLAS (NANOVLLM_SPLIT_GEMM_MAX_ROWS,
# for A/B measurements). The batch's rows are one operand of the tensor cores, so at most
# _MOST_ROWS; from 128 rows cuBLAS beat every form of these tiles tried (RESULTS.md, session 31).
_MOST_ROWS = 64
SPLIT_MAX_ROWS = min(env_int("NANOVLLM_SPLIT_GEMM_MAX_ROWS", _MOST_ROWS, least=0), _MOST_ROWS)
# Rows from which the tiles take a projection the GEMV (kernels/gemv.py) would also take:
# from 3 rows they won at 32 requests (RESULTS.md, sessions 32-33; NANOVLLM_SPLIT_GEMM_MIN_ROWS).
# Fewer rows stay on the GEMV; a projection the GEMV does not take comes here from one row.
SPLIT_MIN_ROWS = env_int("NANOVLLM_SPLIT_GEMM_MIN_ROWS", 3, least=1)
# A program's weight tile: 64 rows (one warpgroup's MMA height) x 256 columns, 32 KiB in
# bf16: the best of 64-128 x 128-256 tiles in four or eight warps (RESULTS.md, session 30).
BLOCK_N = 64
BLOCK_K = 256
_NUM_WARPS = 4
# The wide tiles: the rows from and up to which they take a narrow-output projection
# (NANOVLLM_SPLIT_GEMM_WIDE_ROWS below WIDE_MIN_ROWS: none, cuBLAS), and their shape: 64
# weight rows x 128 columns a step, four stages, K in four splits; 64-row x tiles up to 128
# rows, then 128 (for o_proj and down_proj at 128 and 256 rows the best or within 3% of it
# among 20-90 shapes each; RESULTS.md, session 38).
WIDE_MIN_ROWS = _MOST_ROWS + 1
_WIDE_MOST_ROWS = 256  # measured up to here; larger steps (prefill chunks) stay with cuBLAS
WIDE_MAX_ROWS = min(env_int("NANOVLLM_SPLIT_GEMM_WIDE_ROWS", _WIDE_MOST_ROWS, least=0), _WIDE_MOST_ROWS)
WIDE_SPLITS = 4
_WIDE_BLOCK_N = 64
_WIDE_BLOCK_K = 128
_WIDE_STAGES = 4
# Whether a wide program fetches its first weight step before the PDL wait, while the kernel
# before it still runs, as the smaller tiles fetch theirs (NANOVLLM_SPLIT_GEMM_WIDE_EARLY=1;
# off until measured in the engine). Its buffers take a stage's room: 128-row tiles run three.
WIDE_EARLY = env_int("NANOVLLM_SPLIT_GEMM_WIDE_EARLY", 0, least=0) > 0


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
    return ((weight.device.type == "cpu" or is_hopper_or_later(weight.device)) and weight.dim() == 2
            and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.is_contiguous() and _tma_rows(weight))


def weight_descriptor(weight: torch.Tensor):
    """The TMA descriptor of a weight's tiles (made once per weight; supports(weight))."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(weight, [BLOCK_N, _block_k(weight.shape[1])])


def takes_wide(weight: torch.Tensor) -> bool:
    """Whether the wide tiles take this weight [N, K]: supports(weight), and an output
    narrow beside the reduction (K >= 2 N)."""
    return supports(weight) and weight.shape[1] >= 2 * weight.shape[0]


def wide_descriptor(weight: torch.Tensor):
    """The TMA descriptor of a weight's tiles for wide_split_gemm (made once per weight)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(weight, [_WIDE_BLOCK_N, _wide_block_k(weight.shape[1], weight.element_size())])


def tma_rows(x: torch.Tensor) -> bool:
    """Whether x [M, K] can be the wide tiles' TMA operand: unit stride in K, rows a TMA copy
    can address."""
    return x.dim() == 2 and x.stride(1) == 1 and _tma_rows(x)


def _tma_rows(x: torch.Tensor) -> bool:
    """Whether a TMA copy can address x's rows (16-byte aligned start and stride)."""
    return x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0


def _block_k(k: int) -> int:
    return min(BLOCK_K, max(16, triton.next_power_of_2(k)))


def _wide_block_k(k: int, itemsize: int) -> int:
    """128 columns of 16-bit operands, 64 of fp32 ones (the same bytes: four stages fit)."""
    return min(_WIDE_BLOCK_K * 2 // itemsize, max(16, triton.next_power_of_2(k)))


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
    """x [M, K] (M <= SPLIT_MAX_ROWS, unit stride in K) times weight [N, K] (supports(weight);
    descriptor = weight_descriptor(weight)) -> SplitSum of [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= _MOST_ROWS or weight.shape[1] != k or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"split_gemm takes 1 to {_MOST_ROWS} rows of x in the weight's dtype; got x {tuple(x.shape)} "
                         f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    block_k = _block_k(k)
    splits = triton.cdiv(k, block_k)
    rows = max(16, triton.next_power_of_2(m))
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x.device)
    launch(_split_gemm_kernel, (triton.cdiv(n, BLOCK_N), splits),
           x, descriptor, bias if bias is not None else parts, parts, m, n, k, x.stride(0),
           HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=block_k, ROWS=rows, PDL=pdl,
           num_warps=_NUM_WARPS, **launch_options(pdl))
    return SplitSum(parts, x.dtype)


@triton.jit
def _wide_gemm_kernel(x_desc, w_desc, b_ptr, part_ptr, M, N, split_k, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                      PRECISION: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """Program (tile of N, tile of M, split): parts[split, M tile, N tile] = x[M tile, split]
    W[N tile, split]^T (+ the bias, in split 0). Rows and columns past M, N and K arrive as
    zeros from the TMA copies. EARLY: the split's first weight step is fetched before the
    PDL wait (it depends on nothing) and multiplied before the loop."""
    tile_n = tl.program_id(0)
    tile_m = tl.program_id(1)
    split = tl.program_id(2)
    start = split * split_k
    if PDL:
        gdc_launch_dependents()
    if EARLY:
        w_first = w_desc.load([tile_n * BLOCK_N, start])
    if PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = start
    if EARLY:
        acc = tl.dot(x_desc.load([tile_m * BLOCK_M, start]), tl.trans(w_first), acc, input_precision=PRECISION)
        first += BLOCK_K
    for k in tl.range(first, start + split_k, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([tile_m * BLOCK_M, k])
        w = w_desc.load([tile_n * BLOCK_N, k])
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :] * (split == 0).to(tl.float32)
    tl.store(part_ptr + split * M * N + rows[:, None] * N + cols[None, :], acc,
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def wide_split_gemm(x: torch.Tensor, weight: torch.Tensor, descriptor, bias: torch.Tensor | None = None) -> SplitSum:
    """x [M, K] (tma_rows(x)) times weight [N, K] (takes_wide(weight); descriptor =
    wide_descriptor(weight)) -> SplitSum of [M, N] in x's dtype, in WIDE_SPLITS splits of K
    (fewer where K is short)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    if not m or weight.shape[1] != k or not tma_rows(x) or x.dtype != weight.dtype:
        raise ValueError(f"wide_split_gemm takes rows of x in the weight's dtype, TMA-addressable; got x "
                         f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    block_m = 64 if m <= 128 else 128
    block_k = _wide_block_k(k, x.element_size())
    stages = _WIDE_STAGES - 1 if WIDE_EARLY and block_m == 128 else _WIDE_STAGES
    split_k = triton.cdiv(triton.cdiv(k, WIDE_SPLITS), block_k) * block_k
    splits = triton.cdiv(k, split_k)
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x.device)
    launch(_wide_gemm_kernel, (triton.cdiv(n, _WIDE_BLOCK_N), triton.cdiv(m, block_m), splits),
           TensorDescriptor.from_tensor(x, [block_m, block_k]), descriptor, bias if bias is not None else parts,
           parts, m, n, split_k, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=_WIDE_BLOCK_N, BLOCK_K=block_k,
           STAGES=stages, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EARLY=WIDE_EARLY, PDL=pdl,
           num_warps=_NUM_WARPS, **launch_options(pdl))
    return SplitSum(parts, x.dtype)
