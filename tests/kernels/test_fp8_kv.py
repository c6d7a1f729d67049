"""The attention kernels with an FP8 KV cache (kv_cache_dtype="fp8"), against the torch
backend's quantization and a float64 reference over the dequantized cache.

On CPU they run under the Triton interpreter with float32 and float16 queries; FP8 is
only the storage, so the interpreter's bf16 tl.dot never comes into it.
"""
import pytest
import torch
from test_kernels import (
    DEVICE,
    GPU_ONLY,
    NUM_KV_HEADS,
    REL_TOL,
    fused_qkv_views,
    make_block_tables,
    poison_unused_slots,
    reference_attention,
    relative_error,
)

from nanovllm.kernels.decode_attention import decode_attention, decode_attention_with_config
from nanovllm.kernels.decode_config import DecodeConfig, decode_config
from nanovllm.kernels.prefill_attention import prefill_attention
from nanovllm.kernels.rotary_store import rotary_store
from nanovllm.kernels.store_kvcache import store_kvcache
from nanovllm.layers.attention_backend import dequantize, quantize
from nanovllm.layers.rotary_embedding import RotaryEmbedding

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY),
]
# Scales that put the random K/V (|x| up to ~4) well inside e4m3's range, a few outliers saturating.
KV_SCALES = (0.011, 0.007)


def scales() -> torch.Tensor:
    return torch.tensor(KV_SCALES, dtype=torch.float32, device=DEVICE)


def assert_same_codes(got: torch.Tensor, expected: torch.Tensor) -> None:
    """FP8 tensors equal code for code (the kernels divide with IEEE rounding, div_rn, and
    round on the format's grid as torch's cast does)."""
    differ = got.view(torch.uint8) != expected.view(torch.uint8)
    assert not differ.any(), (f"{differ.sum()} codes differ: got {got[differ].float().tolist()[:8]}, "
                              f"expected {expected[differ].float().tolist()[:8]}")


# The cache's memory, V's as K's: tokens outside heads, or heads outside tokens (the engine's,
# executor/kv_cache.py: a block's head holds its tokens contiguously).
LAYOUTS = ["tokens_outer", "heads_outer"]


