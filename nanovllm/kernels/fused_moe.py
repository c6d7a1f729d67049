"""Fused mixture-of-experts: two grouped GEMMs over expert-contiguous blocks of tokens.

Each token picks top_k experts, which makes num_tokens * top_k (token, expert) pairs;
pair p = token * top_k + j. `align_pairs` groups the pairs by expert and pads each
expert's run to a multiple of BLOCK_M, so every block of BLOCK_M sorted pairs belongs to
one expert. Then, per block and tile of output columns, one program multiplies its
pairs' rows by that expert's weight:

    gate_up: act[p]  = silu(x[p // top_k] @ w13[e, :I].T) * (x[p // top_k] @ w13[e, I:].T)
    down:    part[p] = weight[p] * (act[p] @ w2[e].T)

(both halves of gate_up in one program, so SiLU-and-mul is done on the accumulators and
the [pairs, 2I] product is never written), and the output is part.view(tokens, top_k,
H).sum(1): a fixed order, so the same input gives the same bits every time (atomics in
the down GEMM would save that pass but not the determinism greedy decoding relies on).

FP8 experts (weights with block scales, layers/fused_moe.py's ExpertScales): each GEMM's
input is quantized per row and block of K (quantize_activations) and the products run on
the FP8 tensor cores, each K tile's scaled by its row's and its column's scales and summed
in fp32, as the linear layers' block-scaled FP8 GEMM does (a quantize_activations launch
before each GEMM); an input that ExpertScales.quantizes_inputs declines (blocks that do not
divide its width, or narrower than 32) stays in its dtype, and the weight tiles are
converted to it instead.

Every shape depends on num_tokens, top_k and the expert count only (blocks past the
last expert's are marked -1 and return at once), so a step with these kernels can be
captured in a CUDA graph; a layer is five launches (count, lay out, place, two GEMMs;
FP8 experts: two more, quantizing the GEMMs' inputs) and the sum. A pair whose expert id
equals the expert count goes to no expert (expert parallelism: the expert lives on another
rank) and contributes zero.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.activation import silu_mul
from nanovllm.kernels.fp8 import quantize_activations
from nanovllm.kernels.launch import launch
from nanovllm.utils.fp8 import is_fp8


class MoEConfig(NamedTuple):
    """The grouped GEMMs' tiles and launch: BLOCK_M pairs by BLOCK_N output columns, K in steps
    of BLOCK_K."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The configs by the number of tokens in the step: the first row whose bound is >= num_tokens.
# Few tokens per expert want a short BLOCK_M (less padding) and more programs along N; many
# want big square tiles. From the sweep of `bench_kernels.py --moe-only --moe-sweep` on an
# H200 at Qwen3-30B-A3B's shapes (128 experts, top 8, hidden 2048, inter 768, bf16;
# benchmarks/RESULTS.md): the best at 1, 64, 256 and 2048 tokens (at 1 token the first row is
# about as fast as the best).
MOE_CONFIGS: list[tuple[int, MoEConfig]] = [
    (32, MoEConfig(16, 64, 128, 4, 4)),
    (128, MoEConfig(16, 128, 128, 4, 3)),
    (512, MoEConfig(32, 64, 128, 4, 3)),
    (1 << 62, MoEConfig(128, 128, 64, 8, 3)),
]
# FP8 experts: the same, but many tokens take 64 x 64 tiles of the whole 128-wide block of K, the
# best of bench_kernels.py's sweep at 2,048 tokens (RESULTS.md, session 63). Compiled for sm_90,
# gate_up's 128 x 128 tiles spill (each K tile's products are summed into the accumulators after
# their scaling, which holds a second set of them: over 400 bytes of stack a thread).
FP8_MOE_CONFIGS = MOE_CONFIGS[:-1] + [(1 << 62, MoEConfig(64, 64, 128, 4, 4))]
_PAIRS_PER_PROGRAM = 1024  # the pairs a program of _count_kernel and _place_kernel takes


