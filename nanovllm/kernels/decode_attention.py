"""Split-KV decode attention ("flash decoding") over the paged KV cache.

Every sequence brings one query token per head. Its context is cut into at most
`num_splits` ranges of whole tiles; program (b, kv_head, split) streams its range of
K/V once (whole tiles by TMA copies where decode_config.tile_descriptors gives them) and
serves all query heads that share kv_head (the GQA group) with `tl.dot`, then writes a
partial output and its log-sum-exp. An FP8 cache is read as stored (half bf16's bytes) and
converted to float16 in registers (float32 for float32 queries), the queries with it,
k_scale folded into the scores and v_scale into the output: e4m3 to float16 is one
conversion per pair of values, to bfloat16 goes through float16 (slower: RESULTS.md,
d27e900); V by `fp8_to_f16` where it can, before its transposed read from shared memory.
Queries beyond float16's range saturate there. The last of a group's splits to finish (an
atomic counter per (b, kv_head) says which) merges them: one launch per layer, not a split
kernel and a merge kernel, which at decode batch sizes matters as much as the merge's work.

`decode_attention_rotary` also does rotary_store's work (kernels/rotary_store.py), where the
Triton backend chooses it (steps of up to its ROTARY_MAX_BATCH rows): it starts from the q/k/v
projection's output (a tensor, or the split tiles' SplitSum, summed as it loads q and the
newest key and value), each program rotates its query heads, and the split holding a row's
newest token rotates its key and stores key and value in the cache. Launched with PDL, it
reads the first tile of cached history before waiting for the projection.

The grid and every buffer shape depend only on host-known shapes (batch, heads, the
width of the block table), never on tensor values, so the launch can be captured in a
CUDA graph and replayed with new context_lens / block_tables written in place. The
counters start at zero and the merging program puts its counter back to zero, so each
launch (and replay) finds them as the last one left them.
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_config import (DecodeConfig, checked_output, decode_config, num_tiles, tile_descriptors,
                                            tiles_per_split)
from nanovllm.kernels.fp8 import fp8_converts_in_asm
from nanovllm.kernels.launch import launch
from nanovllm.kernels.paged import (MIN_DOT_ROWS, attend_tile, fp8_queries, load_kv_scales, merge_partials,
                                   paged_rows, tile_blocks, tile_first_row, tile_rows, to_cache)
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.kernels.rotary_store import norm_rope
from nanovllm.kernels.split_counters import last_to_count, split_counters
from nanovllm.kernels.split_gemm import SplitSum, kernel_args, load_output
from nanovllm.kernels.store_kvcache import check_rotary_inputs
from nanovllm.utils.context import Rotary
from nanovllm.utils.fp8 import fp8_max, is_fp8


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    counters_ptr,
    out_ptr,
    kv_scales_ptr,
    qk_scale,
    q_stride_b,
    q_stride_h,
    out_stride_b,
    out_stride_h,
    cache_stride_block,
    cache_stride_offset: tl.constexpr,  # compiled in: a tile's row offsets become constants
    cache_stride_head,
    block_tables_stride_b,
    positions_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    cos_sin_stride,
    split_stride,
    k_desc,  # TMA: K and V as [rows, HEAD_DIM] descriptors (else the caches again, unread)
    v_desc,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    JOIN_TAIL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    ROTARY: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_ASM: tl.constexpr,
    SPLITS: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """Attention of one GQA group over one split of one sequence's context.

    Writes partial_out[b, heads, split] = softmax-weighted V over the split (normalised
    within the split) and partial_lse[b, heads, split] = log2-sum-exp2 of its scores; the
    group's last split to finish merges them all into out[b, heads].

    ROTARY: q_ptr is the fused projection's output [batch, (Hq + 2 Hkv) head_dim], and the
    program does rotary_store's work itself: it normalises (QK_NORM) and rotates its query
    heads, and the split holding the newest token normalises and rotates that token's key,
    stores key and value in the cache (quantized for an FP8 cache, FP8_MAX > 0) and attends
    to them as stored. SPLITS > 0: the projection's output is a SplitSum (kernels/split_gemm.py),
    q_ptr its first part, summed as it is loaded.
    """
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The grid's third dimension, read at run time rather than compiled in: one compile
    # serves every batch size's split count (each was a variant, compiled at start-up).
    num_splits = tl.num_programs(2)
    if PDL:  # launched early (kernels/pdl.py); the output projection after it may start loading its weights
        gdc_launch_dependents()

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    group_mask = offs_g < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + offs_g  # [BLOCK_G] query heads of this KV head
    out_rows = out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :]

    context_len = tl.load(context_lens_ptr + b)
    if context_len == 0:  # a padding row: zeros, from one program
        if PDL:  # out may reuse memory that a kernel still running reads
            gdc_wait()
        if split == 0:
            tl.store(out_rows, tl.zeros([BLOCK_G, HEAD_DIM], out_ptr.dtype.element_ty), mask=group_mask[:, None])
        return
    split_tiles = tiles_per_split(context_len, num_splits, BLOCK_N, MIN_SPLIT_TILES, JOIN_TAIL)
    start = split * split_tiles * BLOCK_N
    if start >= context_len:  # a split this row does not use: nothing to read or write
        return
    end = tl.minimum(start + split_tiles * BLOCK_N, context_len)

    block_table_row = block_tables_ptr + b * block_tables_stride_b
    head_offset = kv_head * cache_stride_head
    q_rows = q_ptr + b * q_stride_b + heads[:, None] * q_stride_h
    # Block ids are read one tile ahead, so a tile's K/V addresses never wait on a load of
    # the same iteration; that lets the pipeliner keep num_stages - 1 K/V tiles in flight.
    block_ids = tile_blocks(block_table_row, start, end, offs_n, BLOCK_SIZE, BLOCK_N)
    if PDL and not ROTARY:  # lengths and block ids are the step's inputs; q and the newest K/V rotary_store's
        gdc_wait()
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score * qk_scale - m_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    loop_start = start
    if ROTARY:
        # Until the wait, only what the projection before does not write: lengths, block
        # tables and positions (written before the step), the rotary table, the norms and
        # the cached K/V of earlier steps. So the first tile streams in while it runs.
        tokens = start + offs_n
        token_mask = tokens < end
        tile = tile_rows(block_ids, start, offs_n, head_offset, cache_stride_block, cache_stride_offset,
                          BLOCK_SIZE, BLOCK_N)[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + tile, mask=token_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + tile, mask=token_mask[:, None], other=0.0)
        block_ids = tile_blocks(block_table_row, start + BLOCK_N, end, offs_n, BLOCK_SIZE, BLOCK_N)
        half = HEAD_DIM // 2
        swapped = (offs_d + half) % HEAD_DIM  # each element's partner in the other half
        position = tl.load(positions_ptr + b).to(tl.int64)
        cos = tl.load(cos_sin_ptr + position * cos_sin_stride + offs_d % half).to(tl.float32)
        sin = tl.load(cos_sin_ptr + position * cos_sin_stride + half + offs_d % half).to(tl.float32)
        q_w, q_w_swapped, k_w, k_w_swapped = cos, cos, cos, cos  # unread without the norms
        if QK_NORM:
            q_w = tl.load(q_norm_ptr + offs_d).to(tl.float32)
            q_w_swapped = tl.load(q_norm_ptr + swapped).to(tl.float32)
            k_w = tl.load(k_norm_ptr + offs_d).to(tl.float32)
            k_w_swapped = tl.load(k_norm_ptr + swapped).to(tl.float32)
        newest = context_len - 1
        newest_block = tl.load(block_table_row + newest // BLOCK_SIZE)
        newest_row = paged_rows(newest_block, newest, head_offset, cache_stride_block, cache_stride_offset,
                                BLOCK_SIZE) + offs_d[None, :]  # [1, HEAD_DIM]
        # The split holding the newest token (start <= newest always: empty splits returned)
        # stores its key and value; a later tile of it reads them back from the cache.
        store_mask = offs_d[None, :] < tl.where(newest < end, HEAD_DIM, 0)
        if PDL:
            gdc_wait()
        dtype: tl.constexpr = out_ptr.dtype.element_ty  # the projection's, rounded to it from a SplitSum
        q = norm_rope(load_output(q_rows, offs_d[None, :], group_mask[:, None], dtype, SPLITS, split_stride),
                      load_output(q_rows, swapped[None, :], group_mask[:, None], dtype, SPLITS, split_stride),
                      cos, sin, q_w, q_w_swapped, eps, HEAD_DIM, QK_NORM)
        # The newest token's key and value as one [1, HEAD_DIM] row each.
        k_src = q_ptr + b * q_stride_b + (NUM_HEADS + kv_head) * HEAD_DIM
        v_src = k_src + NUM_KV_HEADS * HEAD_DIM
        everything = offs_d[None, :] < HEAD_DIM
        k_new = norm_rope(load_output(k_src, offs_d[None, :], everything, dtype, SPLITS, split_stride),
                          load_output(k_src, swapped[None, :], everything, dtype, SPLITS, split_stride),
                          cos, sin, k_w, k_w_swapped, eps, HEAD_DIM, QK_NORM)
        k_scale, v_scale = load_kv_scales(kv_scales_ptr, FP8_MAX)
        k_new = to_cache(k_new, k_scale, k_cache_ptr, FP8_MAX)
        v_new = to_cache(load_output(v_src, offs_d[None, :], everything, dtype, SPLITS, split_stride), v_scale,
                         v_cache_ptr, FP8_MAX)
        tl.store(k_cache_ptr + newest_row, k_new, mask=store_mask)
        tl.store(v_cache_ptr + newest_row, v_new, mask=store_mask)
        tl.debug_barrier()  # the store is seen by this program's later tiles
        new = (tokens == newest)[:, None]  # the newest token, if in the first tile: a select
        k = tl.where(new, k_new, k)
        v = tl.where(new, v_new, v)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=group_mask[:, None], other=0.0)
    # q: [BLOCK_G, HEAD_DIM]; padding rows are zeros and never stored
    if FP8:  # scores = q . (k_fp8 * k_scale) * qk_scale
        qk_scale = qk_scale * tl.load(kv_scales_ptr)
        q = fp8_queries(q)
    if ROTARY:  # the first tile, loaded above
        # The first tile of a split always holds a valid token, so the running max is finite.
        acc, l_i, m_i = attend_tile(q, k, v, token_mask, acc, l_i, m_i, qk_scale, True, DOT_PRECISION, FP8,
                                     FP8_ASM)
        loop_start = start + BLOCK_N
    # Whole tiles without masks, then the row's last tile when partial (only its last split has one).
    tail = tl.maximum(loop_start, start + (end - start) // BLOCK_N * BLOCK_N)
    for tile_start in range(loop_start, tail, BLOCK_N):
        rows = tile_rows(block_ids, tile_start, offs_n, head_offset, cache_stride_block, cache_stride_offset,
                          BLOCK_SIZE, BLOCK_N)
        # TMA: the tile is rows [first, first + BLOCK_N) of the cache's [rows, HEAD_DIM] view
        first = tile_first_row(block_ids, tile_start, head_offset, cache_stride_block, HEAD_DIM, BLOCK_SIZE)
        block_ids = tile_blocks(block_table_row, tile_start + BLOCK_N, end, offs_n, BLOCK_SIZE, BLOCK_N)
        if TMA:
            k = k_desc.load([first, 0])
            v = v_desc.load([first, 0])
        else:
            k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :])
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :])
        acc, l_i, m_i = attend_tile(q, k, v, None, acc, l_i, m_i, qk_scale, False, DOT_PRECISION, FP8,
                                     FP8_ASM)
    if tail < end:
        token_mask = tail + offs_n < end
        rows = tile_rows(block_ids, tail, offs_n, head_offset, cache_stride_block, cache_stride_offset,
                          BLOCK_SIZE, BLOCK_N)
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=token_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=token_mask[:, None], other=0.0)
        acc, l_i, m_i = attend_tile(q, k, v, token_mask, acc, l_i, m_i, qk_scale, True, DOT_PRECISION, FP8,
                                     FP8_ASM)
    if FP8:
        acc = acc * tl.load(kv_scales_ptr + 1)

    num_used = (num_tiles(context_len, BLOCK_N) + split_tiles - 1) // split_tiles  # splits that run
    if num_used == 1:  # nothing to merge
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=group_mask[:, None])
        return
    first_row = (b * NUM_HEADS + heads) * num_splits  # [BLOCK_G] rows of [B * Hq * splits]
    tl.store(partial_out_ptr + (first_row + split)[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None],
             mask=group_mask[:, None])
    tl.store(partial_lse_ptr + first_row + split, m_i + tl.log2(l_i), mask=group_mask)
    # Release the partials above, acquire everyone else's: the program that brings the
    # count to num_used sees every split's results.
    if last_to_count(counters_ptr + b * NUM_KV_HEADS + kv_head, num_used):
        merged = merge_partials(partial_out_ptr, partial_lse_ptr, first_row, num_used, group_mask, offs_d, BLOCK_G,
                                HEAD_DIM)
        tl.store(out_rows, merged.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])


def decode_attention_with_config(q: torch.Tensor | SplitSum, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 config: DecodeConfig, out: torch.Tensor | None = None,
                                 kv_scales: torch.Tensor | None = None, rotary: Rotary | None = None) -> torch.Tensor:
    """`decode_attention` with explicit launch parameters (for tests and tuning); with
    `rotary`, q is the fused projection's output (decode_attention_rotary), a tensor or a SplitSum."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    dtype = q.dtype  # a SplitSum's parts are fp32: its dtype is the projection's
    splits = split_stride = 0
    if isinstance(q, SplitSum):
        if rotary is None:
            raise ValueError("a SplitSum q needs rotary (decode_attention_rotary)")
        q, splits, split_stride = kernel_args(q)
    if rotary is not None:  # head_dim from the cache; checked by check_kv_cache below
        batch = q.shape[0]
        num_heads = check_rotary_inputs(q, None, num_kv_heads, head_dim, rotary.positions, rotary.cos_sin_cache,
                                        rotary.q_norm_weight, rotary.k_norm_weight)
        q_strides = (q.stride(0), head_dim)
    else:
        batch, num_heads, head_dim = q.shape
        q_strides = (q.stride(0), q.stride(1))
    out = checked_output(q, batch, num_heads, head_dim, k_cache, v_cache, block_tables, context_lens, scale, out,
                         kv_scales, dtype)
    if batch == 0:
        return out
    group_size = num_heads // num_kv_heads
    num_splits = config.num_splits
    # each split's output (normalised on its own) and log2-sum-exp2 of its scores, fp32
    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    qk_norm = rotary is not None and rotary.q_norm_weight is not None
    unread = context_lens  # pointer arguments a variant never reads
    # positions, the rotary table, the q and k norms' weights, eps, the table's row stride
    rope = (unread, unread, unread, unread, 0.0, 0) if rotary is None else (
        rotary.positions, rotary.cos_sin_cache, rotary.q_norm_weight if qk_norm else unread,
        rotary.k_norm_weight if qk_norm else unread, rotary.eps, rotary.cos_sin_cache.stride(0))
    pdl = pdl_enabled(q.device)
    # Not with rotary: its program stores the newest K/V and may read them back in a later
    # tile, which a TMA copy would see only after a proxy fence (no gain measured there).
    descriptors = tile_descriptors(k_cache, v_cache, config.block_n) if rotary is None else None
    launch(_decode_split_kernel, (batch, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_tables, context_lens, partial_out, partial_lse,
        split_counters(q.device, batch * num_kv_heads), out,
        kv_scales if kv_scales is not None else unread,  # read only for an FP8 cache
        scale * math.log2(math.e),  # scores in log2 units: exp(x) = exp2(x * log2(e))
        *q_strides, out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), *rope, split_stride, *(descriptors or (k_cache, v_cache)),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP_SIZE=group_size, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group_size)),
        BLOCK_N=config.block_n, MIN_SPLIT_TILES=config.min_split_tiles, JOIN_TAIL=config.join_tail,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        FP8=is_fp8(k_cache.dtype), ROTARY=rotary is not None, QK_NORM=qk_norm, FP8_MAX=fp8_max(k_cache.dtype),
        FP8_ASM=fp8_converts_in_asm(q.device), SPLITS=splits, TMA=descriptors is not None,
        PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl),
        **({"maxnreg": config.max_registers} if config.max_registers else {}),
    )
    return out


