"""Triton attention kernels against a plain torch reference.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below
before triton is imported), in float32 and float16 only: the interpreter's bf16 tl.dot
is wrong. With CUDA the same cases also run in bfloat16, plus larger cases and a
CUDA-graph replay of decode attention.

Every input is fresh random data. Cache slots that no sequence owns are NaN, so a kernel
that reads past a context (or through a padding block-table entry) produces NaN.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.language as tl

if not torch.cuda.is_available():
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        # Triton picks interpreter or compiler when each @triton.jit runs, at import time.
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set (transformers and "
            "torch._dynamo import it), so its kernels cannot run on CPU. Set "
            "os.environ.setdefault('TRITON_INTERPRET', '1') when CUDA is unavailable at the "
            "top of tests/conftest.py, before those imports, or export it in the shell."
        )

from nanovllm.kernels.decode_attention import (
    decode_attention,
    decode_attention_rotary,
    decode_attention_with_config,
)
import nanovllm.kernels.decode_config as decode_config_module
import nanovllm.kernels.prefill_attention as prefill_module
from nanovllm.kernels.decode_config import DecodeConfig
from nanovllm.kernels.paged import tma_tiles
from nanovllm.kernels.prefill_attention import (
    PrefillConfig,
    prefill_attention,
    prefill_attention_with_config,
    prefill_config,
)
from nanovllm.kernels.rotary_store import rotary_store
from nanovllm.kernels.store_kvcache import store_kvcache
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import Rotary

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

# ||out - ref|| / ||ref||: fp32 is exact up to summation order (IEEE dot on GPU); fp16 and
# bf16 round the softmax weights to 11 and 8 mantissa bits before the P @ V product.
REL_TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY),
]
# For the widest matrices: fp32 takes fp16's paths at a tighter tolerance, so it waits for
# --run-slow (keeping the default run near ten minutes).
DTYPES_FP32_SLOW = [
    pytest.param(torch.float32, id="fp32", marks=pytest.mark.slow),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY),
]
GPU_DTYPES = [
    pytest.param(torch.float16, id="fp16", marks=GPU_ONLY),
    pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY),
]
NUM_KV_HEADS = 2
# Blocks no sequence uses, so the shuffled block tables leave holes in the pool.
SPARE_BLOCKS = 5


def make_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, hnd: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as views of one random [2, num_blocks, block_size, Hkv, D] tensor
    (hnd: of memory laid out [2, num_blocks, Hkv, block_size, D], the engine's cache layout)."""
    if hnd:
        kv = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=DEVICE)
        kv = kv.transpose(2, 3)
    else:
        kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    return kv[0], kv[1]


def make_block_tables(lengths: list[int], block_size: int, extra_columns: int = 1) -> tuple[torch.Tensor, int]:
    """Block tables dealt from a shuffled pool, padded with -1; returns (tables, num_blocks)."""
    blocks_per_seq = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks_per_seq) + SPARE_BLOCKS
    pool = torch.randperm(num_blocks).tolist()
    width = max(blocks_per_seq) + extra_columns
    # [batch, width] int32
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor(pool[:count], dtype=torch.int32)
        pool = pool[count:]
    return tables.to(DEVICE), num_blocks


