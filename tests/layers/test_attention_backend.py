"""The torch attention backend (layers/attention_backend.py): the path the CPU engine runs,
and on a GPU the start-up memory profile's prefill, before the cache exists."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers import attention_backend
from nanovllm.layers.attention_backend import TorchAttentionBackend
from nanovllm.utils.context import Context

TOKENS, HEADS, KV_HEADS, DIM, BLOCK = 37, 4, 2, 16, 16


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention in float64 of the last len(q) of len(keys) positions."""
    keys, values = keys.repeat_interleave(HEADS // KV_HEADS, dim=1), values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * DIM**-0.5
    visible = torch.ones(len(q), len(keys), dtype=torch.bool).tril(len(keys) - len(q))
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize("cached", [0, 21], ids=["fresh", "on_a_cached_prefix"])
def test_prefill_calls_sdpa_batched_so_gpus_may_take_fused_kernels(monkeypatch, cached):
    """A prompt's causal attention, GQA, fresh (no mask) or after a cached prefix (a mask):
    equal to a float64 reference, through SDPA with 4-D inputs and a 2-D or 4-D mask. With
    [heads, tokens, dim] inputs (or a 3-D mask) torch takes its math path, which on a GPU
    holds every score: 37.7 GiB more at a 16,384-token prompt on an H100, against 0.06 GiB
    batched (RESULTS.md, session 47), and the cache then had no room."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        calls.append((q.dim(), None if kwargs["attn_mask"] is None else kwargs["attn_mask"].dim()))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention_backend.F, "scaled_dot_product_attention", recorded)
    total = cached + TOKENS
    keys, values = torch.randn(2, total, KV_HEADS, DIM, dtype=torch.float64)
    q = torch.randn(TOKENS, HEADS, DIM, dtype=torch.float64)
    blocks = -(-total // BLOCK)
    k_cache, v_cache = torch.zeros(2, blocks, BLOCK, KV_HEADS, DIM, dtype=torch.float64)
    k_cache.view(-1, KV_HEADS, DIM)[:total], v_cache.view(-1, KV_HEADS, DIM)[:total] = keys, values
    context = Context(is_prefill=True, cu_seqlens_q=torch.tensor([0, TOKENS], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, total], dtype=torch.int32), max_seqlen_q=TOKENS,
                      block_tables=torch.arange(blocks, dtype=torch.int32)[None])
    out = TorchAttentionBackend().prefill(q, keys[cached:], values[cached:], k_cache, v_cache, context, DIM**-0.5,
                                          None)
    assert calls == [(4, None if cached == 0 else 2)]
    torch.testing.assert_close(out, reference(q, keys, values))
