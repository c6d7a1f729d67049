"""Projections of a few rows: y = x W^T (+ b) for x of at most MAX_ROWS rows.

At decode batch sizes a linear layer reads its whole weight to multiply a handful of
rows, so its time is the weight read. cuBLAS's tiles are built for more rows than that
(for one row of Qwen3-0.6B's gate/up projection it picks an 8x64 tile that reads the
weight at 1.1 TB/s, a quarter of the H200's bandwidth). Here program (tile, split) reads
BLOCK_N rows of W over one range of K in BLOCK_K-wide pieces and multiplies them with
all rows of x at once (`tl.dot`, rows padded to 16); the splits give a small N enough
programs to keep every SM streaming. The last split of a tile to finish sums the
splits' fp32 partials in split order and writes the tile (kernels/split_counters.py):
one launch, and the same bits whichever split finishes last.

`gated=True` takes the gated MLP's [gate | up] projection as x and multiplies
silu(gate) * up, computed as it is read, so the activation needs no kernel (or buffer)
of its own.

Shapes of the grid and buffers depend only on x's row count and W's shape, so the
launch can be captured in a CUDA graph (after one call outside capture, which allocates
the split counters).
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.split_counters import split_counters

# The most rows of x a launch takes; tl.dot pads them to 16.
MAX_ROWS = 16
_BLOCK_M = 16
_BLOCK_N = 16
_BLOCK_K = 256
_NUM_WARPS = 4
# The pipeliner keeps num_stages - 1 pieces of W in flight per program.
_NUM_STAGES = 4
# Enough programs per SM that each has several pieces of W in flight at once.
_TARGET_PROGRAMS_PER_SM = 4
# A split shorter than this many pieces spends as long on setup and merge as on reading.
_MIN_PIECES_PER_SPLIT = 2
# The Triton interpreter (CPU) runs programs one after another: more programs only cost time.
_INTERPRETER_NUM_SMS = 1


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch parameters; fixed for a given weight shape."""

    block_n: int  # rows of W per program
    block_k: int  # width of one piece of K
    num_splits: int  # ranges of K, the grid's second dimension (fewer when K is short)
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """The split count is the smallest that gives about `_TARGET_PROGRAMS_PER_SM`
    programs per SM, each split at least `_MIN_PIECES_PER_SPLIT` pieces of K long."""
    tiles = triton.cdiv(n, _BLOCK_N)
    wanted = triton.cdiv(_TARGET_PROGRAMS_PER_SM * _num_sms(device), tiles)
    useful = triton.cdiv(k, _BLOCK_K * _MIN_PIECES_PER_SPLIT)
    return GemvConfig(_BLOCK_N, _BLOCK_K, max(1, min(wanted, useful)), _NUM_WARPS, _NUM_STAGES)


@triton.jit
def _write_tile(acc, out_ptr, bias_ptr, offs_n, n_mask, out_offsets, out_mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], or [M, 2K] = [gate | up] when GATED; row stride stride_xm
    w_ptr,  # [N, K], row stride stride_wn
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N], row stride stride_om
    partial_ptr,  # [num_splits, M, N] fp32 (used only when num_splits > 1)
    counters_ptr,  # [>= N / BLOCK_N] int32, zero between launches
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    num_splits,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_end
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if GATED:
            gate = x.to(tl.float32)
            up = tl.load(x_rows + K + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            x = gate * tl.sigmoid(gate) * up.to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PRECISION)

    out_offsets = offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if num_splits == 1:
        _write_tile(acc, out_ptr, bias_ptr, offs_n, n_mask, out_offsets, out_mask, HAS_BIAS)
        return
    partial_offsets = offs_m[:, None] * N + offs_n[None, :]
    tl.store(partial_ptr + split * M * N + partial_offsets, acc, mask=out_mask)
    # Release this split's partial, acquire the others': the program that brings the
    # count to num_splits sees them all.
    counter = counters_ptr + tile
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed")
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for other in range(0, num_splits):
            # .cg: read from L2, where the other programs' stores are, never a stale L1 line
            total += tl.load(partial_ptr + other * M * N + partial_offsets, mask=out_mask, other=0.0,
                             cache_modifier=".cg")
        _write_tile(total, out_ptr, bias_ptr, offs_n, n_mask, out_offsets, out_mask, HAS_BIAS)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for a few rows of x.

    Args:
        x: [M, K] with M <= MAX_ROWS, contiguous in K; with gated=True, [M, 2K] holding
            [gate | up], and the product's input is silu(gate) * up.
        weight: [N, K], contiguous in K, same dtype as x.
        bias: optional [N].
        config: launch parameters (tests and tuning); gemv_config's by default.

    Returns:
        [M, N] in x's dtype, accumulated in fp32.
    """
    m = x.shape[0]
    n, k = weight.shape
    width = 2 * k if gated else k
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"x must be [rows, {width}] for a [{n}, {k}] weight{' (gated)' if gated else ''}, got {tuple(x.shape)}")
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dimension")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    config = config or gemv_config(n, k, x.device)
    tiles = triton.cdiv(n, config.block_n)
    counters = split_counters(x.device, tiles)  # allocated on the first call, before any capture
    if m == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, config.num_splits), config.block_k) * config.block_k
    num_splits = triton.cdiv(k, k_per_split)
    partial = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device) if num_splits > 1 else out
    _gemv_kernel[(tiles, num_splits)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        partial,
        counters,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        k_per_split,
        num_splits,
        GATED=gated,
        HAS_BIAS=bias is not None,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