def sequence_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..length-1 of one sequence: [length] int64."""
    positions = torch.arange(length, device=block_table.device)
    return block_table[positions // block_size].long() * block_size + positions % block_size


def poison_unused_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, lengths: list[int]
) -> None:
    """Fill every slot outside the sequences' first `length` positions with NaN."""
    block_size = k_cache.shape[1]
    used = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool, device=DEVICE)
    for row, length in enumerate(lengths):
        used[sequence_slots(block_tables[row], length, block_size)] = True
    unused = (~used).view(k_cache.shape[:2])  # [num_blocks, block_size]: any cache strides
    for cache in (k_cache, v_cache):
        cache[unused] = float("nan")


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    len_k: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's len_q new tokens (q: [len_q, Hq, D]) in float64.

    The new tokens are the last len_q of len_k; returns [len_q, Hq, D] float64.
    """
    len_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    slots = sequence_slots(block_table, len_k, block_size)
    group = num_heads // num_kv_heads
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale  # [Hq, len_q, len_k]
    positions = torch.arange(len_k - len_q, len_k, device=q.device)
    visible = torch.arange(len_k, device=q.device)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def fused_qkv_views(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one [num_tokens, (Hq + 2 Hkv) * D] projection output."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 64, 16), (1, 128, 16), (8, 128, 256)])
def test_store_kvcache(
    dtype: torch.dtype, slot_dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    num_tokens, num_blocks = 11, 4
    _, key, value = fused_qkv_views(num_tokens, 4, num_kv_heads, head_dim, dtype)
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    # [num_tokens] distinct random slots; padding rows (-1) must leave the cache untouched
    slot_mapping = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slot_mapping[[2, 7]] = -1
    slot_mapping = slot_mapping.to(slot_dtype)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kept = slot_mapping >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slot_mapping[kept].long()] = key[kept]
    expected_v.view(-1, num_kv_heads, head_dim)[slot_mapping[kept].long()] = value[kept]

    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)


# fp32: equal up to the order of operations. fp16/bf16: the norm rounds to the dtype
# before its weight and again after it, where the kernel and torch can differ by one unit
# in the last place, which the rotation then carries: measured as a relative error.
ROTARY_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(4, 2, 64, 16), (6, 1, 128, 16), (16, 8, 128, 256)]
)
def test_rotary_store(
    dtype: torch.dtype, qk_norm: bool, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """The fused kernel equals the torch path (RMSNorm and RotaryEmbedding modules, then the
    cache store) on random weights, positions and slots, padding rows included."""
    num_tokens, num_blocks, max_position = 11, 4, 300
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, max_position, (num_tokens,), device=DEVICE)
    slot_mapping = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slot_mapping[[3, 8]] = -1
    rope = RotaryEmbedding(head_dim, max_position, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    norms = [RMSNorm(head_dim, eps=1e-6).to(DEVICE, dtype) for _ in range(2)] if qk_norm else [None, None]
    for norm in norms:
        if norm is not None:
            norm.weight.data = torch.rand(head_dim, dtype=dtype, device=DEVICE) + 0.5
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))

    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    if qk_norm:
        q, k = norms[0](q), norms[1](k)
    expected_q, expected_k = rope(positions, q, k)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    kept = slot_mapping >= 0
    expected_k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[kept]] = expected_k[kept]
    expected_v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[kept]] = v[kept]

    weights = [norm.weight if norm is not None else None for norm in norms]
    got_q = rotary_store(qkv, positions, rope.cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads, *weights, eps=1e-6)
    stored = slot_mapping[kept]
    got_k = k_cache.view(-1, num_kv_heads, head_dim)[stored]
    assert relative_error(got_q, expected_q.double()) <= ROTARY_TOL[dtype]
    assert relative_error(got_k, expected_k[kept].double()) <= ROTARY_TOL[dtype]
    # Values are copied as they are, and no other slot is touched.
    torch.testing.assert_close(v_cache, expected_v_cache, rtol=0, atol=0, equal_nan=True)
    untouched = torch.ones(k_cache.shape[0] * block_size, dtype=torch.bool, device=DEVICE)
    untouched[stored] = False
    assert k_cache.view(-1, num_kv_heads, head_dim)[untouched].isnan().all()


def check_decode(
    context_lens: list[int],
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    config: DecodeConfig | None,
    hnd: bool = False,
) -> None:
    """Run decode attention on fresh inputs and compare every row to the reference.

    Rows with context 0 are CUDA-graph padding: block table row all -1, output zeros.
    """
    batch, num_heads = len(context_lens), NUM_KV_HEADS * group
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in context_lens], block_size)
    for row, length in enumerate(context_lens):
        if length == 0:
            block_tables[row] = -1
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, hnd)
    poison_unused_slots(k_cache, v_cache, block_tables, context_lens)
    q, _, _ = fused_qkv_views(batch, num_heads, NUM_KV_HEADS, head_dim, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    # A strided view of a NaN buffer: rows the kernel leaves unwritten stay NaN.
    out = torch.full((batch, num_heads, 2 * head_dim), float("nan"), dtype=dtype, device=DEVICE)[..., :head_dim]
    scale = head_dim**-0.5

    if config is None:
        result = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, out=out)
    else:
        result = decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, scale, config, out=out)

    assert result is out and result.dtype == dtype
    assert torch.isfinite(out).all()
    for row, length in enumerate(context_lens):
        if length == 0:
            assert (out[row] == 0).all()
            continue
        ref = reference_attention(q[row : row + 1], k_cache, v_cache, block_tables[row], length, scale)
        assert relative_error(out[row], ref[0]) <= REL_TOL[dtype], f"row {row} (context {length})"


# Splitting configs with 16-token tiles, so that tiny contexts still span several splits;
# 8 splits leave some of them empty for every context here.
SPLIT_CONFIGS = [
    None,
    DecodeConfig(num_splits=3, block_n=16, num_warps=4, num_stages=3),
    DecodeConfig(num_splits=8, block_n=16, num_warps=4, num_stages=3),
    # Splits of at least two tiles: the 40-token row uses two of the eight, not three.
    DecodeConfig(num_splits=8, block_n=16, num_warps=4, num_stages=3, min_split_tiles=2),
    # ... shared evenly: the 40-token row (three tiles) in one split, not two and one.
    DecodeConfig(num_splits=8, block_n=16, num_warps=4, num_stages=3, min_split_tiles=2, join_tail=True),
]
SPLIT_IDS = ["auto", "splits3", "splits8", "splits8-min2", "splits8-min2-join"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"), [(1, 64, 16), (2, 128, 16), (4, 64, 16), (8, 128, 16), (4, 128, 256)]
)
@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=SPLIT_IDS)
def test_decode_attention(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, config: DecodeConfig | None
) -> None:
    # Mid-block ends (17, 40), an exact block (32), length 1 and a padding row; with
    # block 256 one context crosses into a second block.
    contexts = [17, 1, 0, 40, 32] if block_size == 16 else [1, 0, 40, 261, 64]  # 64: whole tiles only
    check_decode(contexts, group, head_dim, block_size, dtype, config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", SPLIT_CONFIGS[:2], ids=["auto", "splits3"])
def test_decode_attention_reads_the_cache_through_its_strides(dtype: torch.dtype, config: DecodeConfig | None) -> None:
    """A cache whose memory keeps each head's tokens together ([blocks, heads, tokens, dim],
    the engine's) read through the same [blocks, tokens, heads, dim] view."""
    check_decode([17, 1, 0, 40, 32], 2, 64, 16, dtype, config, hnd=True)


