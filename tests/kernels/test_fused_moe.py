"""The fused MoE kernels (nanovllm/kernels/fused_moe.py) against the one-expert-at-a-time
torch path, on random inputs. Without CUDA they run under the Triton interpreter (float32
and float16); with CUDA also in bfloat16, at Qwen3-30B-A3B's expert shapes, and replayed
from a CUDA graph."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.kernels.fused_moe import (FP8_MOE_CONFIGS, MOE_CONFIGS, align_pairs, fit_shared_memory, fused_moe,
                                        max_blocks, moe_config)
from nanovllm.layers.fused_moe import quantize_experts, route, torch_moe

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY),
]
# ||out - ref|| / ||ref||, the reference in float32.
REL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# FP8 experts with FP8 inputs in a 16-bit dtype, against the torch path in float32.
FP8_INPUT_TOL = 3e-2
# FP8 products on the tensor cores against the torch path in float32 (3.6e-3 on an H100).
FP8_TENSOR_CORE_TOL = 1e-2


def make_inputs(tokens, experts, top_k, hidden, inter, dtype, seed=0, no_expert=0.0):
    """x, w13, w2 and a routing; a share `no_expert` of the pairs goes to no expert (id = experts)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=DEVICE) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=DEVICE) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g, device=DEVICE)
    weights, ids = route(logits, top_k, renormalize=True)
    if no_expert:
        drop = torch.rand(ids.shape, generator=g, device=DEVICE) < no_expert
        ids = torch.where(drop, experts, ids)
    return x, w13, w2, weights, ids


def reference(x, w13, w2, weights, ids):
    return torch_moe(x.float(), w13.float(), w2.float(), weights, ids)


def assert_close(out, ref, dtype, tolerance=None):
    """||out - ref|| / ||ref|| below `tolerance` (default: dtype's REL_TOL)."""
    assert out.dtype == dtype and out.shape == ref.shape
    rel = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert rel < (tolerance or REL_TOL[dtype]), rel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 64, 32),     # decode of one sequence: most experts get nothing
    (5, 4, 4, 32, 48),     # every expert chosen by every token; inter not a tile multiple
    (40, 16, 2, 64, 32),
    (70, 8, 8, 48, 16),    # top_k == experts
])
def test_fused_moe_matches_torch(dtype, tokens, experts, top_k, hidden, inter):
    inputs = make_inputs(tokens, experts, top_k, hidden, inter, dtype)
    assert_close(fused_moe(*inputs), reference(*inputs), dtype)


