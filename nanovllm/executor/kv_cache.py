"""The paged KV cache: bytes per block, how many blocks the GPU has room for, allocation.

One tensor [2 (K, V), num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim]:
one head's tokens of a block are contiguous, so a tile of decode attention is one
contiguous read. Each attention layer holds views of its K and V slices as
[num_blocks + 1, block_size, num_kv_heads, head_dim], which every kernel and the torch
backend read through their strides. The extra last block is scratch, never handed out:
slot -1 (a CUDA-graph padding row) indexes its last slot, so the torch backend can store
without a data-dependent mask.

Decode attention over this layout was faster than over tokens-outer memory, and so was
nano-vllm's workload (benchmarks/RESULTS.md, session 26). An FP8 cache's V is in K's layout
too (a transposed V lost every FP8 workload: session 59).
"""
from __future__ import annotations

import logging
import math

import torch

from nanovllm.layers.attention import Attention

logger = logging.getLogger(__name__)


def kv_bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """K and V of block_size tokens over every layer."""
    layer = layers[0]
    return 2 * len(layers) * layer.num_kv_heads * layer.head_dim * dtype.itemsize * block_size


def blocks_from_memory_profile(device: torch.device, gpu_memory_utilization: float, memory_used_before: int,
                               block_bytes: int) -> int:
    """How many blocks fit in what is left of total * gpu_memory_utilization after this
    engine's weights and the peak of the run just made (the largest prefill, with the
    peak statistics reset before it). This engine's share of the whole device, as in vLLM:
    engines side by side each take their gpu_memory_utilization of it; never more than is
    free now. memory_used_before: what the device held before this engine started."""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    used = total - free - memory_used_before  # by this engine's rank
    peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    budget = min(total * gpu_memory_utilization - used, free) - peak_extra
    return int(budget) // block_bytes - 1  # less the scratch block


def allocate_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, name: str = "KV cache") -> torch.Tensor:
    """The cache, with each attention layer's k_cache / v_cache bound to its slices.
    Zeroed once: attention reads masked-out slots too, and 0 * NaN from never-written
    memory is NaN. `name`: what the log line calls it."""
    layer = layers[0]
    heads, dim = layer.num_kv_heads, layer.head_dim
    shape = (2, len(layers), num_blocks + 1, heads, block_size, dim)
    try:
        kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "can't allocate" not in str(exc):
            raise  # (not the allocator's: a CUDA error from before, say)
        size = math.prod(shape) * dtype.itemsize / 2**30
        raise MemoryError(f"{name} of {num_blocks} blocks ({size:.2f} GiB) cannot be allocated on {device}: lower "
                          f"num_kvcache_blocks (or gpu_memory_utilization); {str(exc).splitlines()[0]}") from None
    k_caches, v_caches = kv_cache.transpose(3, 4)  # [.., block_size, heads, dim] views
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = k_caches[i], v_caches[i]
    logger.info("%s: %d blocks of %d tokens in %s, %.2f GiB, up to %d tokens at once", name, num_blocks, block_size,
                str(dtype).removeprefix("torch."), kv_cache.numel() * kv_cache.element_size() / 2**30,
                num_blocks * block_size)
    return kv_cache