@pytest.mark.parametrize("dtype", DTYPES_FP32_SLOW)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("fp8", [False, True, "heads_outer"], ids=["", "fp8", "fp8-hnd"])
@pytest.mark.parametrize("config", SPLIT_CONFIGS + [DecodeConfig(1, 16, 4, 3), DecodeConfig(2, 16, 4, 3)],
                         ids=SPLIT_IDS + ["split1", "splits2"])
def test_decode_attention_rotary_equals_rotary_store_then_decode(
    dtype: torch.dtype, qk_norm: bool, fp8: bool | str, config: DecodeConfig | None
) -> None:
    """The fused kernel stores the newest tokens' keys and values as rotary_store does
    and attends as decode_attention does after it: with 16-token tiles and one or two
    splits, the newest token sits in a later tile than the first of its split (stored,
    then read back by the program's loop; with 32, in a whole tile, read unmasked). Over
    an FP8 cache too, tokens outer and in the engine's head-major memory."""
    torch.manual_seed(0)
    group, head_dim, block_size = 2, 64, 16
    contexts = [17, 1, 0, 40, 33, 32]
    batch, num_heads = len(contexts), NUM_KV_HEADS * group
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in contexts], block_size)
    block_tables[2] = -1
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, hnd=fp8 == "heads_outer")
    poison_unused_slots(k_cache, v_cache, block_tables, contexts)
    scales = None
    if fp8:
        scales = torch.tensor([0.02, 0.01], device=DEVICE)
        k_cache, v_cache = (c.div(s).nan_to_num(nan=0.0).to(torch.float8_e4m3fn) for c, s in zip((k_cache, v_cache), scales))
        # elementwise ops keep the memory's order: heads outer stays heads outer
        assert (k_cache.stride(1) == head_dim) == (fp8 == "heads_outer") and v_cache.stride() == k_cache.stride()
    qkv = torch.randn(batch, (num_heads + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype, device=DEVICE)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    positions = (lens - 1).clamp(min=0).long()
    slots = torch.tensor([sequence_slots(block_tables[row], n, block_size)[-1].item() if n else -1
                          for row, n in enumerate(contexts)], device=DEVICE)
    rope = RotaryEmbedding(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    weights = [torch.rand(head_dim, dtype=dtype, device=DEVICE) + 0.5 for _ in range(2)] if qk_norm else [None, None]
    rotary = Rotary(positions, rope.cos_sin_cache, *weights, eps=1e-6)
    scale = head_dim**-0.5
    caches = (k_cache.clone(), v_cache.clone())

    q = rotary_store(qkv, positions, rope.cos_sin_cache, k_cache, v_cache, slots, num_heads, *weights, eps=1e-6,
                     kv_scales=scales)
    if config is None:
        expected = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, kv_scales=scales)
        got = decode_attention_rotary(qkv, *caches, block_tables, lens, scale, rotary, kv_scales=scales)
    else:
        expected = decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, scale, config, kv_scales=scales)
        got = decode_attention_with_config(qkv, *caches, block_tables, lens, scale, config, kv_scales=scales,
                                           rotary=rotary)
    assert got.shape == (batch, num_heads, head_dim) and got.dtype == dtype
    assert (got[2] == 0).all()
    assert relative_error(got, expected.double()) <= (2e-2 if fp8 else ROTARY_TOL[dtype])
    for got_cache, expected_cache in zip(caches, (k_cache, v_cache)):
        # atol: keys near zero differ by the two rotations' rounding alone.
        different = ~torch.isclose(got_cache.float(), expected_cache.float(), rtol=ROTARY_TOL[dtype],
                                   atol=ROTARY_TOL[dtype] / 10, equal_nan=True)
        # An FP8 key may round to the neighbouring value where the two rotations' fp32 sums differ.
        assert different.sum() <= (2 if fp8 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["", "fp8"])