def _config(batch: int, k_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> DecodeConfig:
    """decode_config for `batch` rows of queries in dtype over this cache and block tables."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return decode_config(batch, num_kv_heads, block_tables.shape[1] * block_size, head_dim, dtype, k_cache.device,
                         k_cache.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged history.

    Args:
        q: [batch, num_heads, head_dim], contiguous in head_dim (views of a fused qkv
            projection are fine). The new token's K/V must already be in the cache.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or FP8
            (holding K / k_scale and V / v_scale).
        block_tables: [batch, max_blocks] int32, rows contiguous; entries past a row's
            context are never read (pad with -1).
        context_lens: [batch] int32, tokens of history including the new one; 0 marks a
            padding row, whose output is zeros.
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [batch, num_heads, head_dim] output in q's dtype (any strides with a
            contiguous head_dim); allocated when None.
        kv_scales: [k_scale, v_scale] float32, for an FP8 cache.

    Returns:
        [batch, num_heads, head_dim] in q's dtype (`out` when given).

    One launch, its grid fixed by (batch, num_kv_heads, max_blocks): safe inside CUDA-graph
    capture after one run outside it (which allocates the split counters).
    """
    config = _config(q.shape[0], k_cache, block_tables, q.dtype)
    return decode_attention_with_config(q, k_cache, v_cache, block_tables, context_lens, scale, config, out, kv_scales)


def decode_attention_rotary(
    qkv: torch.Tensor | SplitSum,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    rotary: Rotary,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """rotary_store then decode_attention in one kernel: from the fused projection qkv
    ([batch, (num_heads + 2 num_kv_heads) head_dim], rows contiguous; or a SplitSum of it,
    kernels/split_gemm.py) of each sequence's newest token, at context_lens - 1 of its
    block table, to attention's output [batch, num_heads, head_dim]. q/k are normalised
    (rotary's norm weights, when given) and rotated at rotary.positions; the newest token's
    key and value are stored in the cache (as rotary_store stores them: k / k_scale and v /
    v_scale for an FP8 cache). One kernel boundary fewer per layer, and the cached history
    streams in while the projection before it still runs (PDL)."""
    config = _config(qkv.shape[0], k_cache, block_tables, qkv.dtype)
    return decode_attention_with_config(qkv, k_cache, v_cache, block_tables, context_lens, scale, config, out,
                                        kv_scales, rotary)
