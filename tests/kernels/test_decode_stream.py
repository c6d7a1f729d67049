"""Decode attention as one balanced stream of tiles (kernels/decode_stream.py) against the
float64 reference: items cut between programs at every place, padding rows, FP8 caches in
both V layouts, and slots outside every context holding NaN."""
import pytest
import torch
from test_kernels import (
    DEVICE,
    GPU_ONLY,
    NUM_KV_HEADS,
    REL_TOL,
    fused_qkv_views,
    make_block_tables,
    new_decode_step,
    poison_unused_slots,
    reference_attention,
    relative_error,
    v_transposed_layout,
)

from nanovllm.kernels.decode_stream import decode_attention_stream, stream_usable, stream_work
from nanovllm.kernels.paged import v_transposed

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)]
KV_SCALES = (0.5, 2.0)
CONTEXTS = [17, 1, 0, 100, 64, 70, 33]  # partial tiles, one token, padding, several blocks, whole tiles


def head_major_cache(num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype,
                     layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's memory: K and V head-major ([blocks, heads, tokens, dim]), or for an FP8
    cache V transposed ("v_transposed"); both seen as [blocks, tokens, heads, dim]."""
    kv = torch.randn(2, num_blocks, NUM_KV_HEADS, block_size, head_dim, device=DEVICE)
    kv = (kv * 4).to(dtype).transpose(2, 3)
    k, v = kv[0], kv[1]
    if layout == "v_transposed":
        k, v = v_transposed_layout(k, v)
        assert v_transposed(k, v)
    return k, v


def dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.to(torch.float64) * scale


CACHES = [pytest.param(None, "head_major", id="16bit"),
          pytest.param(torch.float8_e4m3fn, "head_major", id="e4m3"),
          pytest.param(torch.float8_e4m3fn, "v_transposed", id="e4m3-vt"),
          pytest.param(torch.float8_e5m2, "v_transposed", id="e5m2-vt")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("cache_dtype", "layout"), CACHES)
@pytest.mark.parametrize("programs", [1, 3, 7, 200])  # one range, items cut in every way, more programs than tiles
def test_stream_matches_the_reference(dtype: torch.dtype, cache_dtype, layout: str, programs: int) -> None:
    if dtype == torch.float32 and cache_dtype is None:
        pytest.skip("float32 queries read an FP8 cache only (no TMA tiles of a float32 one)")
    group, head_dim, block_size, block_n = 2, 64, 32, 16
    block_tables, num_blocks = make_block_tables([max(n, 1) for n in CONTEXTS], block_size)
    block_tables[CONTEXTS.index(0)] = -1
    k_cache, v_cache = head_major_cache(num_blocks, block_size, head_dim, cache_dtype or dtype, layout)
    kv_scales = torch.tensor(KV_SCALES, device=DEVICE) if cache_dtype else None
    if cache_dtype is None:
        poison_unused_slots(k_cache, v_cache, block_tables, CONTEXTS)
    else:  # NaN codes in every slot outside the contexts
        poisoned = torch.zeros_like(k_cache, dtype=torch.float32)
        poison_unused_slots(poisoned, poisoned, block_tables, CONTEXTS)
        for cache in (k_cache, v_cache):
            cache.view(torch.uint8)[poisoned.isnan()] = 0x7F  # a NaN code in e4m3 and e5m2
    q, _, _ = fused_qkv_views(len(CONTEXTS), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, dtype)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32, device=DEVICE)
    out = decode_attention_stream(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, kv_scales=kv_scales,
                                  programs=programs, block_n=block_n)
    keys, values = k_cache, v_cache
    if cache_dtype is not None:
        keys, values = dequantized(k_cache, KV_SCALES[0]), dequantized(v_cache, KV_SCALES[1])
    for row, length in enumerate(CONTEXTS):
        if length == 0:
            assert (out[row] == 0).all()
            continue
        ref = reference_attention(q[row : row + 1], keys, values, block_tables[row], length, head_dim**-0.5)
        assert relative_error(out[row], ref[0]) <= REL_TOL[dtype], f"row {row} (context {length})"


def test_work_list_lays_the_items_tiles_end_to_end() -> None:
    block_size, block_n, heads = 32, 16, 3
    block_tables, _ = make_block_tables([max(n, 1) for n in CONTEXTS], block_size)
    block_tables[CONTEXTS.index(0)] = -1
    lens = torch.tensor(CONTEXTS, dtype=torch.int32, device=DEVICE)
    work = stream_work(lens, block_tables, heads, block_size, block_n)
    expected = []
    for row, length in enumerate(CONTEXTS):
        for head in range(heads):
            for start in range(0, max(length, 1), block_n):
                block = max(block_tables[row, start // block_size].item(), 0)
                expected.append([block, row * heads + head, start, min(max(length - start, 0), block_n)])
    assert work.total.item() == len(expected)
    assert work.tiles[: len(expected)].tolist() == expected


def test_stream_serves_only_what_it_can(monkeypatch) -> None:
    from nanovllm.kernels import decode_stream

    monkeypatch.setattr(decode_stream, "STREAM", True)
    k, v = head_major_cache(4, 256, 128, torch.float16, "head_major")
    q = torch.randn(2, 4, 128, dtype=torch.float16, device=DEVICE)
    assert stream_usable(q, k, v)
    assert not stream_usable(q.float(), k.float(), v.float())  # a float32 cache: no TMA tiles
    outer = torch.randn(2, 4, 256, NUM_KV_HEADS, 128, dtype=torch.float16, device=DEVICE)
    assert not stream_usable(q, outer[0], outer[1])  # tokens outside heads: a tile is not one range
    monkeypatch.setattr(decode_stream, "STREAM", False)
    assert not stream_usable(q, k, v)
    with pytest.raises(ValueError, match="no TMA tiles"):
        decode_attention_stream(q.float(), k.float(), v.float(), torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
                                torch.ones(2, dtype=torch.int32, device=DEVICE), 0.1)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["16bit", "e4m3"])
def test_stream_replays_in_a_cuda_graph_and_merges_without_races(dtype: torch.dtype, cache_dtype) -> None:
    """The work list and the kernel captured together, then context_lens and block_tables
    rewritten in place and replayed: equal to eager, bit for bit, launch after launch (a
    merge that read a piece before it was stored would not be), and to the reference."""
    batch, group, head_dim, block_size, max_blocks = 24, 4, 128, 256, 8
    k_cache, v_cache = head_major_cache(batch * max_blocks + 8, block_size, head_dim, cache_dtype or dtype,
                                        "v_transposed" if cache_dtype else "head_major")
    kv_scales = torch.tensor(KV_SCALES, device=DEVICE) if cache_dtype else None
    q = torch.randn(batch, NUM_KV_HEADS * group, head_dim, dtype=dtype, device=DEVICE)
    out = torch.empty_like(q)
    lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32, device=DEVICE)
    block_tables[:, 0] = torch.arange(batch, dtype=torch.int32, device=DEVICE)

    def run() -> None:
        work = stream_work(lens, block_tables, NUM_KV_HEADS, block_size, 64)
        decode_attention_stream(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, out, kv_scales, work,
                                programs=50)

    run()  # compile and allocate the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    keys, values = k_cache, v_cache
    if cache_dtype is not None:
        keys, values = dequantized(k_cache, KV_SCALES[0]), dequantized(v_cache, KV_SCALES[1])
    for _ in range(2):
        contexts = new_decode_step(lens, block_tables, block_size, q, out)
        graph.replay()
        replayed = out.clone()
        for _ in range(50):
            run()
            assert torch.equal(replayed, out), "a launch differs from the graph's replay"
        assert (replayed[-1] == 0).all()
        for row, length in enumerate(contexts[:-1]):
            ref = reference_attention(q[row : row + 1], keys, values, block_tables[row], length, head_dim**-0.5)
            assert relative_error(replayed[row], ref[0]) <= REL_TOL[dtype]
