"""Open V groups (kernels/paged.py, NANOVLLM_FP8_V_OPEN_GROUPS): an FP8 cache with V stored
transposed keeps each sequence's newest, incomplete group of 32 tokens token-major, and the
token that completes a group writes it transposed.

The oracle is the same schedule of launches (prefill chunks, decode steps, mixed launches;
every writer: rotary_store, store_kvcache, decode_attention_rotary) run over a cache without
open groups: every attention output must be bit for bit the same, and every stored V value,
read back through the open form where a group is open, the same code.
"""
import pytest
import torch
from test_fp8_kv import assert_same_codes, fp8_cache, scales
from test_kernels import DEVICE, GPU_ONLY, HAS_CUDA, NUM_KV_HEADS, make_block_tables

import nanovllm.kernels.paged as paged
from nanovllm.kernels.decode_attention import (Rotary, decode_attention, decode_attention_rotary,
                                               decode_attention_with_config)
from nanovllm.kernels.decode_config import DecodeConfig
from nanovllm.kernels.paged import V_GROUP, v_open_groups
from nanovllm.kernels.prefill_attention import prefill_attention
from nanovllm.kernels.rotary_store import rotary_store
from nanovllm.kernels.store_kvcache import store_kvcache
from nanovllm.layers.rotary_embedding import RotaryEmbedding

SLOW_ON_CPU = [] if HAS_CUDA else [pytest.mark.slow]
NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 64, 64
QKV_WIDTH = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
# Prompt lengths, then launches: (writer, [(sequence, new tokens), ...]). Chosen so that
# groups close in every way: a decode token completing a group (30 -> 31 -> 32) and a block
# (62 -> 64), a chunk completing a group its earlier launches opened (9 + 30, 64 + 2 + 40,
# 34 + 30 to a block's end), a chunk ending exactly on a group, a mixed launch, and open
# groups left behind by each writer.
PROMPTS = [30, 7, 64, 62]
SCHEDULE = [
    ("fused", [(0, 1), (1, 1), (2, 1), (3, 1)]),
    ("rotary_store", [(0, 1), (1, 1), (2, 1), (3, 1)]),
    ("store_kvcache", [(1, 30), (3, 40)]),
    ("rotary_store", [(0, 1), (2, 40), (1, 1)]),
    ("fused", [(0, 1), (1, 1), (2, 1), (3, 1)]),
    ("store_kvcache", [(0, 30), (1, 24)]),
    ("store_kvcache", [(0, 1), (1, 1), (2, 1), (3, 1)]),
]


