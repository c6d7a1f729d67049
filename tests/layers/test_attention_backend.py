"""The torch attention backend (layers/attention_backend.py): the path the CPU engine runs,
and on a GPU the start-up memory profile's prefill, before the cache exists."""
import torch
import torch.nn.functional as F

from nanovllm.layers import attention_backend
from nanovllm.layers.attention_backend import TorchAttentionBackend
from nanovllm.utils.context import Context


def test_prefill_calls_sdpa_batched_so_gpus_take_the_fused_kernels(monkeypatch):
    """A fresh prompt's causal attention, GQA: equal to a float64 reference, through SDPA
    with 4-D inputs. With [heads, tokens, dim] inputs torch takes its math path on a GPU,
    which holds every score: 37.7 GiB more at a 16,384-token prompt on an H100, against
    0.06 GiB batched (RESULTS.md, session 47), and the cache then had no room."""
    dims, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        dims.append(q.dim())
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention_backend.F, "scaled_dot_product_attention", recorded)
    tokens, heads, kv_heads, dim = 37, 4, 2, 16
    q, k, v = (torch.randn(tokens, n, dim, dtype=torch.float64) for n in (heads, kv_heads, kv_heads))
    context = Context(is_prefill=True, cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, tokens], dtype=torch.int32), max_seqlen_q=tokens,
                      max_seqlen_k=tokens)
    empty = torch.empty(0, 16, kv_heads, dim, dtype=torch.float64)  # before the cache exists
    out = TorchAttentionBackend().prefill(q, k, v, empty, empty, context, dim**-0.5, None)
    assert dims == [4]
    keys, values = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * dim**-0.5
    scores = scores.masked_fill(~torch.ones(tokens, tokens, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(out, expected)
