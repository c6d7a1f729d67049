"""Decode attention as one balanced stream of tiles, for steps whose rows fill the GPU.

decode_attention.py gives each (sequence, KV head) pair its own programs. Each program pays
a start (the row's length, then its block ids, then its first tiles: three round trips to
memory before anything streams) and an end (its pipeline drains, then it stores), and at
nano-vllm's ~500-token rows that is a large share of a program's life: over an FP8 cache,
whose tiles carry half the bytes, decode attention at 256 rows ran at ~67% of copy bandwidth
on the H200 (RESULTS.md, session 44) against 99% at 2,048-token rows.

Here every (sequence, KV head) pair is an "item" of whole BLOCK_N-token tiles, the items'
tiles are laid end to end (`stream_work`, once per step for every layer), and a grid of
about as many programs as the GPU holds at once cuts the stream into equal ranges. A
program's pipeline runs through its whole range, from one item into the next: at an item's
first tile it loads the item's queries and restarts its running softmax, at the item's last
tile (or the range's) it stores the result. An item cut by a range boundary leaves a partial
result in each program that holds part of it; the last of those to finish (a counter per
item) merges them, as decode attention's splits merge.

The work list has, per tile: its first block id, its item (sequence * KV heads + head), its
first token and how many of its tokens are in the context. A row without context (a
CUDA-graph padding row) is one tile with none, whose output is zeros.
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_config import checked_output
from nanovllm.kernels.fp8 import fp8_converts_in_asm, fp8_to_f16
from nanovllm.kernels.gpu import num_sms
from nanovllm.kernels.launch import launch
from nanovllm.kernels.paged import (MIN_DOT_ROWS, fp8_queries, merge_partial, online_softmax_step, tile_first_row,
                                   tma_tiles, v_open_groups, v_tile_first_row, v_transposed)
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.kernels.split_counters import split_counters
from nanovllm.utils.env import env_int
from nanovllm.utils.fp8 import is_fp8

# Off until measured against decode_attention on the GPU (NANOVLLM_DECODE_STREAM=1).
STREAM = env_int("NANOVLLM_DECODE_STREAM", 0, least=0) > 0
# Programs per SM: as many as are resident at once, so the ranges run in one wave. Over an
# FP8 cache a program of two warps and three 16 KiB stages; over a 16-bit one four warps and
# three 32 KiB stages. NANOVLLM_DECODE_STREAM_PROGRAMS sets it (sweeps).
_PROGRAMS_PER_SM = env_int("NANOVLLM_DECODE_STREAM_PROGRAMS", 0, least=0)
_FP8_PROGRAMS_PER_SM, _PROGRAMS_PER_SM_16 = 4, 2
_TILE_BYTES = 16 * 1024  # a K tile in the queries' dtype: 64 tokens at head_dim 128, as decode_config's
_NUM_STAGES = 3
_FIELDS = 4  # a work entry: block id, item, first token, tokens in context


@dataclass(frozen=True, slots=True)
class StreamWork:
    """One step's work list (built by `stream_work`), shared by every layer's launch."""

    tiles: torch.Tensor  # [capacity, _FIELDS] int32
    total: torch.Tensor  # [1] int32: the entries in use
    block_n: int


def stream_block_n(head_dim: int, dtype: torch.dtype, block_size: int) -> int:
    """Tokens per tile: _TILE_BYTES of K in the queries' dtype, 16 to 128, within a block
    (fewer where a block holds fewer: the largest power of two dividing block_size)."""
    return min(max(16, min(128, _TILE_BYTES // (head_dim * dtype.itemsize))), block_size & -block_size)


def stream_usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decode_attention_stream serves this step: STREAM on and the kernel can."""
    block_n = stream_block_n(k_cache.shape[3], q.dtype, k_cache.shape[1])
    return STREAM and _unservable(q, k_cache, v_cache, block_n) is None


def _unservable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> str | None:
    """Why the kernel cannot serve these tensors, or None: it reads whole tiles by TMA
    (tma_tiles: a head-major 16-bit or FP8 cache), with 16-bit queries or float32 ones over
    FP8, and no open V groups."""
    if block_n < 16 or tma_tiles(k_cache, v_cache, block_n) is None:
        return f"no TMA tiles of {block_n} tokens in this cache (kernels/paged.py's tma_tiles)"
    if q.dtype == torch.float32 and not is_fp8(k_cache.dtype):
        return "float32 queries need an FP8 cache"
    if v_open_groups(k_cache, v_cache):
        return "open V groups are not read here"
    return None