def stored_v(v_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, heads, head_dim] codes of one sequence's V, read as the open-groups layout
    says: transposed ([blocks, heads, head_dim, block_size] memory), the open group
    token-major in its own bytes (counted row by row)."""
    memory = v_cache.permute(0, 2, 3, 1)
    first_open = length - length % V_GROUP
    rows = []
    for position in range(length):
        block, offset = int(block_table[position // BLOCK_SIZE]), position % BLOCK_SIZE
        if position < first_open:
            rows.append(memory[block, :, :, offset])
        else:
            start, t = offset - offset % V_GROUP, offset % V_GROUP
            group = memory[block, :, :, start:start + V_GROUP].reshape(NUM_KV_HEADS, -1)
            rows.append(group[:, t * HEAD_DIM:(t + 1) * HEAD_DIM])
    return torch.stack(rows)


def run_schedule(open_groups: bool, dtype: torch.dtype, monkeypatch, config: DecodeConfig | None = None) -> tuple:
    """The prompts' prefill then SCHEDULE from the same random inputs: each launch's
    attention output, the caches, the block tables and the sequences' lengths. config:
    decode attention's launch (default: decode_config's)."""
    monkeypatch.setattr(paged, "OPEN_V_GROUPS", open_groups)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    torch.manual_seed(0)
    tables, num_blocks = make_block_tables([160] * len(PROMPTS), BLOCK_SIZE)
    k_cache, v_cache = fp8_cache(num_blocks, BLOCK_SIZE, HEAD_DIM, torch.float8_e4m3fn, "v_transposed")
    k_cache.zero_()
    v_cache.zero_()
    assert v_open_groups(k_cache, v_cache) == open_groups
    rope = RotaryEmbedding(HEAD_DIM, 512, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    lengths = [0] * len(PROMPTS)
    outputs = []
    for writer, chunks in [("rotary_store", list(enumerate(PROMPTS)))] + SCHEDULE:
        positions = torch.cat([torch.arange(lengths[s], lengths[s] + n) for s, n in chunks]).to(DEVICE)
        slots = torch.cat([tables[s].long()[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                           for (s, n) in chunks for p in [torch.arange(lengths[s], lengths[s] + n, device=DEVICE)]])
        qkv = torch.randn(len(positions), QKV_WIDTH, generator=generator, device=DEVICE).to(dtype)
        rows = tables[[s for s, _ in chunks]]
        for s, n in chunks:
            lengths[s] += n
        lens = torch.tensor([lengths[s] for s, _ in chunks], dtype=torch.int32, device=DEVICE)
        decode = all(n == 1 for _, n in chunks)
        if writer == "fused":
            rotary = Rotary(positions, rope.cos_sin_cache)
            if config is None:
                outputs.append(decode_attention_rotary(qkv, k_cache, v_cache, rows, lens, HEAD_DIM ** -0.5, rotary,
                                                       kv_scales=scales()))
            else:
                outputs.append(decode_attention_with_config(qkv, k_cache, v_cache, rows, lens, HEAD_DIM ** -0.5,
                                                            config, kv_scales=scales(), rotary=rotary))
            continue
        if writer == "rotary_store":
            q = rotary_store(qkv, positions, rope.cos_sin_cache, k_cache, v_cache, slots, NUM_HEADS,
                             kv_scales=scales())
        else:
            q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
            store_kvcache(k.view(-1, NUM_KV_HEADS, HEAD_DIM), v.view(-1, NUM_KV_HEADS, HEAD_DIM), k_cache, v_cache,
                          slots, scales())
            q = q.reshape(-1, NUM_HEADS, HEAD_DIM)
        if decode and config is not None:
            outputs.append(decode_attention_with_config(q, k_cache, v_cache, rows, lens, HEAD_DIM ** -0.5, config,
                                                        kv_scales=scales()))
        elif decode:
            outputs.append(decode_attention(q, k_cache, v_cache, rows, lens, HEAD_DIM ** -0.5, kv_scales=scales()))
        else:
            new = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0).to(torch.int32)
            total = torch.cat([torch.zeros(1, device=DEVICE, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
            outputs.append(prefill_attention(q, k_cache, v_cache, new, total, rows, max(n for _, n in chunks),
                                             HEAD_DIM ** -0.5, scales()))
    return outputs, k_cache, v_cache, tables, lengths


# fp16 waits for --run-slow on CPU (fp32 takes the same paths), keeping the default run near ten minutes
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=SLOW_ON_CPU),
                                   pytest.param(torch.bfloat16, marks=GPU_ONLY)], ids=["fp32", "fp16", "bf16"])
# decode_config's launch (one split on CPU), and four splits of 32-token tiles: the newest
# token's split then starts past other tiles, its group in the masked tail or closed
@pytest.mark.parametrize("config", [None, DecodeConfig(num_splits=4, block_n=32, num_warps=4, num_stages=1,
                                                       min_split_tiles=1)], ids=["auto", "splits4"])
def test_open_groups_give_the_same_attention_and_values(dtype: torch.dtype, config, monkeypatch) -> None:
    plain, k_plain, v_plain, tables, lengths = run_schedule(False, dtype, monkeypatch, config)
    opened, k_open, v_open, _, _ = run_schedule(True, dtype, monkeypatch, config)
    for step, (got, expected) in enumerate(zip(opened, plain)):
        assert torch.isfinite(expected).all()
        assert torch.equal(got, expected), f"launch {step}: attention differs"
    assert_same_codes(k_open, k_plain)
    closed_somewhere = False
    for row, length in enumerate(lengths):
        expected = v_plain[tables[row].long()[torch.arange(length) // BLOCK_SIZE], torch.arange(length) % BLOCK_SIZE]
        assert_same_codes(stored_v(v_open, tables[row], length), expected)
        closed_somewhere |= length >= V_GROUP
    assert closed_somewhere and any(length % V_GROUP for length in lengths)  # both forms were read


def test_open_groups_need_tiles_of_whole_groups(monkeypatch) -> None:
    monkeypatch.setattr(paged, "OPEN_V_GROUPS", True)
    k_cache, v_cache = fp8_cache(4, BLOCK_SIZE, HEAD_DIM, torch.float8_e4m3fn, "v_transposed")
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="split a V group"):
        decode_attention_with_config(q, k_cache, v_cache, tables, torch.tensor([5], dtype=torch.int32, device=DEVICE),
                                     0.1, DecodeConfig(num_splits=1, block_n=16, num_warps=4, num_stages=1),
                                     kv_scales=scales())


def test_open_groups_only_where_blocks_hold_whole_groups(monkeypatch) -> None:
    monkeypatch.setattr(paged, "OPEN_V_GROUPS", True)
    assert v_open_groups(*fp8_cache(4, 64, HEAD_DIM, torch.float8_e4m3fn, "v_transposed"))
    assert not v_open_groups(*fp8_cache(4, 16, HEAD_DIM, torch.float8_e4m3fn, "v_transposed"))
    assert not v_open_groups(*fp8_cache(4, 64, HEAD_DIM, torch.float8_e4m3fn, "tokens_outer"))
    monkeypatch.setattr(paged, "OPEN_V_GROUPS", False)
    assert not v_open_groups(*fp8_cache(4, 64, HEAD_DIM, torch.float8_e4m3fn, "v_transposed"))
