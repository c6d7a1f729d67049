"""Paged attention: one layer's store of this step's K/V into the cache, then attention,
through the configured backend (attention_backend.py)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.attention_backend import AttentionBackend, TorchAttentionBackend
from nanovllm.utils.context import Context, Rotary, get_context
from nanovllm.utils.fp8 import fp8_max

if TYPE_CHECKING:  # imports Triton, which runs only where the kernels do
    from nanovllm.kernels.split_gemm import SplitSum

logger = logging.getLogger(__name__)

# calculate_kv_scales leaves this factor of the FP8 range above the first batch's largest
# |K| and |V|: the format is floating point, so the headroom costs resolution only among
# the smallest values (one binade of e4m3's subnormals), not the relative precision.
FP8_SCALE_HEADROOM = 2.0


def get_attention_backend(config: Config, head_dim: int) -> AttentionBackend:
    """The configured backend. "auto" picks Triton on CUDA unless the kernels cannot tile
    this head_dim, then the torch reference; an explicit "triton" must fit."""
    if config.attention_backend_name == "triton":
        from nanovllm.kernels.store_kvcache import check_head_dim  # imports triton
        from nanovllm.layers.triton_attention import TritonAttentionBackend

        try:
            check_head_dim(head_dim)
        except ValueError as e:
            if config.attention_backend == "triton":
                raise ValueError(f"attention_backend='triton' cannot run this model: {e}") from None
            logger.warning("Triton attention cannot run this model (%s); using the torch backend", e)
            return TorchAttentionBackend()
        return TritonAttentionBackend()
    return TorchAttentionBackend()


class Attention(nn.Module):
    """One layer's attention over the paged KV cache.

    q: [num_tokens, num_heads * head_dim], k/v: [num_tokens, num_kv_heads * head_dim];
    returns [num_tokens, num_heads * head_dim]. k_cache/v_cache are bound when the cache
    is allocated (executor/kv_cache.py; empty during the memory-profiling run).

    kv_scales = [k_scale, v_scale]: an FP8 cache holds K / k_scale and V / v_scale. 1.0
    unless the checkpoint has the layer's scales, or calculate_kv_scales() asks for them
    from the next prefill's keys and values.
    """

    backend: AttentionBackend = TorchAttentionBackend()

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.kv_scales = nn.Parameter(torch.ones(2, dtype=torch.float32), requires_grad=False)
        self.kv_scales.weight_loader = load_kv_scale
        self.kv_scales.optional = True  # most checkpoints have none
        self.scales_pending = False

    def calculate_kv_scales(self) -> None:
        """Set kv_scales from the next prefill with a cache: each is the largest |K| (|V|)
        of that batch over FP8_SCALE_HEADROOM of the format's range, so later tokens may
        be up to that much larger before they saturate."""
        self.scales_pending = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a prefill step's output buffer [num_tokens, num_heads * head_dim] (the prefill
        graphs' static one, executor/piecewise.py); the result is written there."""
        context = get_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() > 0:
            if self.scales_pending and context.is_prefill:
                self._set_kv_scales(k, v)
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping, self.kv_scales)
        return self._attend(q, k, v, context, out)

    def _set_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        limit = fp8_max(self.k_cache.dtype) / FP8_SCALE_HEADROOM
        amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()
        self.kv_scales.copy_(torch.where(amax > 0, amax / limit, 1.0))
        self.scales_pending = False
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("KV-cache scales from the first prefill (%d tokens): k %.4g, v %.4g", k.shape[0],
                         *self.kv_scales.tolist())

    def stores_rotated(self) -> bool:
        """Whether forward_rotary can run: the backend fuses the q/k norms, the rotary
        embedding and the cache store into one kernel, the cache exists, and no scales
        wait to be taken from this step's keys and values (which that kernel never
        materialises)."""
        return self.backend.fuses_rotary_store() and self.k_cache.numel() > 0 and not self.scales_pending

    def forward_rotary(self, qkv: torch.Tensor | SplitSum, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_norm: nn.Module | None, k_norm: nn.Module | None, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Attention straight from the fused projection `qkv` ([num_tokens, (Hq + 2 Hkv) *
        head_dim], or a SplitSum of it: kernels/split_gemm.py): q/k RMSNorms (when given), rotary and
        the cache store in one kernel, then attention over the cache; a decode step in one
        kernel for all of it (where the backend fuses that too). Only when stores_rotated().
        out: as in forward (prefill)."""
        context = get_context()
        rotary = Rotary(positions, cos_sin_cache, q_norm.weight if q_norm is not None else None,
                        k_norm.weight if k_norm is not None else None, q_norm.eps if q_norm is not None else 0.0)
        if not context.is_prefill:
            assert out is None, "out is for prefill steps"
            o = self.backend.rotary_decode(qkv, rotary, self.k_cache, self.v_cache, context, self.num_heads,
                                           self.scale, self.kv_scales)
            return o.view(-1, self.num_heads * self.head_dim)
        q = self.backend.rotary_store(qkv, rotary, self.k_cache, self.v_cache, context.slot_mapping, self.num_heads,
                                      self.kv_scales)
        return self._attend(q, None, None, context, out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, context: Context,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if context.is_prefill:
            o = self.backend.prefill(q, k, v, self.k_cache, self.v_cache, context, self.scale, self.kv_scales,
                                     None if out is None else out.view(q.shape))
        else:
            assert out is None, "out is for prefill steps"
            o = self.backend.decode(q, self.k_cache, self.v_cache, context, self.scale, self.kv_scales)
        return o.view(-1, self.num_heads * self.head_dim)


def load_kv_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """A checkpoint's k_scale (shard 0), v_scale (1), or one kv_scale for both (None)."""
    if loaded.numel() != 1:
        raise ValueError(f"a KV-cache scale must be one number, got a tensor of shape {tuple(loaded.shape)}")
    if not loaded.item() > 0:  # the kernels scale scores inside the softmax's exponent
        raise ValueError(f"a KV-cache scale must be positive, got {loaded.item()}")
    if shard_id is None:
        param.data.fill_(loaded.item())
    else:
        param.data[shard_id] = loaded.item()