@triton.jit
def _stream_work_kernel(context_lens_ptr, block_tables_ptr, tiles_ptr, total_ptr, batch, block_tables_stride,
                        NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_B: tl.constexpr, CHUNK: tl.constexpr):
    """Program b writes row b's entries: NUM_KV_HEADS items of its tiles, after every
    earlier row's."""
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_B)
    lens = tl.load(context_lens_ptr + rows, mask=rows < batch, other=0)
    tiles = tl.where(rows < batch, tl.maximum((lens + BLOCK_N - 1) // BLOCK_N, 1), 0)
    if b == 0:
        tl.store(total_ptr, tl.sum(tiles) * NUM_KV_HEADS)
    first = tl.sum(tl.where(rows < b, tiles, 0)) * NUM_KV_HEADS
    length = tl.load(context_lens_ptr + b)
    count = tl.maximum((length + BLOCK_N - 1) // BLOCK_N, 1)
    fields = tl.arange(0, 4)[None, :]
    for chunk in range(0, count, CHUNK):
        t = chunk + tl.arange(0, CHUNK)
        start = t * BLOCK_N
        block = tl.load(block_tables_ptr + b.to(tl.int64) * block_tables_stride + start // BLOCK_SIZE,
                        mask=start < length, other=0)
        block = tl.maximum(block, 0)  # a padding row's table may hold -1: any block will do
        valid = tl.minimum(tl.maximum(length - start, 0), BLOCK_N)
        for head in range(NUM_KV_HEADS):
            entry = tl.where(fields == 0, block[:, None],
                             tl.where(fields == 1, b * NUM_KV_HEADS + head,
                                      tl.where(fields == 2, start[:, None], valid[:, None])))
            g = first + head * count + t
            tl.store(tiles_ptr + g[:, None] * 4 + fields, entry, mask=(t < count)[:, None])


def stream_work(context_lens: torch.Tensor, block_tables: torch.Tensor, num_kv_heads: int, block_size: int,
                block_n: int) -> StreamWork:
    """The step's work list: every row's tiles, num_kv_heads items a row (grid and buffers
    from host-known shapes only, so it is captured in CUDA graphs with the step)."""
    batch, max_blocks = block_tables.shape
    capacity = batch * num_kv_heads * max(triton.cdiv(max_blocks * block_size, block_n), 1)
    tiles = torch.empty(max(capacity, 1), _FIELDS, dtype=torch.int32, device=block_tables.device)
    total = torch.zeros(1, dtype=torch.int32, device=block_tables.device)
    if batch:
        launch(_stream_work_kernel, (batch,), context_lens, block_tables, tiles, total, batch, block_tables.stride(0),
               NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size, BLOCK_N=block_n,
               BLOCK_B=triton.next_power_of_2(batch), CHUNK=64)
    return StreamWork(tiles, total, block_n)


@triton.jit
def _entry(tiles_ptr, g, total):
    """Work entry g (block, item, first token, tokens in context); item -1 past the end."""
    inside = g < total
    entry = tiles_ptr + g * 4
    return (tl.load(entry, mask=inside, other=0), tl.load(entry + 1, mask=inside, other=-1),
            tl.load(entry + 2, mask=inside, other=0), tl.load(entry + 3, mask=inside, other=0))


@triton.jit
def _owner(g, total, programs):
    """The program whose range holds entry g: the last p with p * total // programs <= g."""
    return (((g + 1).to(tl.int64) * programs - 1) // total).to(tl.int32)


@triton.jit
def _range_start(p, total, programs):
    return (p.to(tl.int64) * total // programs).to(tl.int32)


@triton.jit
def _finish_piece(item, first_tile, context_lens_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr,
                  out_stride_b, out_stride_h, total, programs, group_mask, offs_g, offs_d,
                  NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Count this program's partial result of item (whose tiles start at entry first_tile);
    the last of the item's programs to finish merges them all into out."""
    b = item // NUM_KV_HEADS
    count = tl.maximum((tl.load(context_lens_ptr + b) + BLOCK_N - 1) // BLOCK_N, 1)
    p0 = _owner(first_tile, total, programs)
    pieces = _owner(first_tile + count - 1, total, programs) - p0 + 1
    counter = counters_ptr + item
    # Release this program's partial, acquire the others': the program that brings the
    # count to `pieces` sees every one.
    if tl.atomic_add(counter, 1, sem="acq_rel") == pieces - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed")
        # Program p0's piece is in its second slot unless its range starts at the item's
        # first tile; every later program's is in its first.
        lse_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        weights = tl.zeros([BLOCK_G], tl.float32)
        merged = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for i in range(0, pieces):
            slot = tl.where(i == 0, p0 * 2 + (_range_start(p0, total, programs) != first_tile), (p0 + i) * 2)
            merged, weights, lse_max = merge_partial(partial_out_ptr, partial_lse_ptr, slot * BLOCK_G + offs_g,
                                                     group_mask, offs_d, merged, weights, lse_max, HEAD_DIM)
        heads = (item % NUM_KV_HEADS) * GROUP_SIZE + offs_g
        out = out_ptr + b.to(tl.int64) * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :]
        tl.store(out, (merged / weights[:, None]).to(out_ptr.dtype.element_ty), mask=group_mask[:, None])


@triton.jit
def _decode_stream_kernel(
    q_ptr, context_lens_ptr, tiles_ptr, total_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr,
    kv_scales_ptr, k_desc, v_desc, qk_scale, q_stride_b, q_stride_h, out_stride_b, out_stride_h,
    cache_stride_block, cache_stride_head,
    NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, FP8_ASM: tl.constexpr, V_T: tl.constexpr,
    PDL: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program p streams work entries [p * total // P, (p + 1) * total // P), P = min(grid, total)."""
    pid = tl.program_id(0)
    if PDL:  # q and the newest K/V come from rotary_store, the work list from earlier in the step
        gdc_launch_dependents()
        gdc_wait()
    total = tl.load(total_ptr)
    programs = tl.minimum(tl.num_programs(0), total)
    if pid >= programs:
        return
    start_g = _range_start(pid, total, programs)
    end_g = _range_start(pid + 1, total, programs)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    group_mask = offs_g < GROUP_SIZE
    v_scale = 1.0
    if FP8:  # scores = q . (k_fp8 * k_scale) * qk_scale; the output times v_scale
        qk_scale = qk_scale * tl.load(kv_scales_ptr)
        v_scale = tl.load(kv_scales_ptr + 1)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score * qk_scale - m_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    q = tl.zeros([BLOCK_G, HEAD_DIM], q_ptr.dtype.element_ty)
    if FP8:
        q = fp8_queries(q)  # the loop's queries' type
    whole = start_g < 0  # the current piece began at its item's first tile
    began = whole  # ... at the range's first entry (its partial goes to slot 0, else 1)
    # Entries are read one tile ahead (and the one after, to see where the item ends), so
    # a tile's addresses never wait on a load of the same iteration.
    block, item, token, valid = _entry(tiles_ptr, start_g, total)
    for g in tl.range(start_g, end_g, num_stages=NUM_STAGES):
        next_block, next_item, next_token, next_valid = _entry(tiles_ptr, g + 1, total)
        kv_head = item % NUM_KV_HEADS
        head_offset = kv_head * cache_stride_head
        k = k_desc.load([tile_first_row(block, token, head_offset, cache_stride_block, HEAD_DIM, BLOCK_SIZE), 0])
        if V_T:  # V's tile [HEAD_DIM, BLOCK_N] read as K's, then transposed for p.v
            v = tl.trans(v_desc.load([v_tile_first_row(block, head_offset, cache_stride_block, BLOCK_SIZE),
                                      token % BLOCK_SIZE]))
        else:
            v = v_desc.load([tile_first_row(block, token, head_offset, cache_stride_block, HEAD_DIM, BLOCK_SIZE), 0])
        heads = kv_head * GROUP_SIZE + offs_g
        first = (token == 0) | (g == start_g)  # a piece starts: its queries, a fresh softmax
        if first:  # (acc needs no reset: the first tile's alpha is 0)
            q = tl.load(q_ptr + (item // NUM_KV_HEADS).to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h
                        + offs_d[None, :], mask=group_mask[:, None], other=0.0)
            if FP8:
                q = fp8_queries(q)
        if FP8:
            k = k.to(q.dtype)
            v = fp8_to_f16(v) if FP8_ASM else v.to(q.dtype)
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        whole = tl.where(first, token == 0, whole)
        began = tl.where(first, g == start_g, began)
        # Tokens past the context are masked out of the scores and zeroed in V (a block's
        # unwritten bytes may hold NaN codes). A row without context scores 0 everywhere,
        # finite, so acc stays 0 (its V is all zeroed), and its output is zeros below.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores = tl.where((offs_n < valid)[None, :], scores, tl.where(valid > 0, float("-inf"), 0.0))
        if valid < BLOCK_N:
            v = tl.where((offs_n < valid)[:, None], v, 0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, scores, qk_scale, v, DOT_PRECISION)
        item_ends = next_item != item
        if item_ends | (g == end_g - 1):  # the piece ends: store it
            result = tl.where(valid > 0, acc * (v_scale / l_i)[:, None], 0.0)
            if whole & item_ends:  # the whole item: its output
                out = (out_ptr + (item // NUM_KV_HEADS).to(tl.int64) * out_stride_b + heads[:, None] * out_stride_h
                       + offs_d[None, :])
                tl.store(out, result.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])
            else:
                rows = (pid * 2 + tl.where(began, 0, 1)) * BLOCK_G + offs_g
                tl.store(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], result,
                         mask=group_mask[:, None])
                tl.store(partial_lse_ptr + rows, m_i + tl.log2(l_i), mask=group_mask)
        block, item, token, valid = next_block, next_item, next_token, next_valid

    # The range's first and last items, where cut by its ends, count their partials.
    _, first_item, first_token, _ = _entry(tiles_ptr, start_g, total)
    _, last_item, _, _ = _entry(tiles_ptr, end_g - 1, total)
    _, after_item, _, _ = _entry(tiles_ptr, end_g, total)
    first_cut = (first_token > 0) | ((first_item == last_item) & (after_item == last_item))
    if first_cut:
        _finish_piece(first_item, start_g - first_token // BLOCK_N, context_lens_ptr, partial_out_ptr,
                      partial_lse_ptr, counters_ptr, out_ptr, out_stride_b, out_stride_h, total, programs,
                      group_mask, offs_g, offs_d, NUM_KV_HEADS, GROUP_SIZE, BLOCK_G, HEAD_DIM, BLOCK_N)
    if (last_item != first_item) & (after_item == last_item):
        _, _, last_token, _ = _entry(tiles_ptr, end_g - 1, total)
        _finish_piece(last_item, end_g - 1 - last_token // BLOCK_N, context_lens_ptr, partial_out_ptr,
                      partial_lse_ptr, counters_ptr, out_ptr, out_stride_b, out_stride_h, total, programs,
                      group_mask, offs_g, offs_d, NUM_KV_HEADS, GROUP_SIZE, BLOCK_G, HEAD_DIM, BLOCK_N)


def stream_programs(device: torch.device, fp8: bool) -> int:
    """The grid: about as many programs as are resident at once."""
    per_sm = _PROGRAMS_PER_SM or (_FP8_PROGRAMS_PER_SM if fp8 else _PROGRAMS_PER_SM_16)
    return per_sm * num_sms(device)


def decode_attention_stream(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
                            work: StreamWork | None = None, programs: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """decode_attention (same arguments and result) as one balanced stream of tiles, where
    stream_usable says it serves. work: the step's list from stream_work (built here when
    None); programs: the grid (stream_programs when None); block_n: tokens per tile
    (stream_block_n when None; tests take small ones)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = checked_output(q, batch, num_heads, head_dim, k_cache, v_cache, block_tables, context_lens, scale, out,
                         kv_scales)
    if batch == 0:
        return out
    block_n = block_n or stream_block_n(head_dim, q.dtype, block_size)
    reason = _unservable(q, k_cache, v_cache, block_n)
    if reason is not None:
        raise ValueError(f"decode_attention_stream cannot serve this step: {reason}")
    descriptors = tma_tiles(k_cache, v_cache, block_n)
    if work is None:
        work = stream_work(context_lens, block_tables, num_kv_heads, block_size, block_n)
    if work.block_n != block_n:
        raise ValueError(f"the work list is of {work.block_n}-token tiles, the kernel's are {block_n}")
    fp8 = is_fp8(k_cache.dtype)
    programs = programs or stream_programs(q.device, fp8)
    group_size = num_heads // num_kv_heads
    block_g = max(MIN_DOT_ROWS, triton.next_power_of_2(group_size))
    partial_out = torch.empty(programs * 2 * block_g, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(programs * 2 * block_g, dtype=torch.float32, device=q.device)
    pdl = pdl_enabled(q.device)
    transposed = v_transposed(k_cache, v_cache)
    launch(_decode_stream_kernel, (programs,),
           q, context_lens, work.tiles, work.total, partial_out, partial_lse,
           split_counters(q.device, batch * num_kv_heads), out,
           kv_scales if kv_scales is not None else context_lens,  # read only for an FP8 cache
           *descriptors, scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
           k_cache.stride(0), k_cache.stride(2),
           NUM_KV_HEADS=num_kv_heads, GROUP_SIZE=group_size, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
           BLOCK_G=block_g, BLOCK_N=block_n, FP8=fp8, FP8_ASM=fp8 and fp8_converts_in_asm(q.device) and not transposed,
           V_T=transposed, PDL=pdl, NUM_STAGES=_NUM_STAGES,
           DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
           num_warps=2 if fp8 else 4, **launch_options(pdl))
    return out
