"""Decode attention as a stream of tiles shared evenly among resident programs.

decode_attention.py gives each (sequence, KV head) one program per split: every program
pays its own start (the row's block table, its queries, the first K/V tiles' latency with
nothing in flight) and its end, and rows of different lengths leave a ragged last wave.
Here the grid is the programs an H200 keeps resident at once, and the step's K/V tiles
(every (row, KV head)'s tiles, rows in order) are cut into equal runs of whole tiles, one
per program. A program streams its run in one loop, so the pipeline keeps tiles in flight
across the boundary between one (row, KV head) and the next. A (row, KV head) inside one
run is finished in the loop; one cut by a run's start or end leaves a partial result, and
the last of its programs to finish merges them (an atomic counter per (row, KV head), as
decode_attention.py does). Each program holds at most two partials: the item it started
in the middle of, and the item its run ends inside of.

NANOVLLM_DECODE_STREAM=1 routes the backend's decode steps that do not fuse rotary_store
here (an A/B switch until it is measured on the GPU).
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_attention import checked_output
from nanovllm.kernels.fp8 import fp8_converts_in_asm
from nanovllm.kernels.gpu import num_sms
from nanovllm.kernels.launch import launch
from nanovllm.kernels.paged import MIN_DOT_ROWS, attend_tile, fp8_queries, merge_partials, tile_blocks, tile_rows
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.kernels.split_counters import split_counters
from nanovllm.utils.env import env_int
from nanovllm.utils.fp8 import is_fp8

STREAM = env_int("NANOVLLM_DECODE_STREAM", 0, least=0) > 0
# Programs per SM: what decode_attention's tiles let an H200 SM keep resident (registers
# and shared memory for three; kernel_sass.py reads them off the compiled kernel).
PROGRAMS_PER_SM = env_int("NANOVLLM_DECODE_STREAM_PROGRAMS_PER_SM", 3)
# A run shorter than this many tiles spends as long on its start and partials as on K/V.
MIN_RUN_TILES = env_int("NANOVLLM_DECODE_STREAM_MIN_RUN_TILES", 4)
_BLOCK_N = 64  # tokens per tile (16 KiB of bf16 K or V at head_dim 128)
_NUM_WARPS = 4
_NUM_STAGES = 3  # two K/V tiles in flight per program
# At most this many registers per thread, so that three programs fit an SM (65,536 / (3 x
# 128 threads)); uncapped, ptxas takes ~200 and two fit. No spills at 168 (sm_90, bf16).
_MAX_REGISTERS = 168


@triton.jit
def _row_tiles(context_lens_ptr, batch, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """(rows, their lengths, their tiles per KV head, the global tile index one past each
    row's last). A padding row (context 0) is one tile of no tokens per KV head, so that
    every row has tiles (the loop steps from row to row) and its output comes out as zeros."""
    rows = tl.arange(0, BLOCK_B)
    lens = tl.load(context_lens_ptr + rows, mask=rows < batch, other=0)
    tiles = tl.where(rows < batch, tl.maximum((lens + BLOCK_N - 1) // BLOCK_N, 1), 0)
    return rows, lens, tiles, tl.cumsum(tiles, 0) * NUM_KV_HEADS


@triton.jit
def _locate(g, rows, ends, tiles, lens, NUM_KV_HEADS: tl.constexpr):
    """The (row, KV head) item holding global tile g: (row, kv_head, its tile index, its
    tiles, the row's context length, the global index of its first tile); _row_tiles's
    vectors."""
    b = tl.sum((ends <= g).to(tl.int32), 0)  # the rows wholly before g
    here = rows == b
    num_tiles = tl.sum(tl.where(here, tiles, 0), 0)
    row_start = tl.sum(tl.where(here, ends - tiles * NUM_KV_HEADS, 0), 0)
    context_len = tl.sum(tl.where(here, lens, 0), 0)
    kv_head = (g - row_start) // num_tiles
    item_start = row_start + kv_head * num_tiles
    return b, kv_head, g - item_start, num_tiles, context_len, item_start


@triton.jit
def _within(offs_n, tile_start, context_len):
    """A tile's token offsets for unmasked loads: one past the row's end reads the row's last
    token again (finite; its score is masked), a padding row's its block 0's first (its
    output is zeros)."""
    return tl.minimum(offs_n, tl.maximum(context_len - 1 - tile_start, 0))


@triton.jit
def _tile_blocks(block_tables_ptr, block_tables_stride_b, b, t, context_len, offs_n, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """tile_blocks for tile t of row b, over _within's offsets."""
    tile_start = t * BLOCK_N
    return tile_blocks(block_tables_ptr + b.to(tl.int64) * block_tables_stride_b, tile_start, context_len,
                       _within(offs_n, tile_start, context_len), BLOCK_SIZE, BLOCK_N)


@triton.jit
def _load_queries(q_ptr, b, kv_head, q_stride_b, q_stride_h, offs_g, offs_d, group_mask,
                  GROUP_SIZE: tl.constexpr, FP8: tl.constexpr):
    heads = kv_head * GROUP_SIZE + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=group_mask[:, None], other=0.0)
    if FP8:
        q = fp8_queries(q)
    return q


@triton.jit
def _decode_stream_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, partial_out_ptr, partial_lse_ptr,
    counters_ptr, out_ptr, kv_scales_ptr, qk_scale, batch, q_stride_b, q_stride_h, out_stride_b, out_stride_h,
    cache_stride_block,
    cache_stride_offset: tl.constexpr,  # compiled in, as decode_attention's
    cache_stride_head, block_tables_stride_b,
    NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MIN_RUN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_ASM: tl.constexpr, PDL: tl.constexpr,
):
    """Program p attends over global tiles [p * run, (p + 1) * run) of the step's items
    ((row, KV head) pairs, row-major; each item's tiles in order)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if PDL:  # launched early (kernels/pdl.py); the output projection after it may start loading its weights
        gdc_launch_dependents()
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    group_mask = offs_g < GROUP_SIZE
    out_cols = offs_g[:, None] * out_stride_h + offs_d[None, :]
    rows, lens, tiles, ends = _row_tiles(context_lens_ptr, batch, NUM_KV_HEADS, BLOCK_N, BLOCK_B)
    total = tl.sum(tiles, 0) * NUM_KV_HEADS
    run = tl.maximum((total + num_programs - 1) // num_programs, MIN_RUN)
    g0 = pid * run
    if g0 >= total:
        return
    g1 = tl.minimum(g0 + run, total)
    first_b, first_head, t, num_tiles, context_len, first_start = _locate(g0, rows, ends, tiles, lens, NUM_KV_HEADS)
    b, kv_head, item_start = first_b, first_head, first_start
    block_ids = _tile_blocks(block_tables_ptr, block_tables_stride_b, b, t, context_len, offs_n, BLOCK_SIZE, BLOCK_N)
    if PDL:  # so far only lengths and block tables, written before the step; q and the newest K/V
        gdc_wait()  # come from rotary_store before this kernel
    if FP8:  # scores = q . (k_fp8 * k_scale) * qk_scale; v_scale on each output
        qk_scale = qk_scale * tl.load(kv_scales_ptr)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    # No branch and no load of the same iteration decides a tile's address: the row, head
    # and tile advance by selects, and the next tile's length and block ids are read one
    # tile ahead. So the pipeliner keeps K/V loads in flight across items.
    q = _load_queries(q_ptr, b, kv_head, q_stride_b, q_stride_h, offs_g, offs_d, group_mask, GROUP_SIZE, FP8)
    for g in range(g0, g1):
        tile_start = t * BLOCK_N
        tile = tile_rows(block_ids, tile_start, _within(offs_n, tile_start, context_len), kv_head * cache_stride_head, cache_stride_block,
                         cache_stride_offset, BLOCK_SIZE, BLOCK_N)[:, None] + offs_d[None, :]
        token_mask = tile_start + offs_n < context_len
        k = tl.load(k_cache_ptr + tile)
        v = tl.load(v_cache_ptr + tile)
        acc, l_i, m_i = attend_tile(q, k, v, token_mask, acc, l_i, m_i, qk_scale, True, DOT_PRECISION, FP8,
                                     FP8_ASM)
        item_done = t == num_tiles - 1
        if item_done | (g == g1 - 1):
            result = tl.where(context_len > 0, acc / l_i[:, None], 0.0)  # a padding row's: zeros
            if FP8:
                result = result * tl.load(kv_scales_ptr + 1)
            if item_done & (item_start >= g0):  # the whole item in this run: the output
                tl.store(out_ptr + b.to(tl.int64) * out_stride_b + kv_head * GROUP_SIZE * out_stride_h + out_cols,
                         result.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])
            else:  # slot 0: the item this run started inside of; slot 1: the one it ends inside of
                slot = (pid * 2 + (item_start >= g0).to(tl.int32)) * GROUP_SIZE + offs_g
                tl.store(partial_out_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], result,
                         mask=group_mask[:, None])
                tl.store(partial_lse_ptr + slot, m_i + tl.log2(l_i), mask=group_mask)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        # the next tile: of this item, the row's next KV head, or the next row's first
        item_start = tl.where(item_done, item_start + num_tiles, item_start)
        t = tl.where(item_done, 0, t + 1)
        kv_head = tl.where(item_done, kv_head + 1, kv_head)
        next_row = kv_head == NUM_KV_HEADS
        b = tl.where(next_row, b + 1, b)
        kv_head = tl.where(next_row, 0, kv_head)
        context_len = tl.load(context_lens_ptr + b, mask=b < batch, other=0)
        num_tiles = tl.maximum((context_len + BLOCK_N - 1) // BLOCK_N, 1)
        block_ids = _tile_blocks(block_tables_ptr, block_tables_stride_b, b, t, context_len, offs_n, BLOCK_SIZE,
                                 BLOCK_N)
        if item_done:  # the next item's queries (not pipelined: once per item); none past the last row
            q = _load_queries(q_ptr, b, kv_head, q_stride_b, q_stride_h, offs_g, offs_d, group_mask & (offs_g * 0 + b < batch),
                              GROUP_SIZE, FP8)
    # read again rather than held in registers through the loop
    rows, lens, tiles, ends = _row_tiles(context_lens_ptr, batch, NUM_KV_HEADS, BLOCK_N, BLOCK_B)
    b, kv_head, t, num_tiles, context_len, item_start = _locate(g1 - 1, rows, ends, tiles, lens, NUM_KV_HEADS)

    # The partial items (at most two): the last of their programs to finish merges them.
    if first_start < g0:
        _merge_if_last(first_b, first_head, first_start, rows, tiles, run, counters_ptr, partial_out_ptr,
                       partial_lse_ptr, out_ptr, out_stride_b, out_stride_h, offs_g, offs_d, group_mask,
                       NUM_KV_HEADS, GROUP_SIZE, HEAD_DIM, BLOCK_G)
    # the item the run ends inside of (holding tile g1 - 1), unless it is the one counted above
    if (item_start + num_tiles > g1) & ((item_start != first_start) | (first_start >= g0)):
        _merge_if_last(b, kv_head, item_start, rows, tiles, run, counters_ptr, partial_out_ptr, partial_lse_ptr,
                       out_ptr, out_stride_b, out_stride_h, offs_g, offs_d, group_mask, NUM_KV_HEADS, GROUP_SIZE,
                       HEAD_DIM, BLOCK_G)


@triton.jit
def _merge_if_last(b, kv_head, item_start, rows, tiles, run, counters_ptr, partial_out_ptr, partial_lse_ptr, out_ptr,
                   out_stride_b, out_stride_h, offs_g, offs_d, group_mask, NUM_KV_HEADS: tl.constexpr,
                   GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr):
    """Count this program's partial of item (b, kv_head); the program that brings the count
    to the item's runs merges every run's partial."""
    num_tiles = tl.sum(tl.where(rows == b, tiles, 0), 0)
    first_run = item_start // run
    num_runs = (item_start + num_tiles - 1) // run - first_run + 1
    # Release this partial, acquire the others': the last to count sees every run's results.
    counter = counters_ptr + b * NUM_KV_HEADS + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_runs - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed")
        # the item's first run ends inside it (its slot 1); every later run starts inside it (slot 0)
        merged = merge_partials(partial_out_ptr, partial_lse_ptr, first_run * 2 * GROUP_SIZE + offs_g,
                                2 * GROUP_SIZE, GROUP_SIZE, num_runs, group_mask, offs_d, BLOCK_G, HEAD_DIM)
        out = out_ptr + b.to(tl.int64) * out_stride_b + (kv_head * GROUP_SIZE + offs_g)[:, None] * out_stride_h
        tl.store(out + offs_d[None, :], merged.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])


def stream_programs(device: torch.device) -> int:
    """The launch's programs: as many as the GPU keeps resident (PROGRAMS_PER_SM per SM)."""
    return PROGRAMS_PER_SM * num_sms(device)


