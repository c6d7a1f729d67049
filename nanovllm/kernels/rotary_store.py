"""From the fused q/k/v projection to attention's inputs in one kernel: RMS-normalise each
query and key head (Qwen3's q_norm/k_norm, when given), rotate them (rotate-half rotary
embedding), write the queries out and the keys and values straight into the paged cache.

In torch these are a norm, a rotation and a cache store per layer: three or four
launch-bound kernels at decode batch sizes, where this is one. The attention kernels then
read K/V from the cache only, so the new tokens' k and v are never materialised.

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] = [q | k | v] per token
    cos_sin_cache: [max_position, head_dim] fp32, [cos | sin] of each position
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] flat slots; -1 (a CUDA-graph padding row) stores nothing

qkv may also be the projection's SplitSum (kernels/split_gemm.py): its splits are summed as
they are loaded and rounded to its dtype, as the projection's own output would have been.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch
from nanovllm.kernels.paged import load_kv_scales, slot_rows, to_cache
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.kernels.split_gemm import SplitSum, kernel_args, load_output
from nanovllm.kernels.store_kvcache import check_head_dim, check_kv_cache, check_rotary_inputs
from nanovllm.utils.fp8 import fp8_max

_NUM_WARPS = 4


@triton.jit
def _weighted(x, rstd, w, dtype: tl.constexpr):
    """RMSNorm's output, fp32 rows x [R, C] times rstd [R] then the weight w [C], rounded to
    dtype after each product as torch's RMSNorm rounds."""
    return ((x * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)


@triton.jit
def norm_rope(x, x_swapped, cos, sin, w, w_swapped, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """Rows of heads [R, HEAD_DIM] normalised (QK_NORM, weights w) and rotated (rotate-half),
    in x's dtype, rounded at the steps where rotary_store rounds (its sum of squares adds the
    halves in another order, so a key may differ in the last bit); x_swapped: the same rows
    with their halves swapped (w_swapped, the weight's), cos/sin [HEAD_DIM] repeated over both
    halves."""
    dtype = x.dtype
    x = x.to(tl.float32)
    x_swapped = x_swapped.to(tl.float32)
    if QK_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        x = _weighted(x, rstd, w, dtype)
        x_swapped = _weighted(x_swapped, rstd, w_swapped, dtype)
    offs = tl.arange(0, HEAD_DIM)
    sign = tl.where(offs < HEAD_DIM // 2, -1.0, 1.0)  # rotate_half: [-x2, x1]
    return (x * cos[None, :] + sign[None, :] * x_swapped * sin[None, :]).to(dtype)


@triton.jit
def _norm_rotate(
    x_ptr,
    heads,
    head_mask,
    cos,
    sin,
    w1,
    w2,
    eps,
    split_stride,
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """[BLOCK_H, HEAD_DIM / 2] halves of the heads at x_ptr, normalised (w1, w2: the norm
    weight's halves, fp32) and rotated, in dtype (qkv's); rounded where torch's RMSNorm and
    rotary modules round."""
    half = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM // 2)
    rows = x_ptr + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = load_output(rows, 0, head_mask[:, None], dtype, SPLITS, split_stride)
    x2 = load_output(rows + half, 0, head_mask[:, None], dtype, SPLITS, split_stride)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if QK_NORM:
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        rstd = 1.0 / tl.sqrt(mean_square + eps)
        x1 = _weighted(x1, rstd, w1, dtype)
        x2 = _weighted(x2, rstd, w2, dtype)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _rotary_store_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scales_ptr,
    eps,
    qkv_stride_token,
    split_stride,
    cos_sin_stride,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, 0): the token's query heads to q_out; (token, 1): its key/value heads
    to the cache (quantized on the way to an FP8 cache). SPLITS > 0: qkv_ptr is a SplitSum's
    parts."""
    if PDL:  # launched early (kernels/pdl.py)
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM // 2)
    # Until the wait, only what the projection before does not write: positions and slots
    # (written before the step), the rotary table and the norm weights.
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * cos_sin_stride + offs).to(tl.float32)  # [HEAD_DIM / 2]
    sin = tl.load(cos_sin_ptr + position * cos_sin_stride + half + offs).to(tl.float32)
    q_w1, q_w2, k_w1, k_w2 = cos, cos, cos, cos  # unread without the norms
    if QK_NORM:
        q_w1 = tl.load(q_norm_ptr + offs).to(tl.float32)
        q_w2 = tl.load(q_norm_ptr + half + offs).to(tl.float32)
        k_w1 = tl.load(k_norm_ptr + offs).to(tl.float32)
        k_w2 = tl.load(k_norm_ptr + half + offs).to(tl.float32)
    if PDL:
        gdc_wait()
    row = qkv_ptr + token * qkv_stride_token
    dtype: tl.constexpr = q_out_ptr.dtype.element_ty

    if tl.program_id(1) == 0:
        q_heads = tl.arange(0, BLOCK_HQ)
        q_mask = q_heads < NUM_HEADS
        q1, q2 = _norm_rotate(row, q_heads, q_mask, cos, sin, q_w1, q_w2, eps, split_stride, dtype, HEAD_DIM,
                              QK_NORM, SPLITS)
        q_rows = q_out_ptr + token * NUM_HEADS * HEAD_DIM + q_heads[:, None] * HEAD_DIM + offs[None, :]
        tl.store(q_rows, q1, mask=q_mask[:, None])
        tl.store(q_rows + half, q2, mask=q_mask[:, None])
    elif slot >= 0:
        kv_heads = tl.arange(0, BLOCK_HKV)
        kv_mask = kv_heads < NUM_KV_HEADS
        k_row = row + NUM_HEADS * HEAD_DIM
        k1, k2 = _norm_rotate(k_row, kv_heads, kv_mask, cos, sin, k_w1, k_w2, eps, split_stride, dtype, HEAD_DIM,
                              QK_NORM, SPLITS)
        rows = slot_rows(slot, kv_heads, cache_stride_block, cache_stride_offset, cache_stride_head, BLOCK_SIZE)
        cache_rows = rows[:, None] + offs[None, :]  # [BLOCK_HKV, HEAD_DIM / 2]
        k_scale, v_scale = load_kv_scales(kv_scales_ptr, FP8_MAX)
        tl.store(k_cache_ptr + cache_rows, to_cache(k1, k_scale, k_cache_ptr, FP8_MAX), mask=kv_mask[:, None])
        tl.store(k_cache_ptr + cache_rows + half, to_cache(k2, k_scale, k_cache_ptr, FP8_MAX), mask=kv_mask[:, None])
        v_src = k_row + NUM_KV_HEADS * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + offs[None, :]
        v1 = load_output(v_src, 0, kv_mask[:, None], dtype, SPLITS, split_stride)
        v2 = load_output(v_src + half, 0, kv_mask[:, None], dtype, SPLITS, split_stride)
        tl.store(v_cache_ptr + cache_rows, to_cache(v1, v_scale, v_cache_ptr, FP8_MAX), mask=kv_mask[:, None])
        tl.store(v_cache_ptr + cache_rows + half, to_cache(v2, v_scale, v_cache_ptr, FP8_MAX), mask=kv_mask[:, None])


def rotary_store(
    qkv: torch.Tensor | SplitSum,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise (when the norm weights are given) and rotate q and k, store k and v in the
    cache; returns q, [num_tokens, num_heads, head_dim] in qkv's dtype.

    Args:
        qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows contiguous, or
            the projection's SplitSum of that shape.
        positions: [num_tokens] integer positions, rows of cos_sin_cache.
        cos_sin_cache: [max_position, head_dim] fp32, cos in the first half, sin in the second.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], qkv's dtype or
            FP8 (then k / k_scale and v / v_scale are stored, saturated).
        slot_mapping: [num_tokens] int64 or int32 flat slots; -1 stores nothing.
        q_norm_weight, k_norm_weight: [head_dim] RMSNorm weights, both or neither.
        kv_scales: [k_scale, v_scale] float32, for an FP8 cache.
    """
    dtype = qkv.dtype
    qkv, splits, split_stride = kernel_args(qkv)
    num_tokens = qkv.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_head_dim(head_dim)
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_dim, dtype, kv_scales)
    check_rotary_inputs(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, q_norm_weight,
                        k_norm_weight)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    qk_norm = q_norm_weight is not None
    pdl = pdl_enabled(qkv.device)
    launch(_rotary_store_kernel, (num_tokens, 2),
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if qk_norm else cos_sin_cache,  # unread without the norms
        k_norm_weight if qk_norm else cos_sin_cache,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        kv_scales if kv_scales is not None else cos_sin_cache,  # unread unless FP8
        eps,
        qkv.stride(0),
        split_stride,
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        QK_NORM=qk_norm,
        FP8_MAX=fp8_max(k_cache.dtype),
        SPLITS=splits,
        PDL=pdl,
        num_warps=_NUM_WARPS,
        **launch_options(pdl),
    )
    return q