@pytest.mark.parametrize("config", [config for _, config in MOE_CONFIGS], ids=str)
def test_every_config_of_the_table_matches_torch(config):
    """Each tile shape of MOE_CONFIGS on a case its tiles do not divide (float32)."""
    inputs = make_inputs(37, 8, 2, 72, 40, torch.float32, seed=4)
    assert_close(fused_moe(*inputs, config=config), reference(*inputs), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_for_no_expert_add_nothing(dtype):
    """Expert parallelism marks the pairs routed to another rank's experts with id = experts;
    a token with all its pairs so marked gets zeros."""
    x, w13, w2, weights, ids = make_inputs(24, 8, 2, 32, 32, dtype, seed=1, no_expert=0.4)
    ids[3] = 8
    out = fused_moe(x, w13, w2, weights, ids)
    assert_close(out, reference(x, w13, w2, weights, ids), dtype)
    assert not out[3].any()


def with_fp8_experts(inputs, block):
    """inputs with FP8 experts (block scales), their scales, and the same experts dequantized."""
    x, w13, w2, weights, ids = inputs
    q13, q2, scales = quantize_experts(w13, w2, block)
    dequantized = [torch.stack([scales.dequantized(q13, q2, e, torch.float32)[part] for e in range(w13.shape[0])])
                   for part in (0, 1)]
    return (x, q13, q2, weights, ids), scales, (x, *dequantized, weights, ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,block,config", [
    (1, 8, 2, 64, 32, 32, None),      # decode of one sequence, two blocks of K each way: FP8 products
    (1, 8, 2, 64, 32, 16, None),      # blocks narrower than an FP8 product's K: inputs stay in their dtype
    (40, 16, 2, 64, 48, 32, None),    # inter not a multiple of the block: up's blocks start on a fresh one, and
                                      # the down GEMM's input stays in its dtype
    (70, 8, 8, 48, 16, 128, None),    # one partial block each way: no FP8 inputs
    (33, 4, 2, 256, 128, 128, (16, 32, 32, 4, 2)),  # K tiles of a quarter of a block
])
def test_fp8_experts_match_the_torch_path(dtype, tokens, experts, top_k, hidden, inter, block, config):
    """FP8 experts with block scales (quantize_experts, as quantization="fp8" makes them): the
    kernels against the torch path's FP8 form (inputs quantized where the blocks divide them,
    weights dequantized per expert), and that against the dequantized weights with unquantized
    inputs, within the inputs' FP8 rounding."""
    plain = make_inputs(tokens, experts, top_k, hidden, inter, dtype, seed=6)
    inputs, scales, dequantized = with_fp8_experts(plain, block)
    assert inputs[1].dtype == inputs[2].dtype == torch.float8_e4m3fn
    x, *rest = inputs
    ref = torch_moe(x.float(), *rest, scales=scales)
    out = fused_moe(*inputs, scales=scales, config=config)
    if dtype == torch.float32 or not scales.quantizes_inputs(hidden):
        assert_close(out, ref, dtype)
    else:  # the down GEMM's input, rounded to dtype first, can land on the other side of an FP8 step
        assert_close(out, ref, dtype, FP8_INPUT_TOL)
    exact = reference(*dequantized)
    rel = ((ref - exact).norm() / exact.norm()).item()
    assert rel < (0.05 if scales.quantizes_inputs(hidden) else 1e-5), rel


@pytest.mark.parametrize("config", [config for _, config in FP8_MOE_CONFIGS], ids=str)
def test_every_fp8_config_of_the_table_matches_the_torch_path(config):
    """Each tile shape of FP8_MOE_CONFIGS over FP8 experts with FP8 inputs (float32 outputs).
    On CUDA, tiles of 64 rows or more multiply on the FP8 tensor cores, whose sums keep fewer
    bits than fp32 (as the linear layers' FP8 GEMMs), and a gate_up result they move can
    round to the other side of an FP8 step as the down GEMM's input."""
    inputs, scales, _ = with_fp8_experts(make_inputs(37, 8, 2, 256, 128, torch.float32, seed=8), 128)
    x, *rest = inputs
    tolerance = FP8_TENSOR_CORE_TOL if DEVICE.type == "cuda" and config.block_m >= 64 else None
    assert_close(fused_moe(*inputs, config=config, scales=scales), torch_moe(x, *rest, scales=scales), torch.float32,
                 tolerance)


