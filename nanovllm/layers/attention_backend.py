"""Attention backends: the math of paged attention behind one interface.

`TorchAttentionBackend` is the portable reference (CPU and GPU, plain PyTorch);
`TritonAttentionBackend` (triton_attention.py) is the fast GPU path. Every backend works
on the same cache layout:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    flat slot of token t of a sequence = block_table[t // block_size] * block_size + t % block_size

The cache holds the model's dtype, or FP8 (kv_cache_dtype="fp8"): then K / k_scale and
V / v_scale, saturated, with kv_scales = [k_scale, v_scale] the layer's fp32 scales.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanovllm.utils.context import Context, Rotary
from nanovllm.utils.fp8 import fp8_max, is_fp8

if TYPE_CHECKING:  # imports Triton, which runs only where the kernels do
    from nanovllm.kernels.split_gemm import SplitSum


class AttentionBackend(ABC):
    @abstractmethod
    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_scales: torch.Tensor) -> None:
        """Write k, v [num_tokens, num_kv_heads, head_dim] at slot_mapping (-1: skip)."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, context: Context, scale: float, kv_scales: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the packed new tokens q [num_new_tokens, num_heads, head_dim]
        over each sequence's cached prefix and themselves (cu_seqlens in the context);
        written into `out` (q's shape and dtype, contiguous) when given, else a new tensor."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context,
               scale: float, kv_scales: torch.Tensor) -> torch.Tensor:
        """One query per sequence, q [batch, num_heads, head_dim], over its context_lens
        cached tokens."""

    def decode_sees_step_rows(self, num_rows: int) -> bool:
        """Whether a decode step of num_rows rows may hold several rows of one sequence (a
        step that verifies drafts: its last token and drafts, each row a query at its own
        position), each row then attending to the K/V that rows before it store in the same
        step: whether every row's K/V is stored before any row attends."""
        return True

    def captures_prefill(self) -> bool:
        """Whether prefill runs inside a CUDA graph: with rotary_store, and with a context
        whose max_seqlen_q is None (a grid fixed by the shapes, executor/piecewise.py)."""
        return False

    def fuses_rotary_store(self) -> bool:
        """Whether rotary_store is implemented; then prefill reads K/V from the cache alone
        (k and v are None)."""
        return False

    def rotary_store(self, qkv: torch.Tensor | SplitSum, rotary: Rotary, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, num_heads: int, kv_scales: torch.Tensor) -> torch.Tensor:
        """From the fused projection qkv (or a SplitSum of it, kernels/split_gemm.py): normalise
        (rotary's q/k RMSNorm weights, when given) and rotate q and k, store k and v at
        slot_mapping, return q [num_tokens, num_heads, head_dim]; one pass."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the rotary embedding and the cache store")

    def rotary_decode(self, qkv: torch.Tensor | SplitSum, rotary: Rotary, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, context: Context, num_heads: int, scale: float,
                      kv_scales: torch.Tensor) -> torch.Tensor:
        """A decode step from the fused projection qkv: rotary_store, then decode; returns
        [batch, num_heads, head_dim]. A backend may do both in one pass."""
        q = self.rotary_store(qkv, rotary, k_cache, v_cache, context.slot_mapping, num_heads, kv_scales)
        return self.decode(q, k_cache, v_cache, context, scale, kv_scales)


def quantize(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x / scale in an FP8 cache dtype, saturated at its largest finite value (a plain cast
    would turn overflow into NaN)."""
    limit = fp8_max(cache_dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, num_kv_heads, head_dim]."""
    num_blocks = (length + cache.size(1) - 1) // cache.size(1)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


class TorchAttentionBackend(AttentionBackend):
    """Reference attention in plain PyTorch: one SDPA call per sequence in prefill,
    a padded batched gather through the block tables in decode."""

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, kv_scales):
        # k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]. Slot -1
        # (padding) wraps to the last slot of the cache's scratch block: no boolean mask,
        # so no host sync, so the store can be captured in a CUDA graph.
        if is_fp8(k_cache.dtype):
            k, v = quantize(k, kv_scales[0], k_cache.dtype), quantize(v, kv_scales[1], v_cache.dtype)
        # (Indexed by block and offset, not through a flat view: the cache may be a strided view.)
        block_size = k_cache.shape[1]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        k_cache[blocks, offsets] = k
        v_cache[blocks, offsets] = v

    def prefill(self, q, k, v, k_cache, v_cache, context, scale, kv_scales, out=None):
        # q: [num_new_tokens, num_heads, head_dim]. A sequence with no cached prefix attends
        # to its packed k/v; one with a prefix reads its whole history from the cache, and
        # so does every sequence with an FP8 cache (what the Triton kernel reads too).
        # Decoding sequences riding in the step (one new token after a cached history) are
        # served together, as in decode.
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        fp8 = is_fp8(k_cache.dtype) and k_cache.numel() > 0
        cu_q = context.cu_seqlens_q.tolist()
        cu_k = context.cu_seqlens_k.tolist()
        rows = range(len(cu_q) - 1)
        decoding = [i for i in rows if cu_q[i + 1] - cu_q[i] == 1 and cu_k[i + 1] - cu_k[i] > 1]
        if len(decoding) > 1:
            at = torch.tensor([cu_q[i] for i in decoding], device=q.device)
            lens = torch.tensor([cu_k[i + 1] - cu_k[i] for i in decoding], device=q.device)
            tables = context.block_tables[torch.tensor(decoding, device=q.device)]
            out[at] = _paged_decode(q[at], k_cache, v_cache, tables, lens, scale, kv_scales)
            batched = set(decoding)
            rows = [i for i in rows if i not in batched]
        for i in rows:
            q_range = slice(cu_q[i], cu_q[i + 1])
            len_q, len_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
            if len_q == len_k and not fp8:
                seq_k, seq_v, mask = k[q_range], v[q_range], None
            else:
                seq_k = _gather_paged(k_cache, context.block_tables[i], len_k)
                seq_v = _gather_paged(v_cache, context.block_tables[i], len_k)
                if fp8:
                    seq_k, seq_v = dequantize(seq_k, kv_scales[0], q.dtype), dequantize(seq_v, kv_scales[1], q.dtype)
                # Query j sits at absolute position len_k - len_q + j and sees keys 0..that.
                mask = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(len_k - len_q)
            out[q_range] = _sdpa(q[q_range].transpose(0, 1), seq_k.transpose(0, 1), seq_v.transpose(0, 1), mask,
                                 scale).transpose(0, 1)
        return out

    def decode(self, q, k_cache, v_cache, context, scale, kv_scales):
        return _paged_decode(q, k_cache, v_cache, context.block_tables, context.context_lens, scale, kv_scales)


def _paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, kv_scales: torch.Tensor | None) -> torch.Tensor:
    """One query token per sequence over its cached history, batched through a padded
    gather: q [batch, num_heads, head_dim], block_tables [batch, max_blocks] (-1 padded)."""
    max_len = block_tables.size(1) * k_cache.size(1)
    table = block_tables.clamp(min=0).long()
    keys = k_cache[table].flatten(1, 2).transpose(1, 2)  # [batch, num_kv_heads, max_len, head_dim]
    values = v_cache[table].flatten(1, 2).transpose(1, 2)
    if is_fp8(k_cache.dtype):
        keys, values = dequantize(keys, kv_scales[0], q.dtype), dequantize(values, kv_scales[1], q.dtype)
    mask = torch.arange(max_len, device=q.device) < context_lens[:, None]  # [batch, max_len]
    out = _sdpa(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale)  # [batch, num_heads, 1, head_dim]
    return out.squeeze(2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention, heads first: q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D] with Hq a multiple of Hkv.

    mask None means plain causal (Lq == Lk). Query rows with nothing to attend to (decode
    padding rows) come out as zeros.
    """
    gqa = q.size(-3) != k.size(-3)
    if q.dim() == 3:
        # One sequence, [H, L, D]: as a batch of one, so that torch may take a fused kernel,
        # which holds no scores (a 2-D mask broadcasts as it is; a 3-D one would not qualify).
        # Its math path, the only choice for 3-D inputs, materializes every score: tens of
        # GiB at the start-up memory profile's 16,384-token prefill, after which the cache
        # found no room on an 80 GiB GPU. (With a mask and GQA, a GPU has only cuDNN's.)
        return _sdpa(q[None], k[None], v[None], mask, scale)[0]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
    return out.nan_to_num_(0.0)
