"""Write the new tokens' keys and values into the paged KV cache.

The cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads,
head_dim]`; token t goes to the flat slot `slot_mapping[t] = block_id * block_size +
offset`. A slot of -1 marks a CUDA-graph padding row and is skipped.

This module also owns the checks of that layout which the attention kernels share.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch
from nanovllm.kernels.paged import load_kv_scales, slot_rows, to_cache
from nanovllm.utils.fp8 import fp8_max, is_fp8

# tl.arange and tl.dot need power-of-two extents of at least 16; 256 bounds the register
# and shared-memory tiles of the attention kernels.
_MIN_HEAD_DIM = 16
_MAX_HEAD_DIM = 256

# One program moves num_kv_heads * head_dim elements (1 KiB-4 KiB in bf16); four warps
# give each thread a 16-byte vector or two, enough to keep the copy memory bound.
_STORE_NUM_WARPS = 4


def check_head_dim(head_dim: int) -> None:
    """Raise ValueError unless head_dim is a power of two the kernels can tile."""
    if head_dim & (head_dim - 1) or not _MIN_HEAD_DIM <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be a power of two in [{_MIN_HEAD_DIM}, {_MAX_HEAD_DIM}], got {head_dim}"
        )


def check_scale(scale: float) -> None:
    """Raise ValueError unless the softmax scale is positive: the attention kernels apply it
    inside the softmax's exponent, after masking (a masked score is -inf)."""
    if not scale > 0:
        raise ValueError(f"the attention scale must be positive, got {scale}")


def check_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless the cache pair has the layout every kernel here assumes.

    The kernels index both caches with k_cache's strides, so they must match; head_dim
    must be contiguous so that each token's row is one coalesced load. The cache holds
    `dtype` (the model's), or FP8 with kv_scales = [k_scale, v_scale] fp32 on its device.
    """
    expected = (num_kv_heads, head_dim)
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != expected:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    if is_fp8(k_cache.dtype):
        if kv_scales is None or kv_scales.shape != (2,) or kv_scales.dtype != torch.float32 \
                or kv_scales.device != k_cache.device:
            raise ValueError("an FP8 KV cache needs kv_scales: [k_scale, v_scale], float32, on the cache's device")
    elif k_cache.dtype != dtype:
        raise ValueError(f"KV cache dtype {k_cache.dtype} differs from {dtype} (and is not FP8)")


def check_rotary_inputs(qkv: torch.Tensor, num_heads: int | None, num_kv_heads: int, head_dim: int,
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None,
                        k_norm_weight: torch.Tensor | None) -> int:
    """The query heads, once the inputs of rotary_store's work (rotary_store, or decode
    attention doing it) are checked: qkv [rows, (num_heads + 2 num_kv_heads) head_dim] with
    contiguous rows (a SplitSum's first part; num_heads None: read from its width), a position
    per row, cos_sin_cache [max_position, head_dim] with contiguous rows, and both q/k norm
    weights or neither. Raises ValueError saying what does not fit."""
    if num_heads is not None and num_heads <= 0:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    heads = num_heads if num_heads is not None else qkv.shape[-1] // head_dim - 2 * num_kv_heads
    width = (heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or heads <= 0 or qkv.shape[1] != width or qkv.stride(1) != 1:
        expected = (f"[tokens, {width}] ({num_heads} + {2 * num_kv_heads} heads of {head_dim})" if num_heads
                    else f"[tokens, (num_heads + {2 * num_kv_heads}) * {head_dim}]")
        raise ValueError(f"qkv must be {expected} with contiguous rows, got {tuple(qkv.shape)}")
    if positions.shape != (qkv.shape[0],):
        raise ValueError(f"positions must be [{qkv.shape[0]}], got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_position, {head_dim}] with contiguous rows, got "
                         f"{tuple(cos_sin_cache.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    return heads


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scales_ptr,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] key and value rows
    (quantized on the way to an FP8 cache)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]  # [BLOCK_H, 1]

    key = tl.load(
        key_ptr + token * key_stride_token + offs_h[:, None] * key_stride_head + offs_d[None, :],
        mask=mask,
    )  # [BLOCK_H, HEAD_DIM]
    value = tl.load(
        value_ptr + token * value_stride_token + offs_h[:, None] * value_stride_head + offs_d[None, :],
        mask=mask,
    )  # [BLOCK_H, HEAD_DIM]

    rows = slot_rows(slot, offs_h, cache_stride_block, cache_stride_offset, cache_stride_head, BLOCK_SIZE)
    cache_offs = rows[:, None] + offs_d[None, :]  # [BLOCK_H, HEAD_DIM]
    k_scale, v_scale = load_kv_scales(kv_scales_ptr, FP8_MAX)
    tl.store(k_cache_ptr + cache_offs, to_cache(key, k_scale, k_cache_ptr, FP8_MAX), mask=mask)
    tl.store(v_cache_ptr + cache_offs, to_cache(value, v_scale, v_cache_ptr, FP8_MAX), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Scatter each token's key/value rows into its slot of the paged cache.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim]; any strides as long as the last
            dimension is contiguous (views of a fused qkv projection are fine).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same strides,
            last dimension contiguous, key/value's dtype or FP8 (then key / k_scale and
            value / v_scale are stored, saturated).
        slot_mapping: [num_tokens] int64 or int32 flat slots; -1 skips the token.
        kv_scales: [k_scale, v_scale] float32, for an FP8 cache.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    check_head_dim(head_dim)
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_dim, key.dtype, kv_scales)
    if num_tokens == 0:
        return
    launch(_store_kvcache_kernel, (num_tokens,),
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        kv_scales if kv_scales is not None else slot_mapping,  # unread unless FP8
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        FP8_MAX=fp8_max(k_cache.dtype),
        num_warps=_STORE_NUM_WARPS,
    )