def moe_config(num_tokens: int, fp8: bool = False) -> MoEConfig:
    return next(config for bound, config in (FP8_MOE_CONFIGS if fp8 else MOE_CONFIGS) if num_tokens <= bound)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded blocks: each expert that gets pairs rounds up once."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the pairs by expert in blocks of block_m.

    Returns sorted_pairs [max_blocks * block_m] (pair ids; num_pairs marks padding) and
    block_expert [max_blocks] (each block's expert, ascending; -1 past the last one). The
    order of pairs inside an expert's run is whatever the atomics gave: each output row
    depends only on its own pair, so that order changes no result. Three launches (count,
    lay out, place) of shapes fixed by the arguments: no host sync, graph-capturable.
    """
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    grid = (triton.cdiv(num_pairs, _PAIRS_PER_PROGRAM),)
    launch(_count_kernel, grid, flat, counts, rank, num_pairs, BLOCK=_PAIRS_PER_PROGRAM)
    launch(_layout_kernel, (1,), counts, block_expert, num_experts, blocks, BLOCK_M=block_m,
           EXPERTS=triton.next_power_of_2(num_experts), BLOCK=64)
    launch(_place_kernel, grid, flat, counts, rank, sorted_pairs, num_pairs, num_experts, BLOCK=_PAIRS_PER_PROGRAM)
    return sorted_pairs, block_expert


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, BLOCK: tl.constexpr):
    """counts[e] = pairs routed to e; rank[p] = p's place among them."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0)
    rank = tl.atomic_add(counts_ptr + expert, tl.full((BLOCK,), 1, tl.int32), mask=ok)
    tl.store(rank_ptr + offs, rank, mask=ok)


@triton.jit
def _layout_kernel(counts_ptr, block_expert_ptr, num_experts, num_blocks, BLOCK_M: tl.constexpr,
                   EXPERTS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: each expert's run rounded up to whole blocks, in expert order. Leaves
    the start of each run (in pairs) in counts[e] for _place_kernel, and each block's
    expert in block_expert."""
    e = tl.arange(0, EXPERTS)
    ok = e < num_experts
    counts = tl.load(counts_ptr + e, mask=ok, other=0)
    run_blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(run_blocks, 0)  # blocks up to and including expert e
    starts = ends - run_blocks
    tl.store(counts_ptr + e, starts * BLOCK_M, mask=ok)
    for first in range(0, num_blocks, BLOCK):
        b = first + tl.arange(0, BLOCK)
        # the expert of block b: how many runs end at or before it
        owner = tl.sum(((ends[None, :] <= b[:, None]) & ok[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < num_blocks)


@triton.jit
def _place_kernel(ids_ptr, starts_ptr, rank_ptr, sorted_pairs_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
    ok = (offs < num_pairs) & (expert < num_experts)  # pairs for no expert are not placed
    dest = tl.load(starts_ptr + expert, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
    tl.store(sorted_pairs_ptr + dest, offs, mask=ok)


@triton.jit
def _tile_product(a, b, a_scale, scale, FP8_BLOCK: tl.constexpr, A_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K tile's a @ b in fp32: FP8 weights scaled per output column, on the FP8 tensor cores
    (scaled per row too) where a is FP8, else converted to a's dtype."""
    if FP8_BLOCK:
        if A_FP8:
            product = tl.dot(a, b) * (a_scale * scale)
        else:
            product = tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * scale
    else:
        product = tl.dot(a, b, input_precision=DOT_PRECISION)
    return product


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # gate_up: x [tokens, K]; down: act [pairs, K]
    b_ptr,  # gate_up: w13 [experts, 2N, K]; down: w2 [experts, N, K]
    c_ptr,  # [pairs, N]
    weight_ptr,  # [pairs] float32 routing weights (down only)
    scale_ptr,  # FP8 weights: their block scales [experts, rows / FP8_BLOCK, K / FP8_BLOCK] (ExpertScales)
    a_scale_ptr,  # FP8 inputs (A_FP8): a's scales [rows of a, K / FP8_BLOCK], one per row and block of K
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    stride_sn,
    stride_asm,
    TOP_K: tl.constexpr,
    # gate_up: the A row of pair p is p // TOP_K, rows [0, N) and [N, 2N) of the expert's weight,
    # SiLU-and-mul; down: the A row of pair p is p, the output times p's routing weight
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (tl.dot would round them to tf32)
    FP8_BLOCK: tl.constexpr,  # > 0: b is FP8, scaled per [FP8_BLOCK, FP8_BLOCK] block (BLOCK_K divides it)
    A_FP8: tl.constexpr,  # a is FP8 too (quantized per row and FP8_BLOCK columns): FP8 products
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    SCALE_BLOCK: tl.constexpr = FP8_BLOCK if FP8_BLOCK else 1
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    if GATED:
        rows = pairs // TOP_K
    else:
        rows = pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    # Each column's scale row (FP8): gate's blocks, then up's from row cdiv(N, FP8_BLOCK).
    s_ptrs = scale_ptr + expert.to(tl.int64) * stride_se + offs_n // SCALE_BLOCK * stride_sn
    up_scale_offset = tl.cdiv(N, SCALE_BLOCK) * stride_sn
    a_scales = a_scale_ptr + rows.to(tl.int64) * stride_asm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        scale = 1.0  # unread without FP8
        scale_up = 1.0
        a_scale = 1.0
        if FP8_BLOCK:  # the tile's K columns lie in one block: one scale per output column (and row)
            scale_col = k * BLOCK_K // FP8_BLOCK
            scale = tl.load(s_ptrs + scale_col, mask=n_ok, other=0.0)[None, :]
            if GATED:
                scale_up = tl.load(s_ptrs + up_scale_offset + scale_col, mask=n_ok, other=0.0)[None, :]
            if A_FP8:
                a_scale = tl.load(a_scales + scale_col, mask=valid, other=0.0)[:, None]
        acc += _tile_product(a, b, a_scale, scale, FP8_BLOCK, A_FP8, DOT_PRECISION)
        if GATED:
            acc_up += _tile_product(a, b_up, a_scale, scale_up, FP8_BLOCK, A_FP8, DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:
        acc = silu_mul(acc, acc_up)
    else:
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


# Shared memory per SM on the H100/H200 (227 KiB), less room for the compiler's own.
_SHARED_MEMORY_BYTES = 220 * 1024


def fit_shared_memory(config: MoEConfig, element_size: int, gated: bool) -> MoEConfig:
    """`config` with fewer pipeline stages (then a shorter BLOCK_K) until the A and B tiles
    in flight fit in shared memory: float32 inputs, or gate_up's second B tile, need twice
    the room of one bf16 tile."""
    block_m, block_n, block_k, num_warps, num_stages = config

    def need(stages: int, bk: int) -> int:
        return stages * (block_m + (2 if gated else 1) * block_n) * bk * element_size

    while num_stages > 2 and need(num_stages, block_k) > _SHARED_MEMORY_BYTES:
        num_stages -= 1
    while block_k > 16 and need(num_stages, block_k) > _SHARED_MEMORY_BYTES:
        block_k //= 2
    return MoEConfig(block_m, block_n, block_k, num_warps, num_stages)


def gemm_constants(config: MoEConfig, a_dtype: torch.dtype, gated: bool, fp8_block: int, top_k: int) -> dict:
    """_moe_gemm_kernel's compile-time arguments (num_warps and num_stages among them) for a GEMM
    whose input is a_dtype, its weights FP8 in fp8_block-wide blocks where fp8_block > 0."""
    block_m, block_n, block_k, num_warps, num_stages = fit_shared_memory(config, a_dtype.itemsize, gated)
    if fp8_block:
        block_k = min(block_k, fp8_block)  # a K tile inside one scale block
    return dict(TOP_K=top_k, GATED=gated, DOT_PRECISION="ieee" if a_dtype == torch.float32 else "tf32",
                FP8_BLOCK=fp8_block, A_FP8=is_fp8(a_dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                num_warps=num_warps, num_stages=num_stages)


class _Routing(NamedTuple):
    """Which pairs each GEMM program takes (align_pairs) and their routing weights."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    weights: torch.Tensor  # [pairs] float32
    top_k: int


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, routing: _Routing, config: MoEConfig, *, gated: bool,
          scales=None) -> None:
    """One grouped GEMM, gate_up (gated) or down; FP8 b: `scales` (ExpertScales) has its block
    scales, and a is quantized first where scales.quantizes_inputs its width."""
    b_scale, fp8_block = (None, 0) if scales is None else (scales.w13 if gated else scales.w2, scales.block)
    a_scale = None
    if scales is not None and scales.quantizes_inputs(a.shape[1]):
        a, a_scale = quantize_activations(a, scales.block)
    constants = gemm_constants(config, a.dtype, gated, fp8_block, routing.top_k)
    n = c.size(1)
    grid = (routing.block_expert.numel(), triton.cdiv(n, constants["BLOCK_N"]))
    unread = routing.weights  # stands in for the scales where there are none
    b_scale = unread if b_scale is None else b_scale
    a_scale = unread if a_scale is None else a_scale
    launch(_moe_gemm_kernel, grid,
        a, b, c, routing.weights, b_scale, a_scale, routing.sorted_pairs, routing.block_expert, c.size(0), n,
        b.size(2), a.stride(0), b.stride(0), b.stride(1), c.stride(0), b_scale.stride(0),
        b_scale.stride(-2) if fp8_block else 0, a_scale.stride(0), **constants,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoEConfig | None = None,
              every_pair_routed: bool = False, scales=None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t.

    Args:
        x: [tokens, hidden], contiguous.
        w13: [experts, 2 * inter, hidden]: gate_proj's rows, then up_proj's.
        w2: [experts, hidden, inter].
        topk_weights: [tokens, top_k] float32.
        topk_ids: [tokens, top_k] integers in [0, experts]; `experts` means no expert.
        config: the tiles (a MoEConfig, or a plain tuple of its fields); default from
            MOE_CONFIGS (FP8_MOE_CONFIGS with `scales`).
        every_pair_routed: no id equals `experts`, so every row of the down GEMM's output
            is written and need not be zeroed first.
        scales: FP8 w13 and w2 (float8_e4m3fn)'s block scales, a layers/fused_moe.py
            ExpertScales (block a power of two from 16). x comes in the output's dtype; x and
            the activations are quantized per row and block where scales.quantizes_inputs(width).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    if x.shape != (num_tokens, hidden) or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit together")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x, w13 and w2 must be contiguous")
    config = MoEConfig(*config) if config else moe_config(num_tokens, fp8=scales is not None)
    routing = _Routing(*align_pairs(topk_ids, num_experts, config.block_m), topk_weights.flatten().float(), top_k)
    act = torch.empty(num_tokens * top_k, two_inter // 2, dtype=x.dtype, device=x.device)
    _gemm(x, w13, act, routing, config, gated=True, scales=scales)
    alloc = torch.empty if every_pair_routed else torch.zeros  # pairs for no expert stay 0
    parts = alloc(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, w2, parts, routing, config, gated=False, scales=scales)
    return parts.view(num_tokens, top_k, hidden).sum(1)