def test_decode_attention_tiles_by_tma_equal_loads(dtype: torch.dtype, cache_dtype, monkeypatch) -> None:
    """Whole tiles of a head-major cache by TMA copies (decode_config.tile_descriptors) give
    the output the loads give, bit for bit; the first and the partial tiles stay loads."""
    group, head_dim, block_size = 2, 64, 32
    contexts = [17, 1, 0, 100, 64, 70]  # partial, one token, padding, several blocks, whole tiles
    config = DecodeConfig(num_splits=2, block_n=16, num_warps=4, num_stages=3)
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in contexts], block_size)
    block_tables[2] = -1
    kv = torch.randn(2, num_blocks, NUM_KV_HEADS, block_size, head_dim, device=DEVICE)
    kv = kv.to(cache_dtype or dtype).transpose(2, 3)  # the engine's head-major memory
    k_cache, v_cache = kv[0], kv[1]
    kv_scales = torch.tensor([0.5, 2.0], device=DEVICE) if cache_dtype else None
    q, _, _ = fused_qkv_views(len(contexts), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    outs = []
    for tma in (False, True):
        monkeypatch.setattr(decode_config_module, "TMA_TILES", tma)
        outs.append(decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, 0.1, config,
                                                 kv_scales=kv_scales))
    assert torch.equal(outs[0], outs[1])
    # 16-bit and FP8 caches (a float32 one keeps loads, and this test compares loads with loads)
    descriptors = decode_config_module.tile_descriptors(k_cache, v_cache, config.block_n)
    assert (descriptors is None) == (k_cache.element_size() > 2)
    # Only where a tile is one contiguous range of rows: not tokens-outer, not across blocks.
    tokens_outer = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)
    assert decode_config_module.tile_descriptors(*tokens_outer, config.block_n) is None
    assert decode_config_module.tile_descriptors(k_cache, v_cache, 2 * block_size) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_allocates_out(dtype: torch.dtype) -> None:
    """Without `out` the result is a fresh contiguous tensor in q's dtype."""
    batch, group, head_dim, block_size = 3, 2, 64, 16
    contexts = [5, 23, 16]
    block_tables, num_blocks = make_block_tables(contexts, block_size)
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)
    poison_unused_slots(k_cache, v_cache, block_tables, contexts)
    q, _, _ = fused_qkv_views(batch, NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    for row, length in enumerate(contexts):
        ref = reference_attention(q[row : row + 1], k_cache, v_cache, block_tables[row], length, 0.1)
        assert relative_error(out[row], ref[0]) <= REL_TOL[dtype]


def test_attention_rejects_bad_shapes() -> None:
    """Shape mistakes raise ValueError with the expected shape, not a kernel fault."""
    k_cache, v_cache = make_kv_cache(4, 16, NUM_KV_HEADS, 64, torch.float32)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(torch.randn(2, 3, 64, device=DEVICE), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        decode_attention(torch.randn(2, 4, 48, device=DEVICE), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(torch.randn(2, 4, 64, dtype=torch.float16, device=DEVICE), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        decode_attention(torch.randn(2, 4, 64, device=DEVICE), k_cache, v_cache, tables, lens[:1], 1.0)


def test_rotary_inputs_are_checked_alike() -> None:
    """rotary_store and decode attention doing its work refuse the same bad q/k/v, positions,
    rotary table and norms, each with one message saying what is wrong."""
    num_heads, head_dim, rows = 4, 64, 2
    k_cache, v_cache = make_kv_cache(4, 16, NUM_KV_HEADS, head_dim, torch.float32)
    tables = torch.zeros(rows, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(rows, dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(rows, (num_heads + 2 * NUM_KV_HEADS) * head_dim, device=DEVICE)
    positions = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    table = RotaryEmbedding(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE).cos_sin_cache
    weight = torch.ones(head_dim, device=DEVICE)
    slots = torch.arange(rows, device=DEVICE)
    cases = [
        (dict(qkv=qkv[:, :-head_dim // 2]), "qkv must be"),
        (dict(positions=positions[:1]), "positions must be"),
        (dict(table=table[:, : head_dim // 2]), "cos_sin_cache must be"),
        (dict(table=torch.randn(head_dim, 64, device=DEVICE).t()), "cos_sin_cache must be"),
        (dict(table=table[0]), "cos_sin_cache must be"),
        (dict(norms=(weight, None)), "give both"),
    ]
    for change, message in cases:
        args = dict(qkv=qkv, positions=positions, table=table, norms=(None, None)) | change
        with pytest.raises(ValueError, match=message):
            rotary_store(args["qkv"], args["positions"], args["table"], k_cache, v_cache, slots, num_heads,
                         *args["norms"])
        with pytest.raises(ValueError, match=message):
            decode_attention_rotary(args["qkv"], k_cache, v_cache, tables, lens, 1.0,
                                    Rotary(args["positions"], args["table"], *args["norms"]))


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_attention_large(dtype: torch.dtype, block_size: int) -> None:
    contexts = torch.randint(1, 3000, (48,)).tolist()
    contexts[5] = 0
    contexts[9] = 1
    check_decode(contexts, group=4, head_dim=128, block_size=block_size, dtype=dtype, config=None)


def check_prefill(
    lens_q: list[int],
    lens_k: list[int],
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    config: PrefillConfig | None,
    hnd: bool = False,
    search: bool = False,
) -> None:
    """Run prefill attention on fresh inputs and compare every sequence to the reference
    (hnd: over the engine's head-major cache; search: with max_seqlen_q=None, as the
    prefill graphs launch it)."""
    num_heads = NUM_KV_HEADS * group
    block_tables, num_blocks = make_block_tables(lens_k, block_size)
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, hnd)
    poison_unused_slots(k_cache, v_cache, block_tables, lens_k)
    q, _, _ = fused_qkv_views(sum(lens_q), num_heads, NUM_KV_HEADS, head_dim, dtype)
    cu_seqlens_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_seqlens_k = torch.tensor([0, *lens_k], device=DEVICE).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, None if search else max(lens_q), scale)
    num_seqs = torch.tensor([len(lens_q)], dtype=torch.int32, device=DEVICE) if search else None

    if config is None:
        out = prefill_attention(*args, num_seqs=num_seqs)
    else:
        out = prefill_attention_with_config(*args, config, num_seqs=num_seqs)

    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    for seq, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
        begin = cu_seqlens_q[seq].item()
        ref = reference_attention(q[begin : begin + len_q], k_cache, v_cache, block_tables[seq], len_k, scale)
        error = relative_error(out[begin : begin + len_q], ref)
        assert error <= REL_TOL[dtype], f"sequence {seq} (len_q {len_q}, len_k {len_k}): {error}"


# (lens_q, lens_k): fresh prompts, and prefix hits / chunks mixed with fresh prompts
# (len_k == len_q) and single new tokens.
FRESH = ([17, 1, 40, 5], [17, 1, 40, 5])
WITH_PREFIX = ([1, 17, 23, 5, 2], [33, 17, 40, 21, 2])
# 16 x 16 tiles: several query tiles per sequence and unmasked key tiles below the diagonal.
SMALL_TILES = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "lens"),
    [
        (1, 64, 16, FRESH),
        (2, 128, 16, WITH_PREFIX),
        (4, 64, 16, WITH_PREFIX),
        (8, 128, 16, FRESH),
        (2, 64, 256, ([3, 40], [270, 40])),
    ],
    ids=["g1-d64-fresh", "g2-d128-prefix", "g4-d64-prefix", "g8-d128-fresh", "g2-d64-b256-prefix"],
)
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["auto", "tiles16"])
def test_prefill_attention(
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_size: int,
    lens: tuple[list[int], list[int]],
    config: PrefillConfig | None,
) -> None:
    check_prefill(*lens, group, head_dim, block_size, dtype, config)


def test_attention_with_a_block_size_not_a_power_of_two() -> None:
    """Blocks of 24 tokens: no tile divides them, so tiles cross blocks and take one block id
    per token (kernels/paged.py's tile_blocks)."""
    check_decode([17, 1, 0, 40, 61, 48], 2, 64, 24, torch.float32, None)
    check_prefill([3, 40], [70, 40], 2, 64, 24, torch.float32, None)


def test_prefill_attention_writes_into_out() -> None:
    """With `out` (the prefill graphs' static buffer), the result goes there, bit for bit
    the one a fresh tensor gets; an `out` of the wrong shape is refused."""
    lens_q, lens_k = WITH_PREFIX
    block_tables, num_blocks = make_block_tables(lens_k, 16)
    k_cache, v_cache = make_kv_cache(num_blocks, 16, NUM_KV_HEADS, 64, torch.float32)
    q, _, _ = fused_qkv_views(sum(lens_q), NUM_KV_HEADS * 2, NUM_KV_HEADS, 64, torch.float32)
    cu_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEVICE).cumsum(0).to(torch.int32)
    args = (q, k_cache, v_cache, cu_q, cu_k, block_tables, max(lens_q), 0.125)
    buffer = torch.full((q.shape[0] + 3, *q.shape[1:]), float("nan"), device=DEVICE)
    got = prefill_attention(*args, out=buffer[: q.shape[0]])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, prefill_attention(*args))
    assert buffer[q.shape[0]:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        prefill_attention(*args, out=buffer[1:])


@pytest.mark.parametrize("dtype", DTYPES_FP32_SLOW)
@pytest.mark.parametrize("config", [SMALL_TILES, PrefillConfig(64, 32, 4, 3)], ids=["tiles16", "tiles64"])
def test_prefill_attention_without_max_seqlen_searches_its_tiles(dtype: torch.dtype, config: PrefillConfig) -> None:
    """max_seqlen_q=None (a CUDA graph's fixed grid, num_seqs on the device): the same bits
    as the grid sized by max_seqlen_q, with padding rows past the sequences left untouched
    and whatever the sequences past num_seqs hold (a graph's stale context) never read.
    Many one-token sequences make the programs walk several tiles each."""
    lens_q, lens_k = [1, 17, 40, 1, 33, 2] + [1] * 20, [30, 17, 70, 5, 33, 2] + list(range(3, 23))
    padded_seqs, padded_rows = 3, 21
    real_seqs, real = len(lens_q), sum(lens_q)
    block_tables, num_blocks = make_block_tables(lens_k + [1] * padded_seqs, 16)
    k_cache, v_cache = make_kv_cache(num_blocks, 16, NUM_KV_HEADS, 64, dtype)
    q, _, _ = fused_qkv_views(real + padded_rows, NUM_KV_HEADS * 2, NUM_KV_HEADS, 64, dtype)
    cu_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEVICE).cumsum(0).to(torch.int32)
    expected = prefill_attention_with_config(q[:real], k_cache, v_cache, cu_q, cu_k, block_tables[:real_seqs],
                                             max(lens_q), 0.125, config)
    stale = torch.tensor([3, 1, 0], dtype=torch.int32, device=DEVICE)  # would rewrite rows 0-3
    cu_q, cu_k = torch.cat([cu_q, stale]), torch.cat([cu_k, stale])
    num_seqs = torch.tensor([real_seqs], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    got = prefill_attention_with_config(q, k_cache, v_cache, cu_q, cu_k, block_tables, None, 0.125, config,
                                        out=out, num_seqs=num_seqs)
    assert torch.equal(got[:real], expected)
    assert got[real:].isnan().all()
    # The default config comes from the row count; without num_seqs the call is refused.
    args = (q[:real], k_cache, v_cache, cu_q[: real_seqs + 1], cu_k[: real_seqs + 1], block_tables[:real_seqs], None,
            0.125)
    assert torch.isfinite(prefill_attention(*args, num_seqs=num_seqs)).all()
    with pytest.raises(ValueError, match="needs num_seqs"):
        prefill_attention(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["", "fp8"])
def test_prefill_attention_tiles_by_tma_equal_loads(dtype: torch.dtype, cache_dtype, monkeypatch) -> None:
    """With NANOVLLM_PREFILL_TMA the whole key tiles below the diagonal come by TMA copies
    (kernels/paged.py's tma_tiles): the output the loads give, bit for bit."""
    group, head_dim, block_size = 2, 64, 32
    # Chunks over cached prefixes and fresh prompts: tiles below the diagonal and across it.
    lens_q, lens_k = [1, 40, 70, 5], [33, 40, 100, 70]
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=3)
    block_tables, num_blocks = make_block_tables(lens_k, block_size)
    kv = torch.randn(2, num_blocks, NUM_KV_HEADS, block_size, head_dim, device=DEVICE)
    kv = kv.to(cache_dtype or dtype).transpose(2, 3)  # the engine's head-major memory
    k_cache, v_cache = kv[0], kv[1]
    kv_scales = torch.tensor([0.5, 2.0], device=DEVICE) if cache_dtype else None
    q, _, _ = fused_qkv_views(sum(lens_q), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    cu_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEVICE).cumsum(0).to(torch.int32)
    outs = []
    for tma in (False, True):
        monkeypatch.setattr(prefill_module, "TMA_TILES", tma)
        outs.append(prefill_attention_with_config(q, k_cache, v_cache, cu_q, cu_k, block_tables, max(lens_q), 0.1,
                                                  config, kv_scales=kv_scales))
    assert torch.equal(outs[0], outs[1])
    # TMA ran over 16-bit and FP8 caches (a float32 one keeps loads: this compares loads with loads)
    assert (tma_tiles(k_cache, v_cache, config.block_n) is None) == (k_cache.element_size() > 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("search", [False, True], ids=["max_seqlen_q", "search"])
def test_prefill_attention_default_config_on_the_engines_cache(dtype: torch.dtype, search: bool) -> None:
    """The launch the engine makes: prefill_config's tiles (64 queries), whole key tiles by
    TMA copies over the head-major cache (16-bit), with max_seqlen_q given and searched."""
    lens_q, lens_k = [70, 1, 130, 20], [70, 65, 200, 150]  # fresh, one new token, chunks over cached prefixes
    assert prefill_config(max(lens_q), 64, dtype).block_m == 64
    k_cache, v_cache = make_kv_cache(1, 64, NUM_KV_HEADS, 64, dtype, hnd=True)
    assert (tma_tiles(k_cache, v_cache, 64) is None) == (dtype.itemsize > 2)
    check_prefill(lens_q, lens_k, group=2, head_dim=64, block_size=64, dtype=dtype, config=None, hnd=True,
                  search=search)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_attention_large(dtype: torch.dtype, block_size: int) -> None:
    lens_k = torch.randint(1, 1500, (8,)).tolist()
    lens_q = [max(1, length - torch.randint(0, length, ()).item()) for length in lens_k]
    lens_q[0] = lens_k[0]
    check_prefill(lens_q, lens_k, group=4, head_dim=128, block_size=block_size, dtype=dtype, config=None)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_decode_attention_merge_is_race_free(dtype: torch.dtype) -> None:
    """The last split to finish merges: repeated launches over many splits give the same
    bits every time (a merge that read a split before it was written would not)."""
    contexts = torch.randint(1, 2048, (64,)).tolist()
    block_size = 16
    block_tables, num_blocks = make_block_tables(contexts, block_size)
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, 128, dtype)
    q, _, _ = fused_qkv_views(len(contexts), NUM_KV_HEADS * 4, NUM_KV_HEADS, 128, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    config = DecodeConfig(num_splits=16, block_n=32, num_warps=4, num_stages=3)
    first = decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, 0.1, config)
    for _ in range(200):
        assert torch.equal(decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, 0.1, config), first)
    for row in (0, 31, 63):
        ref = reference_attention(q[row : row + 1], k_cache, v_cache, block_tables[row], contexts[row], 0.1)
        assert relative_error(first[row], ref[0]) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_decode_attention_cuda_graph(dtype: torch.dtype) -> None:
    """Capture once, then rewrite context_lens and block_tables in place and replay."""
    batch, group, head_dim, block_size, max_blocks = 8, 4, 128, 16, 12
    num_heads = NUM_KV_HEADS * group
    num_blocks = batch * max_blocks
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=DEVICE)
    out = torch.empty_like(q)
    lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32, device=DEVICE)
    block_tables[:, 0] = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    def run() -> None:
        decode_attention(q, k_cache, v_cache, block_tables, lens, scale, out=out)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    for _ in range(2):
        contexts = torch.randint(1, max_blocks * block_size + 1, (batch,)).tolist()
        contexts[-1] = 0  # a padding row
        new_tables, _ = make_block_tables([max(n, 1) for n in contexts], block_size)
        block_tables.fill_(-1)
        block_tables[:, : new_tables.shape[1]] = new_tables[:, :max_blocks]
        block_tables[-1] = -1
        lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        run()
        assert torch.equal(replayed, out), "graph replay differs from eager"
        assert (replayed[-1] == 0).all()
        for row, length in enumerate(contexts[:-1]):
            ref = reference_attention(q[row : row + 1], k_cache, v_cache, block_tables[row], length, scale)
            assert relative_error(replayed[row], ref[0]) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_projection_attention_chain_replays_bit_identically_with_and_without_pdl(dtype, monkeypatch) -> None:
    """A decode layer's chain as the graphs run it below split_gemm.SPLIT_MIN_ROWS rows: the
    q/k/v GEMV, the fused rotary decode kernel (stores the newest key and value, reads the
    cache) and the o_proj GEMV, four layers over one cache, captured in a CUDA graph. With
    PDL each kernel starts early and must wait before reading what the one before writes:
    the replays give the eager chain's bits, and the same bits as without PDL."""
    from nanovllm.kernels.gemv import gemv

    torch.manual_seed(0)
    group, head_dim, block_size, hidden = 2, 128, 16, 512
    contexts = [1, 37, 64, 200]
    num_heads = NUM_KV_HEADS * group
    block_tables, num_blocks = make_block_tables(contexts, block_size)
    rope = RotaryEmbedding(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    rotary = Rotary((lens - 1).long(), rope.cos_sin_cache,
                    *[torch.rand(head_dim, dtype=dtype, device=DEVICE) + 0.5 for _ in range(2)], eps=1e-6)
    layers = [(torch.randn((num_heads + 2 * NUM_KV_HEADS) * head_dim, hidden, dtype=dtype, device=DEVICE) / 22,
               torch.randn(hidden, num_heads * head_dim, dtype=dtype, device=DEVICE) / 22,
               *make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)) for _ in range(4)]
    x = torch.randn(len(contexts), hidden, dtype=dtype, device=DEVICE)

    def chain(h: torch.Tensor) -> torch.Tensor:
        for qkv_weight, o_weight, k_cache, v_cache in layers:
            attn = decode_attention_rotary(gemv(h, qkv_weight), k_cache, v_cache, block_tables, lens,
                                           head_dim**-0.5, rotary)
            h = h + gemv(attn.view(h.shape[0], -1), o_weight)
        return h

    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("NANOVLLM_PDL", pdl)
        eager = chain(x)  # the newest tokens' K/V: the same values at the same slots every run
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x)
        for _ in range(20):
            graph.replay()
            assert torch.equal(out, eager)
        results[pdl] = eager
    assert torch.equal(results["1"], results["0"])
