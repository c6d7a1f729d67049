"""The Triton attention backend: our paged kernels (nanovllm/kernels) behind the
AttentionBackend interface (attention_backend.py)."""
from __future__ import annotations

import torch

from nanovllm.kernels.decode_attention import decode_attention, decode_attention_rotary
from nanovllm.kernels.prefill_attention import prefill_attention
from nanovllm.kernels.rotary_store import rotary_store
from nanovllm.kernels.store_kvcache import store_kvcache
from nanovllm.layers.attention_backend import AttentionBackend, TorchAttentionBackend
from nanovllm.utils.context import Context, Rotary
from nanovllm.utils.env import env_int

# Decode steps of up to this many rows use decode_attention_rotary (kernels/decode_attention.py):
# rotary_store's work inside decode attention, one kernel boundary fewer per layer, which is
# what a small batch's chain of latency-bound kernels pays for. Above it, every attention
# program rotating its own queries costs more than the boundary saves (on nano-vllm's workload,
# every batch size sent to the fused kernel was 11-35% slower, RESULTS.md session 52), so
# rotary_store runs as its own kernel. NANOVLLM_ROTARY_MAX_BATCH overrides it (A/B measurements).
ROTARY_MAX_BATCH = env_int("NANOVLLM_ROTARY_MAX_BATCH", 8, least=0)


class TritonAttentionBackend(AttentionBackend):
    def __init__(self) -> None:
        # Before the cache exists (the memory-profiling run) there is nothing paged to read.
        self._no_cache = TorchAttentionBackend()

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, kv_scales) -> None:
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, kv_scales)

    def fuses_rotary_store(self) -> bool:
        return True

    def captures_prefill(self) -> bool:
        return True

    def decode_sees_step_rows(self, num_rows: int) -> bool:
        # decode_attention_rotary's programs each store their own row's K/V as they attend
        return num_rows > ROTARY_MAX_BATCH

    def rotary_store(self, qkv, rotary: Rotary, k_cache, v_cache, slot_mapping, num_heads, kv_scales) -> torch.Tensor:
        return rotary_store(qkv, rotary.positions, rotary.cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads,
                            rotary.q_norm_weight, rotary.k_norm_weight, rotary.eps, kv_scales)

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale: float, kv_scales, out=None) -> torch.Tensor:
        if context.block_tables is None:
            return self._no_cache.prefill(q, k, v, k_cache, v_cache, context, scale, kv_scales, out)
        return prefill_attention(
            q, k_cache, v_cache, context.cu_seqlens_q, context.cu_seqlens_k, context.block_tables,
            context.max_seqlen_q, scale, kv_scales, out, context.num_seqs,
        )

    def decode(self, q, k_cache, v_cache, context: Context, scale: float, kv_scales) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, context.block_tables, context.context_lens, scale,
                                kv_scales=kv_scales)

    def rotary_decode(self, qkv, rotary: Rotary, k_cache, v_cache, context: Context, num_heads, scale,
                      kv_scales) -> torch.Tensor:
        if qkv.shape[0] > ROTARY_MAX_BATCH:
            return super().rotary_decode(qkv, rotary, k_cache, v_cache, context, num_heads, scale, kv_scales)
        # One kernel: the attention programs do rotary_store's work themselves (from a tensor or a SplitSum).
        return decode_attention_rotary(qkv, k_cache, v_cache, context.block_tables, context.context_lens, scale,
                                       rotary, kv_scales=kv_scales)