def fp8_cache(num_blocks: int, block_size: int, head_dim: int, fp8: torch.dtype,
              layout: str = "tokens_outer") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches holding random values quantized with KV_SCALES, laid out in memory as
    `layout` says (the same [num_blocks, block_size, heads, head_dim] views)."""
    kv = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, device=DEVICE)
    k, v = quantize(kv[0], scales()[0], fp8), quantize(kv[1], scales()[1], fp8)
    if layout == "heads_outer":  # [blocks, heads, tokens, dim] in memory
        k, v = (cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for cache in (k, v))
    return k, v


def dequantized(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize(k_cache, scales()[0], torch.float64), dequantize(v_cache, scales()[1], torch.float64)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_quantizes_and_saturates(fp8: torch.dtype, dtype: torch.dtype, layout: str) -> None:
    num_tokens, block_size, head_dim = 11, 16, 64
    _, key, value = fused_qkv_views(num_tokens, 4, NUM_KV_HEADS, head_dim, dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-6])  # beyond the range either way, zero, tiny
    k_cache, v_cache = fp8_cache(4, block_size, head_dim, fp8, layout)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(4 * block_size, device=DEVICE)[:num_tokens]
    slots[[2, 7]] = -1

    store_kvcache(key, value, k_cache, v_cache, slots, scales())

    kept = slots >= 0
    flat_k, flat_v = k_cache.reshape(-1, NUM_KV_HEADS, head_dim), v_cache.reshape(-1, NUM_KV_HEADS, head_dim)
    assert_same_codes(flat_k[slots[kept]], quantize(key[kept], scales()[0], fp8))
    assert_same_codes(flat_v[slots[kept]], quantize(value[kept], scales()[1], fp8))
    limit = torch.finfo(fp8).max
    assert flat_k[slots[0], 0, :2].float().tolist() == [limit, -limit]  # saturated, not NaN
    untouched = torch.ones(4 * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[kept]] = False
    for flat, before in ((flat_k, before_k), (flat_v, before_v)):
        assert torch.equal(flat[untouched].view(torch.uint8),
                           before.reshape(-1, NUM_KV_HEADS, head_dim)[untouched].view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_store_quantizes(fp8: torch.dtype, dtype: torch.dtype, layout: str) -> None:
    """The fused rotary-store kernel writes what the torch path (rotate, then quantize) does."""
    num_tokens, num_heads, head_dim, block_size = 9, 4, 64, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 100, (num_tokens,), device=DEVICE)
    slots = torch.randperm(4 * block_size, device=DEVICE)[:num_tokens]
    rope = RotaryEmbedding(head_dim, 128, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    k_cache, v_cache = fp8_cache(4, block_size, head_dim, fp8, layout)

    rotary_store(qkv, positions, rope.cos_sin_cache, k_cache, v_cache, slots, num_heads, kv_scales=scales())

    q, k, v = qkv.split([num_heads * head_dim, NUM_KV_HEADS * head_dim, NUM_KV_HEADS * head_dim], dim=-1)
    _, k = rope(positions, q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, NUM_KV_HEADS, head_dim))
    assert_same_codes(k_cache.reshape(-1, NUM_KV_HEADS, head_dim)[slots], quantize(k, scales()[0], fp8))
    v = v.reshape(num_tokens, NUM_KV_HEADS, head_dim)
    assert_same_codes(v_cache.reshape(-1, NUM_KV_HEADS, head_dim)[slots], quantize(v, scales()[1], fp8))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(2, 64, 16), (4, 128, 256)])
# None: decode_config's (a 16-bit cache's tile for the head size and query dtype, four
# warps, three stages); then two splits of 16-token tiles.
@pytest.mark.parametrize("config", [None, DecodeConfig(num_splits=2, block_n=16, num_warps=4, num_stages=3)],
                         ids=["auto", "splits2"])
@pytest.mark.parametrize("layout", LAYOUTS)  # heads_outer at 256-token blocks: K and V tiles by TMA
def test_decode_attention_reads_fp8(fp8: torch.dtype, dtype: torch.dtype, group: int, head_dim: int,
                                    block_size: int, config: DecodeConfig | None, layout: str) -> None:
    contexts = [17, 1, 0, 40, 32] if block_size == 16 else [1, 0, 261]
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in contexts], block_size)
    block_tables[contexts.index(0)] = -1
    k_cache, v_cache = fp8_cache(num_blocks, block_size, head_dim, fp8, layout)
    q, _, _ = fused_qkv_views(len(contexts), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)

    if config is not None:
        out = decode_attention_with_config(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, config,
                                           kv_scales=scales())
    else:
        out = decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, kv_scales=scales())

    keys, values = dequantized(k_cache, v_cache)
    for row, length in enumerate(contexts):
        if length == 0:
            assert (out[row] == 0).all()
            continue
        ref = reference_attention(q[row : row + 1], keys, values, block_tables[row], length, head_dim**-0.5)
        assert relative_error(out[row], ref[0]) <= REL_TOL[dtype], f"row {row} (context {length})"


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_decode_over_fp8_with_queries_beyond_float16(dtype: torch.dtype) -> None:
    """The kernel computes in float16 for 16-bit queries: larger |q| saturate there rather
    than turn into inf and NaN; float32 queries stay float32 and exact."""
    head_dim, block_size, contexts = 64, 16, [9, 30]
    block_tables, num_blocks = make_block_tables(contexts, block_size)
    k_cache, v_cache = fp8_cache(num_blocks, block_size, head_dim, torch.float8_e4m3fn)
    q = torch.randn(len(contexts), NUM_KV_HEADS * 2, head_dim, device=DEVICE).to(dtype) * 7e4
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    scale = 1e-6  # keeps the scores moderate
    out = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, kv_scales=scales())
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        keys, values = dequantized(k_cache, v_cache)
        for row, length in enumerate(contexts):
            ref = reference_attention(q[row : row + 1], keys, values, block_tables[row], length, scale)
            assert relative_error(out[row], ref[0]) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_prefill_over_fp8_with_queries_beyond_float16(dtype: torch.dtype) -> None:
    """Prefill attention over an FP8 cache computes in float16 for 16-bit queries too:
    larger |q| saturate rather than turn into inf and NaN."""
    lens_q, lens_k, head_dim, block_size = [3, 5], [9, 30], 64, 16
    block_tables, num_blocks = make_block_tables(lens_k, block_size)
    k_cache, v_cache = fp8_cache(num_blocks, block_size, head_dim, torch.float8_e4m3fn)
    q = torch.randn(sum(lens_q), NUM_KV_HEADS * 2, head_dim, device=DEVICE).to(dtype) * 7e4
    cu_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEVICE).cumsum(0).to(torch.int32)
    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, block_tables, max(lens_q), 1e-6, kv_scales=scales())
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        keys, values = dequantized(k_cache, v_cache)
        for seq, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
            begin = cu_q[seq].item()
            ref = reference_attention(q[begin : begin + len_q], keys, values, block_tables[seq], len_k, 1e-6)
            assert relative_error(out[begin : begin + len_q], ref) <= REL_TOL[dtype]


def test_scales_must_be_positive() -> None:
    """The kernels scale scores inside the softmax's exponent, after masking: a scale of
    zero or below is refused, the attention's and a checkpoint's KV-cache scale alike."""
    from nanovllm.layers.attention import load_kv_scale

    block_tables, num_blocks = make_block_tables([5], 16)
    k_cache, v_cache = fp8_cache(num_blocks, 16, 64, torch.float8_e4m3fn)
    q = torch.randn(1, NUM_KV_HEADS, 64, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="positive"):
        decode_attention(q, k_cache, v_cache, block_tables, lens, 0.0, kv_scales=scales())
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="positive"):
        prefill_attention(q.expand(5, -1, -1).contiguous(), k_cache, v_cache, cu, cu, block_tables, 5, -1.0,
                          kv_scales=scales())
    with pytest.raises(ValueError, match="positive"):
        load_kv_scale(torch.nn.Parameter(torch.ones(2)), torch.tensor(0.0), 0)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_attention_reads_fp8(fp8: torch.dtype, dtype: torch.dtype, layout: str) -> None:
    lens_q, lens_k = [1, 17, 23, 5], [33, 17, 40, 21]  # prefix hits, a fresh prompt, chunks
    group, head_dim, block_size = 2, 64, 16
    block_tables, num_blocks = make_block_tables(lens_k, block_size)
    k_cache, v_cache = fp8_cache(num_blocks, block_size, head_dim, fp8, layout)
    q, _, _ = fused_qkv_views(sum(lens_q), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    cu_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEVICE).cumsum(0).to(torch.int32)

    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, block_tables, max(lens_q), head_dim**-0.5,
                            kv_scales=scales())

    keys, values = dequantized(k_cache, v_cache)
    for seq, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
        begin = cu_q[seq].item()
        ref = reference_attention(q[begin : begin + len_q], keys, values, block_tables[seq], len_k, head_dim**-0.5)
        assert relative_error(out[begin : begin + len_q], ref) <= REL_TOL[dtype], f"sequence {seq}"


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "loads"])
def test_whole_tiles_of_the_engines_layout(block_size: int, tma: bool, monkeypatch) -> None:
    """The engine's head-major cache, contexts of whole 64-token tiles and partial ones: decode
    and prefill attention's unmasked tiles by TMA (256-token blocks) and by loads (TMA off, or
    tiles across 16-token blocks), against the float64 reference."""
    from nanovllm.kernels import decode_config as decode_config_module
    from nanovllm.kernels import prefill_attention as prefill_module

    monkeypatch.setattr(decode_config_module, "TMA_TILES", tma)
    monkeypatch.setattr(prefill_module, "TMA_TILES", tma)
    dtype, group, head_dim, scale = torch.float16, 2, 64, 64**-0.5
    contexts = [300, 128, 64, 1]
    block_tables, num_blocks = make_block_tables(contexts, block_size)
    k_cache, v_cache = fp8_cache(num_blocks, block_size, head_dim, torch.float8_e4m3fn, "heads_outer")
    keys, values = dequantized(k_cache, v_cache)
    q, _, _ = fused_qkv_views(len(contexts), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, kv_scales=scales())
    for row, length in enumerate(contexts):
        ref = reference_attention(q[row : row + 1], keys, values, block_tables[row], length, scale)
        assert relative_error(out[row], ref[0]) <= REL_TOL[dtype], f"decode row {row} (context {length})"
    lens_q = [200, 2, 64, 1]  # a fresh prompt, and chunks on cached prefixes: unmasked tiles below each
    q, _, _ = fused_qkv_views(sum(lens_q), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    cu_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *contexts], device=DEVICE).cumsum(0).to(torch.int32)
    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, block_tables, max(lens_q), scale, kv_scales=scales())
    for seq, (len_q, len_k) in enumerate(zip(lens_q, contexts)):
        begin = cu_q[seq].item()
        ref = reference_attention(q[begin : begin + len_q], keys, values, block_tables[seq], len_k, scale)
        assert relative_error(out[begin : begin + len_q], ref) <= REL_TOL[dtype], f"prefill sequence {seq}"


def test_fp8_cache_needs_scales() -> None:
    k_cache, v_cache = fp8_cache(2, 16, 64, torch.float8_e4m3fn)
    key = torch.randn(3, NUM_KV_HEADS, 64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scales"):
        store_kvcache(key, key, k_cache, v_cache, torch.arange(3, device=DEVICE))


def test_fp8_cache_gets_half_the_decode_programs() -> None:
    """Over an FP8 cache the launch aims for half the programs per SM, so each split
    streams longer, on the tiles of a 16-bit cache (tokens, warps, stages)."""
    shape = dict(batch=1, num_kv_heads=2, max_context=8192, head_dim=128, dtype=torch.bfloat16,
                 device=torch.device("cpu"))
    plain, fp8 = decode_config(**shape), decode_config(**shape, cache_dtype=torch.float8_e4m3fn)
    assert fp8.num_splits == plain.num_splits // 2 >= 1
    assert (fp8.block_n, fp8.num_stages) == (plain.block_n, plain.num_stages) and fp8.num_warps == 2
    assert decode_config(**shape, cache_dtype=torch.bfloat16) == plain


def test_fp8_cache_keeps_the_pipelined_tiles_at_every_batch(monkeypatch) -> None:
    """Fewer (row, KV head) pairs than SMs and from one pair per SM on, the programs over
    an FP8 cache take the bf16 cache's usual tile shape and pipeline, 64-token tiles and
    three stages, in two warps where bf16's take four (the 128-token tiles without a
    pipeline that an FP8 cache once took where the rows fill the SMs lost to them;
    RESULTS.md, sessions 41 and 43). The
    few rows' wider tiles are a 16-bit cache's alone (one request: bf16 128 tokens in eight
    warps, FP8 the usual ones)."""
    import nanovllm.kernels.decode_config as module

    monkeypatch.setattr(module, "num_sms", lambda device: 132)
    shape = dict(num_kv_heads=8, max_context=8192, head_dim=128, dtype=torch.bfloat16, device=torch.device("cuda"))
    for batch in (16, 17, 256):
        fp8 = decode_config(batch=batch, **shape, cache_dtype=torch.float8_e4m3fn)
        plain = decode_config(batch=batch, **shape)
        assert (fp8.block_n, fp8.num_stages) == (plain.block_n, plain.num_stages)
        assert (fp8.block_n, fp8.num_warps, fp8.num_stages) == (64, 2, 3)
        assert fp8.num_splits <= plain.num_splits
    one_request = decode_config(batch=1, **shape, cache_dtype=torch.float8_e4m3fn)
    assert (one_request.block_n, one_request.num_warps, one_request.num_stages) == (64, 2, 3)
    assert decode_config(batch=1, **shape).num_warps == 8


def test_few_rows_take_shorter_splits(monkeypatch) -> None:
    """Rows x KV heads up to a quarter of the SMs (one request at Qwen3's 8 KV heads) split
    in at least two tiles, more rows in MIN_SPLIT_RUN_TOKENS (whole tiles); over a 16-bit cache
    the few rows' tiles hold 128 tokens, in eight warps and two pipeline stages."""
    import nanovllm.kernels.decode_config as module

    monkeypatch.setattr(module, "num_sms", lambda device: 132)
    monkeypatch.setattr(module, "MIN_SPLIT_RUN_TOKENS", 512)  # the default, whatever the environment says
    shape = dict(num_kv_heads=8, max_context=4096, head_dim=128, dtype=torch.bfloat16, device=torch.device("cuda"))
    for batch in (1, 4):
        fp8 = decode_config(batch=batch, **shape, cache_dtype=torch.float8_e4m3fn)
        assert (fp8.block_n, fp8.min_split_tiles, fp8.num_warps) == (64, 2, 2)
        plain = decode_config(batch=batch, **shape)
        assert (plain.block_n, plain.min_split_tiles, plain.num_warps, plain.num_stages) == (128, 2, 8, 2)
    for cache, warps in ((None, 4), (torch.float8_e4m3fn, 2)):
        many = decode_config(batch=5, **shape, cache_dtype=cache)
        assert (many.block_n, many.min_split_tiles, many.num_warps, many.num_stages) == (64, 8, warps, 3)
    one_pair_per_sm = decode_config(batch=32, **shape, cache_dtype=torch.float8_e4m3fn)
    assert (one_pair_per_sm.block_n, one_pair_per_sm.min_split_tiles) == (64, 8)
    monkeypatch.setattr(module, "JOIN_TAIL", True)  # the default: short last splits join where rows fill the SMs
    assert not decode_config(batch=49, **shape).join_tail and decode_config(batch=50, **shape).join_tail
    monkeypatch.setattr(module, "MIN_SPLIT_RUN_TOKENS", 128)  # counted in the tiles the config uses
    for cache in (None, torch.float8_e4m3fn):
        config = decode_config(batch=1, **shape, cache_dtype=cache)
        assert config.min_split_tiles * config.block_n == 128
    monkeypatch.setattr(module, "MIN_SPLIT_RUN_TOKENS", 64)  # NANOVLLM_DECODE_MIN_SPLIT_TOKENS=64: never longer
    assert decode_config(batch=1, **shape, cache_dtype=torch.float8_e4m3fn).min_split_tiles == 1
    assert decode_config(batch=1, **shape).min_split_tiles == 1


def test_fp8_converts_in_assembly_only_on_a_gpu() -> None:
    """The paired conversion is PTX: never under the interpreter or on the CPU."""
    from nanovllm.kernels.fp8 import fp8_converts_in_asm

    assert not fp8_converts_in_asm(torch.device("cpu"))


@pytest.mark.parametrize("batch, cache", [(1, None), (4, torch.float8_e4m3fn), (8, None), (16, None), (32, None),
                                          (32, torch.float8_e4m3fn), (256, None)])
def test_every_launched_split_serves_a_full_length_row(monkeypatch, batch, cache) -> None:
    """The grid's split count never exceeds what a full-length row uses at run time (each
    split taking min_split_tiles tiles at least): a split no row can use would be a program
    that only exits. Where that caps the count, every row splits exactly as it would with
    the most splits launched."""
    import nanovllm.kernels.decode_config as module

    monkeypatch.setattr(module, "num_sms", lambda device: 132)
    monkeypatch.setattr(module, "MIN_SPLIT_RUN_TOKENS", 512)
    config = decode_config(batch=batch, num_kv_heads=8, max_context=4096, head_dim=128, dtype=torch.bfloat16,
                           device=torch.device("cuda"), cache_dtype=cache)

    def tiles_per_split(tiles: int, splits: int) -> int:  # decode_config.tiles_per_split
        if config.join_tail:
            used = max(min(tiles // config.min_split_tiles, splits), 1)
            return max(-(-tiles // used), 1)
        return max(-(-tiles // splits), config.min_split_tiles)

    full = 4096 // config.block_n
    assert -(-full // tiles_per_split(full, config.num_splits)) == config.num_splits
    if config.num_splits * config.min_split_tiles * config.block_n >= 4096:  # capped by what rows use
        for tiles in range(1, full + 1):
            assert tiles_per_split(tiles, config.num_splits) == tiles_per_split(tiles, module._MAX_SPLITS)


@pytest.mark.parametrize(("fp8", "poison"), [(torch.float8_e4m3fn, 0x7F), (torch.float8_e5m2, 0x7C)],
                         ids=["e4m3-nan", "e5m2-inf"])
def test_partial_tiles_ignore_what_lies_past_the_row(fp8, poison) -> None:
    """A row's last, partial tile of the engine's head-major cache holds a freed block's
    leftovers past the row: e4m3's NaN or e5m2's infinity there (0 * inf is NaN) must not
    reach the output. Triton's interpreter converts e4m3's NaN code to 480, so on CPU e5m2
    is the case that catches a missing mask."""
    dtype, group, head_dim, block_size, scale = torch.float16, 2, 64, 256, 64**-0.5
    contexts = [300, 70, 1, 129, 256]
    block_tables, num_blocks = make_block_tables(contexts, block_size)
    k_cache, v_cache = fp8_cache(num_blocks, block_size, head_dim, fp8, "heads_outer")
    unused = torch.zeros(k_cache.shape, dtype=torch.float32, device=DEVICE)
    poison_unused_slots(unused, unused, block_tables, contexts)
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8)[unused.isnan()] = poison
    keys, values = dequantized(k_cache, v_cache)
    q, _, _ = fused_qkv_views(len(contexts), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, kv_scales=scales())
    for row, length in enumerate(contexts):
        ref = reference_attention(q[row : row + 1], keys, values, block_tables[row], length, scale)
        assert relative_error(out[row], ref[0]) <= REL_TOL[dtype], f"row {row} (context {length})"
