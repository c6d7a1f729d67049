"""Paged attention: store this step's K/V into the cache, then attend.

The math lives in a backend. `TorchAttentionBackend` is the portable reference (CPU
and GPU, plain PyTorch); `TritonAttentionBackend` (triton_attention.py) is the fast GPU path.
Every backend implements the same three operations over the same cache layout:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    flat slot of token t of a sequence = block_table[t // block_size] * block_size + t % block_size
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.context import Context, get_context


class AttentionBackend(Protocol):
    # True when the backend also has rotary_store(qkv, positions, cos_sin_cache, k_cache,
    # v_cache, slot_mapping, num_heads, q_norm_weight, k_norm_weight, eps) -> q, which
    # normalises and rotates q and k and stores k and v in one pass, and its prefill reads
    # K/V from the cache alone (k and v may be None).
    fuses_rotary_store: bool

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float) -> torch.Tensor: ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float) -> torch.Tensor: ...


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, num_kv_heads, head_dim]."""
    num_blocks = (length + cache.size(1) - 1) // cache.size(1)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


class TorchAttentionBackend:
    """Reference attention in plain PyTorch: one SDPA call per sequence in prefill,
    a padded batched gather through the block tables in decode."""

    fuses_rotary_store = False

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        # k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]. Slot -1
        # (padding) wraps to the last slot of the cache's scratch block: no boolean mask,
        # so no host sync, so the store can be captured in a CUDA graph.
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v

    def prefill(self, q, k, v, k_cache, v_cache, context, scale):
        # q: [num_new_tokens, num_heads, head_dim]. A sequence with no cached prefix attends
        # to its packed k/v; one with a prefix reads its whole history from the cache.
        out = torch.empty_like(q)
        cu_q = context.cu_seqlens_q.tolist()
        cu_k = context.cu_seqlens_k.tolist()
        for i in range(len(cu_q) - 1):
            q_range = slice(cu_q[i], cu_q[i + 1])
            len_q, len_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            if len_q == len_k:
                seq_k, seq_v, mask = k[q_range], v[q_range], None
            else:
                seq_k = _gather_paged(k_cache, context.block_tables[i], len_k)
                seq_v = _gather_paged(v_cache, context.block_tables[i], len_k)
                # Query j sits at absolute position len_k - len_q + j and sees keys 0..that.
                mask = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(len_k - len_q)
            out[q_range] = _sdpa(q[q_range].transpose(0, 1), seq_k.transpose(0, 1), seq_v.transpose(0, 1), mask, scale).transpose(0, 1)
        return out

    def decode(self, q, k_cache, v_cache, context, scale):
        # q: [batch, num_heads, head_dim]; context_lens: [batch]; block_tables: [batch, max_blocks] (-1 padded)
        max_len = context.block_tables.size(1) * k_cache.size(1)
        table = context.block_tables.clamp(min=0).long()
        keys = k_cache[table].flatten(1, 2).transpose(1, 2)  # [batch, num_kv_heads, max_len, head_dim]
        values = v_cache[table].flatten(1, 2).transpose(1, 2)
        mask = torch.arange(max_len, device=q.device) < context.context_lens[:, None]  # [batch, max_len]
        out = _sdpa(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale)  # [batch, num_heads, 1, head_dim]
        return out.squeeze(2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention, heads first: q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D] with Hq a multiple of Hkv.

    mask None means plain causal (Lq == Lk). Query rows with nothing to attend to (decode
    padding rows) come out as zeros.
    """
    gqa = q.size(-3) != k.size(-3)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
    return out.nan_to_num_(0.0)


class Attention(nn.Module):
    """One layer's attention over the paged KV cache.

    q: [num_tokens, num_heads * head_dim], k/v: [num_tokens, num_kv_heads * head_dim];
    returns [num_tokens, num_heads * head_dim]. k_cache/v_cache are bound by the
    ModelRunner once the cache is allocated (empty during the memory-profiling run).
    """

    backend: AttentionBackend = TorchAttentionBackend()

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() > 0:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        return self._attend(q, k, v, context)

    def stores_rotated(self) -> bool:
        """Whether forward_rotary can run: the backend fuses the q/k norms, the rotary
        embedding and the cache store into one kernel, and the cache exists."""
        return self.backend.fuses_rotary_store and self.k_cache.numel() > 0

    def forward_rotary(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_norm: nn.Module | None, k_norm: nn.Module | None) -> torch.Tensor:
        """Attention straight from the fused projection `qkv` ([num_tokens, (Hq + 2 Hkv) *
        head_dim]): q/k RMSNorms (when given), rotary and the cache store in one kernel, then
        attention over the cache. Only when stores_rotated()."""
        context = get_context()
        q = self.backend.rotary_store(
            qkv, positions, cos_sin_cache, self.k_cache, self.v_cache, context.slot_mapping, self.num_heads,
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0,
        )
        return self._attend(q, None, None, context)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, context: Context) -> torch.Tensor:
        if context.is_prefill:
            o = self.backend.prefill(q, k, v, self.k_cache, self.v_cache, context, self.scale)
        else:
            o = self.backend.decode(q, self.k_cache, self.v_cache, context, self.scale)
        return o.view(-1, self.num_heads * self.head_dim)
