"""Pieces of the Triton kernels over the paged cache (inlined by Triton): cache addressing for
the attention kernels and the cache writers, the online softmax for decode and prefill
attention (and decode's fold of a tile into it and merge of its splits, beside it); and on
the host, the attention kernels' TMA descriptors of K/V tiles (tma_tiles).

The paged KV cache holds, per layer, K and V as [blocks, block_size, kv_heads, head_dim];
a sequence's token t lives in block block_table[t // block_size] at offset
t % block_size. The online softmax works in log2 units: it takes the raw products q.k
and scales them by qk_scale = scale * log2(e) (times k_scale over FP8), so it uses exp2.

An FP8 cache holds K / k_scale and V / v_scale (per-layer scales, kv_scales = [k_scale,
v_scale] fp32 on the device): the writers load them with `load_kv_scales` and quantize with
`to_cache`; the attention kernels convert the FP8 tiles as they read them (to float16 for
16-bit queries, float32 for float32 ones) and fold k_scale into the scores' scale and
v_scale into the output.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import fp8_to_f16, to_fp8
from nanovllm.kernels.gpu import is_hopper_or_later

# tl.dot needs every operand dimension >= 16, so a query-head group is padded to 16 rows.
MIN_DOT_ROWS = 16


def tma_tiles(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple | None:
    """TMA descriptors of K and V viewed as [rows, head_dim], for an attention kernel's whole
    block_n-token tiles, where each tile is one contiguous range of rows: a head-major cache
    ([blocks, kv_heads, block_size, head_dim] in memory) whose blocks hold whole tiles, of
    16-bit or FP8 elements (those measured; a float32 cache keeps loads), on a Hopper or later
    GPU (or a CPU, under the Triton interpreter), rows numbered in int32. None: loads instead.
    A kernel finds tile rows in the view with `tile_first_row`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, block_size, num_kv_heads, head_dim = k_cache.shape
    head_major = (block_size * num_kv_heads * head_dim, head_dim, block_size * head_dim, 1)
    device = k_cache.device
    if not (k_cache.element_size() <= 2 and block_size % block_n == 0
            and k_cache.stride() == head_major == v_cache.stride() and k_cache.numel() // head_dim < 2**31
            and (device.type == "cpu" or is_hopper_or_later(device))):
        return None
    return tuple(TensorDescriptor(cache, [cache.numel() // head_dim, head_dim], [head_dim, 1], [block_n, head_dim])
                 for cache in (k_cache, v_cache))


@triton.jit
def tile_first_row(block_ids, tile_start, head_offset, cache_stride_block, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    """Row of a tma_tiles view where the tile of tokens [tile_start, tile_start + BLOCK_N)
    starts (block_ids from tile_blocks; the tile inside one block)."""
    return ((block_ids.to(tl.int64) * cache_stride_block + head_offset) // HEAD_DIM
            + tile_start % BLOCK_SIZE).to(tl.int32)


@triton.jit
def paged_rows(block_ids, positions, head_offset, cache_stride_block, cache_stride_offset,
               BLOCK_SIZE: tl.constexpr):
    """Element offset of each position's head_dim row for one KV head: block_ids are the
    positions' blocks (read from the block table), head_offset = kv_head * head stride."""
    return block_ids.to(tl.int64) * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_offset + head_offset


@triton.jit
def tile_blocks(block_table_row, tile_start, end, offs_n, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ids of the tile of tokens [tile_start, tile_start + BLOCK_N) (tile_start a
    multiple of BLOCK_N), 0 past end: one when a tile never crosses a block (BLOCK_N
    divides BLOCK_SIZE), else one per token."""
    if BLOCK_SIZE % BLOCK_N == 0:
        ids = tl.load(block_table_row + tile_start // BLOCK_SIZE, mask=tile_start < end, other=0)
    else:
        tokens = tile_start + offs_n
        ids = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=tokens < end, other=0)
    return ids


@triton.jit
def tile_rows(block_ids, tile_start, offs_n, head_offset, cache_stride_block, cache_stride_offset,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offset of each of the tile's [BLOCK_N] head_dim rows, from tile_blocks's ids:
    within one block, one base plus offsets the loop does not change."""
    if BLOCK_SIZE % BLOCK_N == 0:
        base = block_ids.to(tl.int64) * cache_stride_block + (tile_start % BLOCK_SIZE) * cache_stride_offset
        rows = base + head_offset + offs_n * cache_stride_offset
    else:
        rows = paged_rows(block_ids, tile_start + offs_n, head_offset, cache_stride_block, cache_stride_offset,
                          BLOCK_SIZE)
    return rows


@triton.jit
def slot_rows(slot, heads, cache_stride_block, cache_stride_offset, cache_stride_head, BLOCK_SIZE: tl.constexpr):
    """Element offset of the head_dim row of each of `heads` at one flat cache slot
    (block_id * block_size + offset, int64)."""
    return ((slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_offset
            + heads * cache_stride_head)


@triton.jit
def online_softmax_step(acc, l_i, m_i, scores, qk_scale, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores [rows, BLOCK_N] and its values [BLOCK_N, head_dim] into the
    running state: acc (unnormalised output), l_i (sum of exp2(score * qk_scale - m_i)),
    m_i (max of score * qk_scale). scores are the raw products q.k (-inf where masked),
    scaled here by qk_scale > 0 (to log2 units) in one fused multiply-add with the max's
    subtraction. A row's first folded tile must hold a finite score, so the new max is
    finite."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(tl.fma(scores, qk_scale, -m_new[:, None]))
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def attend_tile(q, k, v, token_mask, acc, l_i, m_i, qk_scale, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FP8: tl.constexpr, FP8_ASM: tl.constexpr):
    """Fold one K/V tile ([BLOCK_N, HEAD_DIM], as loaded from the cache) into decode
    attention's state (q: [BLOCK_G, HEAD_DIM]); MASKED: only the tokens of token_mask count."""
    if FP8:
        k = k.to(q.dtype)
        if FP8_ASM and q.dtype == tl.float16:  # V converted before its transposed trip through shared memory
            v = fp8_to_f16(v)
        else:
            v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
    if MASKED:
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
    return online_softmax_step(acc, l_i, m_i, scores, qk_scale, v, DOT_PRECISION)


@triton.jit
def fp8_queries(q):
    """Queries for products with an FP8 cache's tiles: 16-bit ones in float16 (exact for
    FP8 values, and e4m3 converts to it in pairs), saturated to its range; float32 ones as
    they are."""
    if q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def to_cache(x, scale, cache_ptr, FP8_MAX: tl.constexpr):
    """x in the cache's element type: as it is, or for an FP8 cache (FP8_MAX > 0) x / scale
    saturated to the format's largest finite value, rounded to nearest even."""
    if FP8_MAX > 0:
        return to_fp8(tl.div_rn(x.to(tl.float32), scale), cache_ptr.dtype.element_ty, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def load_kv_scales(kv_scales_ptr, FP8_MAX: tl.constexpr):
    """(k_scale, v_scale): the layer's scales for an FP8 cache (FP8_MAX > 0), else 1.0."""
    if FP8_MAX > 0:
        return tl.load(kv_scales_ptr), tl.load(kv_scales_ptr + 1)
    return 1.0, 1.0


@triton.jit
def merge_partials(partial_out_ptr, partial_lse_ptr, first_rows, count, group_mask, offs_d, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    """The merged output [BLOCK_G, HEAD_DIM] of `count` partial results, each normalised on
    its own, with the log2-sum-exp2 of its scores: partial i of the group's rows is at rows
    first_rows + i of partial_out [.., HEAD_DIM] and partial_lse. Read from L2 (.cg), where
    other programs stored them, never a stale L1 line."""
    lse_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    merged = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for other in range(0, count):
        rows = first_rows + other
        lse = tl.load(partial_lse_ptr + rows, mask=group_mask, other=0.0, cache_modifier=".cg")
        part = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=group_mask[:, None],
                       other=0.0, cache_modifier=".cg")
        new_max = tl.maximum(lse_max, lse)
        alpha = tl.exp2(lse_max - new_max)
        weight = tl.exp2(lse - new_max)
        merged = merged * alpha[:, None] + part * weight[:, None]
        total = total * alpha + weight
        lse_max = new_max
    return merged / total[:, None]