def test_fp8_experts_are_block_quantized_exactly():
    """Each expert's gate, up and down weight on its own grid of blocks: every dequantized
    block within FP8's rounding of the weight, and a block's largest value exact."""
    _, w13, w2, _, _ = make_inputs(1, 3, 1, 40, 24, torch.float32, seed=7)
    q13, q2, scales = quantize_experts(w13, w2, 16)
    assert scales.w13.shape == (3, 2 * 2, 3) and scales.w2.shape == (3, 3, 2)
    for e in range(3):
        for got, want in zip(scales.dequantized(q13, q2, e, torch.float32), (w13[e], w2[e])):
            assert torch.allclose(got, want, rtol=2**-4, atol=1e-6)
            assert torch.isclose(got.abs().max(), want.abs().max(), rtol=1e-6)


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_pairs_puts_each_expert_in_whole_blocks(block_m):
    experts, top_k = 6, 3
    _, _, _, _, ids = make_inputs(50, experts, top_k, 16, 16, torch.float32, seed=2, no_expert=0.1)
    sorted_pairs, block_expert = align_pairs(ids, experts, block_m)
    flat = ids.flatten().cpu()
    num_pairs = flat.numel()
    assert sorted_pairs.numel() == block_expert.numel() * block_m == max_blocks(num_pairs, experts, block_m) * block_m
    blocks = sorted_pairs.cpu().view(-1, block_m)
    seen = []
    for block, expert in zip(blocks.tolist(), block_expert.cpu().tolist()):
        real = [p for p in block if p < num_pairs]
        if expert < 0:
            assert not real  # past the last expert's blocks: padding only
            continue
        assert real and all(flat[p] == expert for p in real)
        seen += real
    assert sorted(seen) == [p for p in range(num_pairs) if flat[p] < experts]  # each routed pair once
    assert block_expert.cpu().tolist() == sorted(block_expert.cpu().tolist(), key=lambda e: (e < 0, e))


@pytest.mark.parametrize("element_size,gated", [(2, True), (4, True), (4, False)])
def test_every_config_fits_shared_memory(element_size, gated):
    for _, config in MOE_CONFIGS:
        block_m, block_n, block_k, _, stages = fit_shared_memory(config, element_size, gated)
        assert stages * (block_m + (1 + gated) * block_n) * block_k * element_size <= 220 * 1024
        assert block_k >= 16 and stages >= 2
    assert fit_shared_memory((128, 128, 64, 8, 3), 2, True) == (128, 128, 64, 8, 3)  # bf16 keeps the table's


@pytest.mark.parametrize("fp8", [False, True])
def test_config_table_is_ordered_and_covers_every_size(fp8):
    bounds = [bound for bound, _ in (FP8_MOE_CONFIGS if fp8 else MOE_CONFIGS)]
    assert bounds == sorted(bounds)
    for tokens in (1, 33, 4096, 10**6):
        block_m, block_n, block_k, *_ = moe_config(tokens, fp8)
        assert block_m >= 16 and block_n >= 16 and block_k >= (32 if fp8 else 16)  # tl.dot's smallest tile


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 256, 2048])
def test_fused_moe_cuda_at_qwen3_30b_shapes_and_every_config(tokens):
    """bf16 at Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden 2048, inter 768),
    with the table's config for the size and with every other config of the table."""
    inputs = make_inputs(tokens, 128, 8, 2048, 768, torch.bfloat16, seed=tokens)
    ref = reference(*inputs)
    for _, config in MOE_CONFIGS:
        assert_close(fused_moe(*inputs, config=config), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 256, 2048])
def test_fp8_experts_cuda_at_qwen3_30b_shapes(tokens):
    """FP8 experts with 128-wide blocks (Qwen3-30B-A3B-FP8's) in bf16, every config of their table."""
    inputs, scales, _ = with_fp8_experts(make_inputs(tokens, 128, 8, 2048, 768, torch.bfloat16, seed=tokens), 128)
    x, *rest = inputs
    ref = torch_moe(x.float(), *rest, scales=scales)
    for _, config in FP8_MOE_CONFIGS:
        out = fused_moe(*inputs, config=config, scales=scales)
        assert_close(out, ref, torch.bfloat16, FP8_INPUT_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fused_moe_replays_from_a_cuda_graph():
    x, w13, w2, weights, ids = make_inputs(48, 16, 4, 256, 128, torch.bfloat16, seed=3)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (4, 5):  # new tokens and a new routing, written in place
        new = make_inputs(48, 16, 4, 256, 128, torch.bfloat16, seed=seed)
        for buffer, value in zip((x, w13, w2, weights, ids), new):
            buffer.copy_(value)
        graph.replay()
        assert_close(out, reference(x, w13, w2, weights, ids), torch.bfloat16)
