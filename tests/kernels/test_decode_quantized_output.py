"""Decode attention that also quantizes its output per row, for an FP8 o_proj (the
`quantized` buffers): the codes and scales are quantize_activations' over the output the
launch returns, whichever of a row's programs finishes last, padding rows included, and
again on the next launch (the row counters go back to zero)."""
import pytest
import torch
from test_fp8_kv import fp8_cache, scales
from test_kernels import DEVICE, NUM_KV_HEADS, fused_qkv_views, make_block_tables, make_kv_cache

from nanovllm.kernels.decode_attention import decode_attention, decode_attention_with_config
from nanovllm.kernels.decode_config import DecodeConfig
from nanovllm.kernels.fp8 import quantize_activations
from nanovllm.kernels.rotary_store import Rotary
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.fp8 import FP8_DTYPE

CONTEXTS = [17, 1, 0, 40, 33, 70]


def poisoned_buffers(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and scales filled with NaN, so a row the kernel leaves unwritten shows."""
    q = torch.full((batch, width), 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
    return q, torch.full((batch, 1), float("nan"), device=DEVICE)


def assert_quantized_as_o_proj_would(out: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor]) -> None:
    expected_q, expected_scales = quantize_activations(out.reshape(out.shape[0], -1), out.shape[1] * out.shape[2])
    q, scales_ = quantized
    assert torch.equal(scales_, expected_scales)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("cache", ["16-bit", "fp8"])
@pytest.mark.parametrize("config", [None, DecodeConfig(num_splits=3, block_n=16, num_warps=4, num_stages=3,
                                                       min_split_tiles=1)], ids=["auto", "splits3"])
def test_decode_quantizes_each_row_as_o_proj_would(dtype: torch.dtype, cache: str, config: DecodeConfig | None) -> None:
    torch.manual_seed(0)
    group, head_dim, block_size = 2, 64, 16
    batch, num_heads = len(CONTEXTS), NUM_KV_HEADS * group
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in CONTEXTS], block_size)
    block_tables[CONTEXTS.index(0)] = -1
    if cache == "fp8":
        k_cache, v_cache = fp8_cache(num_blocks, block_size, head_dim, torch.float8_e4m3fn, "v_transposed")
        kv_scales = scales()
    else:
        k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)
        kv_scales = None
    q, _, _ = fused_qkv_views(batch, num_heads, NUM_KV_HEADS, head_dim, dtype)
    q[1] *= 1e3  # one row's output far larger than the others': its own scale
    lens = torch.tensor(CONTEXTS, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second launch finds the counters as the first left them
        quantized = poisoned_buffers(batch, num_heads * head_dim)
        if config is None:
            out = decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, kv_scales=kv_scales,
                                   quantized=quantized)
            plain = decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, kv_scales=kv_scales)
        else:
            out = decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, config,
                                               kv_scales=kv_scales, quantized=quantized)
            plain = decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, config,
                                                 kv_scales=kv_scales)
        assert torch.equal(out, plain)  # the output itself unchanged
        assert (out[CONTEXTS.index(0)] == 0).all()
        assert_quantized_as_o_proj_would(out, quantized)


def test_the_rotary_variant_quantizes_too() -> None:
    torch.manual_seed(0)
    dtype, group, head_dim, block_size = torch.float32, 2, 64, 16
    batch, num_heads = len(CONTEXTS), NUM_KV_HEADS * group
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in CONTEXTS], block_size)
    block_tables[CONTEXTS.index(0)] = -1
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)
    qkv = torch.randn(batch, (num_heads + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype, device=DEVICE)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32, device=DEVICE)
    rope = RotaryEmbedding(head_dim, 128, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    rotary = Rotary((lens - 1).clamp(min=0).long(), rope.cos_sin_cache)
    config = DecodeConfig(num_splits=2, block_n=16, num_warps=4, num_stages=3)
    quantized = poisoned_buffers(batch, num_heads * head_dim)
    out = decode_attention_with_config(qkv, k_cache, v_cache, block_tables, lens, head_dim**-0.5, config,
                                       rotary=rotary, quantized=quantized)
    assert_quantized_as_o_proj_would(out, quantized)


def test_quantized_buffers_are_checked() -> None:
    head_dim, block_size = 64, 16
    block_tables, num_blocks = make_block_tables([5, 3], block_size)
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, torch.float32)
    q, _, _ = fused_qkv_views(2, NUM_KV_HEADS, NUM_KV_HEADS, head_dim, torch.float32)
    lens = torch.tensor([5, 3], dtype=torch.int32, device=DEVICE)
    q_buffer, scales_ = poisoned_buffers(2, NUM_KV_HEADS * head_dim)
    strided_scales = torch.empty(2, 2, device=DEVICE)[:, :1]  # [2, 1], rows 2 apart
    for bad in ((q_buffer[:, 1:], scales_), (q_buffer, scales_.double()), (q_buffer.view(torch.uint8), scales_),
                (q_buffer, strided_scales), (q_buffer, scales_.to("meta"))):
        with pytest.raises(ValueError, match="quantized must be"):
            decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, quantized=bad)


@pytest.mark.parametrize("batch", [3, 256])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
def test_qwen3_8b_rows_on_the_gpu(batch: int, cache: str) -> None:
    """Qwen3-8B's heads (32 queries over 8 KV heads of 128) at the engine's cache layout, rows
    of 1 to 2,100 tokens, every program of a row on the GPU at once: the codes and scales
    are quantize_activations' over the output, five launches in a row."""
    torch.manual_seed(0)
    kv_heads, num_heads, head_dim, block_size = 8, 32, 128, 256
    contexts = torch.randint(1, 2100, (batch,)).tolist()
    contexts[0] = 0  # a padding row
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in contexts], block_size)
    block_tables[0] = -1
    kv = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16, device=DEVICE)
    k_cache, v_cache = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # head-major, as the engine's
    kv_scales = None
    if cache == "fp8":
        kv_scales = torch.tensor([0.02, 0.02], device=DEVICE)
        k_cache, v_cache = (c.div(0.02).to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    for _ in range(5):
        q = torch.randn(batch, num_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
        quantized = poisoned_buffers(batch, num_heads * head_dim)
        out = decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, kv_scales=kv_scales,
                               quantized=quantized)
        assert_quantized_as_o_proj_would(out, quantized)