def decode_attention_stream(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    programs: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """decode_attention (kernels/decode_attention.py, same arguments and result) with the
    step's tiles shared evenly among `programs` (default: stream_programs) resident
    programs. The grid depends only on the device, so it is safe inside CUDA-graph capture
    after one run outside it (which allocates the counters)."""
    batch, num_heads, head_dim = q.shape
    out = checked_output(q, batch, num_heads, head_dim, k_cache, v_cache, block_tables, context_lens, scale, out,
                         kv_scales)
    if batch == 0:
        return out
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    programs = programs or stream_programs(q.device)
    block_n = block_n or _BLOCK_N
    partial_out = torch.empty(programs, 2, group_size, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(programs, 2, group_size, dtype=torch.float32, device=q.device)
    pdl = pdl_enabled(q.device)
    launch(_decode_stream_kernel, (programs,),
        q, k_cache, v_cache, block_tables, context_lens, partial_out, partial_lse,
        split_counters(q.device, batch * num_kv_heads), out,
        kv_scales if kv_scales is not None else context_lens,  # read only for an FP8 cache
        scale * math.log2(math.e),  # scores in log2 units
        batch, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP_SIZE=group_size, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group_size)), BLOCK_N=block_n,
        BLOCK_B=triton.next_power_of_2(batch), MIN_RUN=MIN_RUN_TILES,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=is_fp8(k_cache.dtype), FP8_ASM=fp8_converts_in_asm(q.device), PDL=pdl,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, maxnreg=_MAX_REGISTERS, **launch_options(pdl),
    )
    return out
