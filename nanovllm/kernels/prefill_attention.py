"""Packed varlen causal prefill attention over the paged KV cache.

The new tokens of every sequence are packed along one axis (cu_seqlens_q); each
sequence's full history, cached prefix and new tokens alike, is read from the cache
through its block table. Query i of a sequence with len_q new and len_k total tokens
sits at position len_k - len_q + i and attends keys 0..that position. This one kernel
serves fresh prompts (len_k == len_q), prefix-cache hits and chunked prefill.

Program (m_tile, b, head) computes BLOCK_M queries of one head with an online softmax
in fp32: first the key tiles that lie wholly below the causal diagonal, with no mask (each
one TMA copy of K and one of V with TMA_TILES, where kernels/paged.py's tma_tiles allows),
then the few tiles that cross it, masked; tiles above it are never visited. An FP8 cache
is converted as its tiles are read, to float16 for 16-bit queries (as decode attention
does: the queries with it, saturated to its range; e4m3 to bfloat16 goes through float16)
and to float32 for float32 ones, k_scale folded into the scores and v_scale into the
output.

With max_seqlen_q=None the grid depends on the shapes alone, as a CUDA graph needs (the
prefill graphs capture attention, executor/piecewise.py), and the number of sequences in
use is read on the device (num_seqs). Sequence b's query tiles are numbered from
first_tile(b) = cu_seqlens_q[b] // BLOCK_M + b on: the number grows by at least a
sequence's tile count from one sequence to the next, so first_tile(num_seqs) bounds them
all, and a tile's sequence is the last b with first_tile(b) <= tile, found by a binary
search over cu_seqlens_q. Each program takes every num_programs-th tile number, from
the last down; a number that falls in the gap after a sequence's last tile does nothing.
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch
from nanovllm.kernels.paged import fp8_queries, online_softmax_step, tile_blocks, tile_first_row, tile_rows, tma_tiles
from nanovllm.kernels.prefill_config import PrefillConfig, prefill_config
from nanovllm.kernels.store_kvcache import check_head_dim, check_kv_cache, check_scale
from nanovllm.utils.env import env_flag
from nanovllm.utils.fp8 import is_fp8

# With max_seqlen_q=None, programs per head beyond one per query tile of the rows: a
# sequence's last tile is partial, so sequences add tiles, which these programs (and the
# others, in turn) take. Any count is correct (each program strides over the tile numbers);
# 16 more per head were chosen for 128-row tiles and not re-measured for 64.
_SEARCH_EXTRA_PROGRAMS = 16
# Whole key tiles below the diagonal by TMA copies (kernels/paged.py's tma_tiles), as decode
# attention reads its tiles; NANOVLLM_PREFILL_TMA=0 keeps loads (scripts/gpu_check.sh's
# prefill-shapes mode times both).
TMA_TILES = env_flag("NANOVLLM_PREFILL_TMA", True)


@triton.jit
def _attend_key_tiles(
    acc,
    l_i,
    m_i,
    q,
    positions,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,
    v_desc,
    block_table_row,
    head_offset,
    key_lo,
    key_hi,
    qk_scale,
    cache_stride_block,
    cache_stride_offset,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
):
    """Fold keys [key_lo, key_hi) into the running softmax state (acc, l_i, m_i).

    With MASKED=False every key must be visible to every query row (below the diagonal
    and inside the sequence) and key_hi a multiple of BLOCK_N past key_lo: no mask at all,
    and with TMA (descriptors from tma_tiles) each tile is one copy of K and one of V.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # Block ids are read one tile ahead, so a tile's K/V addresses never wait on a load of
    # the same iteration; that lets the pipeliner overlap K/V loads with the math.
    block_ids = tile_blocks(block_table_row, key_lo, key_hi, offs_n, BLOCK_SIZE, BLOCK_N)
    for tile_start in range(key_lo, key_hi, BLOCK_N):
        keys = tile_start + offs_n  # [BLOCK_N] key positions
        rows = tile_rows(block_ids, tile_start, offs_n, head_offset, cache_stride_block, cache_stride_offset,
                         BLOCK_SIZE, BLOCK_N)
        # TMA: the tile is rows [first, first + BLOCK_N) of the cache's [rows, HEAD_DIM] view
        first = tile_first_row(block_ids, tile_start, head_offset, cache_stride_block, HEAD_DIM, BLOCK_SIZE)
        block_ids = tile_blocks(block_table_row, tile_start + BLOCK_N, key_hi, offs_n, BLOCK_SIZE, BLOCK_N)
        if TMA and not MASKED:
            k = k_desc.load([first, 0])
            v = v_desc.load([first, 0])
        elif MASKED:
            key_mask = (keys < key_hi)[:, None]
            k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=key_mask, other=0.0)
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=key_mask, other=0.0)
        else:
            k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :])
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :])
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            # Query rows past len_q sit at positions >= len_k: they see only zero-loaded
            # keys beyond the sequence, stay finite, and are never stored.
            scores = tl.where(keys[None, :] <= positions[:, None], scores, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, scores, qk_scale, v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_query_tile(
    b,
    m_tile,
    head,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,
    v_desc,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    block_tables_ptr,
    out_ptr,
    kv_scales_ptr,
    qk_scale,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    block_tables_stride_b,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
):
    """Query tile m_tile (BLOCK_M new tokens) of sequence b, one query head; nothing
    where the sequence has fewer new tokens."""
    q_begin = tl.load(cu_seqlens_q_ptr + b)
    len_q = tl.load(cu_seqlens_q_ptr + b + 1) - q_begin
    m_start = m_tile * BLOCK_M
    if m_start < len_q:
        len_k = tl.load(cu_seqlens_k_ptr + b + 1) - tl.load(cu_seqlens_k_ptr + b)
        offs_m = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
        offs_d = tl.arange(0, HEAD_DIM)
        query_mask = offs_m < len_q
        tokens = (q_begin + offs_m).to(tl.int64)  # [BLOCK_M] rows of the packed q / out
        q = tl.load(
            q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :],
            mask=query_mask[:, None],
            other=0.0,
        )  # [BLOCK_M, HEAD_DIM]
        if FP8:  # scores = q . (k_fp8 * k_scale) * qk_scale
            qk_scale = qk_scale * tl.load(kv_scales_ptr)
            q = fp8_queries(q)

        first_position = len_k - len_q + m_start  # position of the tile's first query
        positions = first_position + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        # Keys below this tile-aligned bound are visible to every query of the tile.
        unmasked_hi = (first_position // BLOCK_N) * BLOCK_N
        key_hi = tl.minimum(first_position + BLOCK_M, len_k)

        block_table_row = block_tables_ptr + b * block_tables_stride_b
        head_offset = (head // GROUP_SIZE) * cache_stride_head
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score * qk_scale - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, positions, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_table_row, head_offset,
            0, unmasked_hi, qk_scale, cache_stride_block, cache_stride_offset,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, FP8, TMA,
        )
        # The first masked tile holds key unmasked_hi <= every row's position, so m_i is
        # finite from here on and no row divides by zero.
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, positions, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_table_row, head_offset,
            unmasked_hi, key_hi, qk_scale, cache_stride_block, cache_stride_offset,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, FP8, TMA,
        )

        out = acc / l_i[:, None]
        if FP8:
            out = out * tl.load(kv_scales_ptr + 1)
        tl.store(
            out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=query_mask[:, None],
        )


# The bucket a graph captures sets search_steps: one compiled kernel for them all.
@triton.jit(do_not_specialize=["search_steps"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,  # TMA: K and V as [rows, HEAD_DIM] descriptors (else the caches again, unread)
    v_desc,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    block_tables_ptr,
    out_ptr,
    kv_scales_ptr,
    num_seqs_ptr,
    qk_scale,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    block_tables_stride_b,
    search_steps,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    TILE_SEARCH: tl.constexpr,
    TMA: tl.constexpr,
):
    """BLOCK_M new tokens of one sequence, one query head (TILE_SEARCH: each of a strided
    share of every sequence's query tiles, the module docstring)."""
    head = tl.program_id(2)
    if TILE_SEARCH:
        seqs = tl.load(num_seqs_ptr)
        num_tiles = tl.load(cu_seqlens_q_ptr + seqs) // BLOCK_M + seqs  # first_tile(seqs)
        first, stride = tl.program_id(0), tl.num_programs(0)
    else:  # this program's one tile
        seqs = tl.program_id(1)
        num_tiles, first, stride = 1, 0, 1
    for i in range(first, num_tiles, stride):
        if TILE_SEARCH:
            # The last sequences' tiles first: a prompt chunk comes after the decodes it joins.
            tile = num_tiles - 1 - i
            lo = tl.full([], 0, tl.int32)  # the largest b with first_tile(b) <= tile lies in [lo, hi)
            hi = lo + seqs
            for _ in range(search_steps):
                mid = (lo + hi) // 2
                below = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= tile
                lo = tl.where(below, mid, lo)
                hi = tl.where(below, hi, mid)
            b = lo.to(tl.int64)
            m_tile = tile - (tl.load(cu_seqlens_q_ptr + lo) // BLOCK_M + lo)
        else:
            b = seqs.to(tl.int64)
            # Highest query tiles first: they have the most keys, so the tail of the grid is short.
            m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
        _attend_query_tile(
            b, m_tile, head, q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
            block_tables_ptr, out_ptr, kv_scales_ptr, qk_scale, q_stride_t, q_stride_h, out_stride_t, out_stride_h,
            cache_stride_block, cache_stride_offset, cache_stride_head, block_tables_stride_b,
            GROUP_SIZE, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, DOT_PRECISION, FP8, TMA,
        )


def prefill_attention_with_config(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int | None,
    scale: float,
    config: PrefillConfig,
    kv_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """`prefill_attention` with explicit launch parameters (for tests and tuning)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_head_dim(head_dim)
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_dim, q.dtype, kv_scales)
    check_scale(scale)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} differ"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{batch}, max_blocks] with contiguous rows")
    # [num_tokens, num_heads, head_dim]
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of q's shape {tuple(q.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    search = max_seqlen_q is None
    if search and (num_seqs is None or num_seqs.shape != (1,) or num_seqs.dtype != torch.int32):
        raise ValueError("max_seqlen_q=None needs num_seqs, a [1] int32 tensor on q's device")
    if batch <= 0 or num_tokens == 0 or (not search and max_seqlen_q <= 0):
        return out

    if search:  # programs that walk the query tiles of any split into `batch` sequences
        grid = (triton.cdiv(num_tokens, config.block_m) + min(batch, _SEARCH_EXTRA_PROGRAMS), 1, num_heads)
    else:
        grid = (triton.cdiv(max_seqlen_q, config.block_m), batch, num_heads)
    descriptors = tma_tiles(k_cache, v_cache, config.block_n) if TMA_TILES else None
    launch(_prefill_kernel, grid,
        q,
        k_cache,
        v_cache,
        *(descriptors or (k_cache, v_cache)),
        cu_seqlens_q,
        cu_seqlens_k,
        block_tables,
        out,
        kv_scales if kv_scales is not None else cu_seqlens_q,  # unread unless FP8
        num_seqs if search else cu_seqlens_q,  # unread unless searched
        scale * math.log2(math.e),  # scores in log2 units: exp(x) = exp2(x * log2(e))
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),  # V's: the same
        block_tables.stride(0),
        batch.bit_length() if search else 0,  # halvings of [0, batch) down to one sequence
        GROUP_SIZE=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=is_fp8(k_cache.dtype),
        TILE_SEARCH=search,
        TMA=descriptors is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int | None,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's paged history.

    Args:
        q: [num_new_tokens, num_heads, head_dim], contiguous in head_dim (views of a
            fused qkv projection are fine).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or
            FP8 (K / k_scale, V / v_scale); they must already hold the new tokens' K/V
            (store_kvcache first).
        cu_seqlens_q: [batch + 1] int32 prefix sums of new tokens per sequence.
        cu_seqlens_k: [batch + 1] int32 prefix sums of total tokens (cached + new).
        block_tables: [batch, max_blocks] int32, rows contiguous, covering len_k tokens.
        max_seqlen_q: the largest number of new tokens of one sequence (a Python int,
            it sizes the grid; larger is safe, smaller drops queries), or None: a grid
            fixed by the shapes (for CUDA graphs): then the first num_seqs sequences
            hold the step's tokens, which may cover only the first rows of q (the rest
            are left as they are in `out`); the sequences after them are not read.
        scale: softmax scale, usually head_dim ** -0.5.
        kv_scales: [k_scale, v_scale] float32, for an FP8 cache.
        out: where to write the result (q's shape and dtype, contiguous); default a new tensor.
        num_seqs: [1] int32 on the device, the sequences in use, with max_seqlen_q=None.

    Returns:
        [num_new_tokens, num_heads, head_dim] in q's dtype, contiguous (`out` when given).
    """
    config = prefill_config(q.shape[0] if max_seqlen_q is None else max_seqlen_q, q.shape[2], q.dtype)
    return prefill_attention_with_config(
        q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, max_seqlen_q, scale, config, kv_scales, out,
        num_seqs,
    )
