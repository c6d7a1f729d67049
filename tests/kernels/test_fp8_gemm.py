"""The FP8 linear kernels (activation quantization and the scaled GEMM) against the torch
path of layers/quantization.py, on random inputs; under the Triton interpreter on CPU."""
import pytest
import torch
from test_kernels import DEVICE, GPU_ONLY

from nanovllm.kernels.activation import silu_and_mul
from nanovllm.kernels.decode_gemm import TileConfig, channel_gemm
from nanovllm.kernels.fp8 import quantize_activations, scaled_gemm
from nanovllm.kernels.rmsnorm import rms_norm
from nanovllm.layers.quantization import FP8_DTYPE, fp8_linear, quantize_per_group

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY),
]


# Relative error allowed in each output dtype. The interpreter's fp32 sums are exact to
# rounding; Hopper's FP8 tensor cores accumulate with fewer mantissa bits than fp32
# (about 1e-4 relative error seen on an H200).
TOLERANCE = {torch.float32: 1e-5 if DEVICE.type == "cpu" else 5e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scales.shape[1]
    return (q.double().unflatten(-1, (-1, group)) * scales.double()[..., None]).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "K", "group"), [(1, 128, 128), (7, 384, 128), (5, 96, 96), (3, 2048, 2048)])
@pytest.mark.parametrize("one_pass", [16384, 64], ids=["one_load", "two_passes"])
def test_quantize_activations_matches_torch(dtype, rows, K, group, one_pass, monkeypatch):
    """Groups held in one load and groups wider than that (read twice in chunks) alike."""
    from nanovllm.kernels import fp8

    monkeypatch.setattr(fp8, "_QUANT_ONE_PASS", one_pass)
    monkeypatch.setattr(fp8, "_QUANT_BLOCK", min(fp8._QUANT_BLOCK, one_pass))
    x = torch.randn(rows, K, dtype=dtype, device=DEVICE) * 3
    # zeros of both signs and tiny negatives rounding to -0 (torch keeps the sign; SiLU of a
    # large negative input is -0.0)
    x[0, :8] = torch.tensor([0.0, 1e-3, -50.0, 7.99, 1.99, -0.0, -1e-5, -3e-5])
    q, scales = quantize_activations(x, group)
    ref_q, ref_scales = quantize_per_group(x, group)
    assert q.dtype == FP8_DTYPE and scales.shape == (rows, K // group)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))  # IEEE division, the same rounding
    # Each group's largest |x| lands on 448, and dequantized x is within half an e4m3 step (2^-4).
    assert (q.float().abs().unflatten(-1, (-1, group)).amax(-1) == 448).all()
    rel = (dequantize(q, scales) - x.double()).abs() / x.double().abs().clamp(min=1e-2)
    assert rel.max() <= 2**-4 + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "N", "K", "group"), [(1, 64, 128, 128), (5, 200, 384, 128), (70, 128, 256, 128),
                                                    (3, 96, 96, 96), (17, 256, 640, 640)])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_scaled_gemm_matches_dequantized_matmul(dtype, M, N, K, group, bias):
    """Block scales (group 128) and per-channel scales (one group per row, any K)."""
    a, a_scales = quantize_per_group(torch.randn(M, K, device=DEVICE), group)
    w, w_scales = quantize_per_group(torch.randn(N, K, device=DEVICE) * 0.05, group)
    b = torch.randn(N, dtype=dtype, device=DEVICE) if bias else None
    out = scaled_gemm(a, a_scales, w, w_scales, b, dtype)
    ref = dequantize(a, a_scales) @ dequantize(w, w_scales).T + (b.double() if bias else 0)
    assert out.dtype == dtype and out.shape == (M, N)
    tol = TOLERANCE[dtype]
    assert ((out.double() - ref).norm() / ref.norm()).item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "N", "K"), [(1, 64, 128), (5, 200, 384), (33, 128, 640), (130, 96, 256)])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_channel_gemm_matches_dequantized_matmul(dtype, M, N, K, splits, bias):
    """Per-channel scales at decode batch sizes: partial tiles of tokens, channels and K,
    K cut into splits merged in the launch (three asked of K=256 become two, none empty)."""
    a, a_scales = quantize_per_group(torch.randn(M, K, device=DEVICE), K)
    w, w_scales = quantize_per_group(torch.randn(N, K, device=DEVICE) * 0.05, K)
    b = torch.randn(N, dtype=dtype, device=DEVICE) if bias else None
    config = TileConfig(block_n=64, block_t=min(64, max(16, 1 << (M - 1).bit_length())), block_k=64,
                               splits=splits, num_stages=2)
    out = channel_gemm(a, a_scales, w, w_scales, b, dtype, config)
    ref = dequantize(a, a_scales) @ dequantize(w, w_scales).T + (b.double() if bias else 0)
    assert out.dtype == dtype and out.shape == (M, N)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= TOLERANCE[dtype]
    again = channel_gemm(a, a_scales, w, w_scales, b, dtype, config)  # the split counters left at zero
    assert torch.equal(out, again)


def test_channel_gemm_takes_only_a_scale_per_token():
    """x's scales: contiguous [M, 1] only (the kernel reads one per token); a scale per group
    of columns, strided or flat scales are refused."""
    a, a_scales = quantize_per_group(torch.randn(5, 256, device=DEVICE), 256)
    w, w_scales = quantize_per_group(torch.randn(64, 256, device=DEVICE) * 0.05, 256)
    for scales in (quantize_per_group(a.float(), 128)[1], a_scales.repeat(1, 2)[:, :1], a_scales.view(-1)):
        with pytest.raises(ValueError, match=r"contiguous \[M, 1\]"):
            channel_gemm(a, scales, w, w_scales, None, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [None, 128], ids=["per_channel", "block128"])
def test_fp8_linear_kernels_equal_the_torch_path(dtype, group):
    """The layer's two paths compute the same thing: the kernels (interpreter on CPU; per-channel
    scales at this batch size through channel_gemm) and dequantize-and-multiply."""
    x = torch.randn(2, 3, 256, dtype=dtype, device=DEVICE)
    weight, scales = quantize_per_group(torch.randn(192, 256, device=DEVICE) * 0.05, group or 256)
    bias = torch.randn(192, dtype=dtype, device=DEVICE)
    fast = fp8_linear(x, weight, scales, bias, "triton")
    reference = fp8_linear(x, weight, scales, bias, "torch")
    assert fast.shape == (2, 3, 192) and fast.dtype == dtype
    tol = TOLERANCE[dtype]
    assert ((fast.double() - reference.double()).norm() / reference.double().norm()).item() <= tol


@pytest.mark.parametrize("fast", [pytest.param(False, id="promoted", marks=GPU_ONLY),
                                  pytest.param(True, id="fast", marks=GPU_ONLY)])
def test_cublas_rows_with_either_accumulation(fast, monkeypatch):
    """Rows past channel_gemm's go to cuBLAS's row-wise FP8 GEMM: with the products summed
    in the tensor cores' own accumulator over all of K (the default) or promoted to fp32
    (NANOVLLM_FP8_FAST_ACCUM=0), the dequantized product to bf16's rounding."""
    from nanovllm.layers import quantization
    from nanovllm.utils import fp8 as fp8_format

    monkeypatch.setattr(fp8_format, "FAST_ACCUM", fast)
    monkeypatch.setattr(quantization, "CHANNEL_GEMM_MAX_ROWS", 0)  # whatever NANOVLLM_FP8_CHANNEL_GEMM_MAX_ROWS says
    torch.manual_seed(1)
    x = torch.randn(300, 4096, dtype=torch.bfloat16, device=DEVICE)
    weight, scales = quantize_per_group(torch.randn(1024, 4096, device=DEVICE) * 0.02, 4096)
    out = fp8_linear(x, weight, scales, None, "triton")
    reference = fp8_linear(x, weight, scales, None, "torch")
    assert ((out.double() - reference.double()).norm() / reference.double().norm()).item() <= 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cublas_pads_gate_up_like_steps(monkeypatch):
    """NANOVLLM_FP8_CUBLAS_PAD_ROWS=256 (the default): cuBLAS takes a step of 129-192 rows
    against an output at least four times its input as 256 rows and the layer returns the
    first M (plus the bias), the dequantized product to bf16's rounding; 128, 193 and 256
    rows, and narrower outputs, go as they are."""
    from nanovllm.layers import quantization

    monkeypatch.setattr(quantization, "CUBLAS_PAD_ROWS", 256)
    monkeypatch.setattr(quantization, "CHANNEL_GEMM_MAX_ROWS", 0)
    calls, original = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, *args, **kwargs: calls.append(a.shape[0])
                        or original(a, *args, **kwargs))
    torch.manual_seed(2)
    wide = quantize_per_group(torch.randn(4096, 1024, device=DEVICE) * 0.03, 1024)
    narrow = quantize_per_group(torch.randn(3072, 1024, device=DEVICE) * 0.03, 1024)
    for rows, (weight, scales), taken in ((160, wide, 256), (192, wide, 256), (193, wide, 193), (128, wide, 128),
                                          (256, wide, 256), (160, narrow, 160)):
        calls.clear()
        x = torch.randn(rows, 1024, dtype=torch.bfloat16, device=DEVICE)
        bias = torch.randn(weight.shape[0], dtype=torch.bfloat16, device=DEVICE) if rows == 192 else None
        out = fp8_linear(x, weight, scales, bias, "triton")
        reference = fp8_linear(x, weight, scales, bias, "torch")
        assert calls == [taken] and out.shape == (rows, weight.shape[0]) and out.is_contiguous()
        assert ((out.double() - reference.double()).norm() / reference.double().norm()).item() <= 5e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("hidden", [64, 1000, 4000])
def test_rms_norm_quantized_equals_norm_then_quantizer(dtype, residual, hidden):
    """The norm's kernel quantizing what it writes (for an FP8 projection) gives bit for bit
    the norm's output put through quantize_activations, and the same residual. On CUDA in
    float32 the two kernels' compiles may round the norm's last bit apart (an H200 run
    found one such case; FMA contraction differs between them), so there the FP8 values
    may be one step apart."""
    weight = torch.randn(hidden, dtype=dtype, device=DEVICE) * 0.1 + 1
    x = torch.randn(6, hidden, dtype=dtype, device=DEVICE) * 3
    x[2] = 0  # an all-zero row keeps its floor scale
    r = torch.randn(6, hidden, dtype=dtype, device=DEVICE) if residual else None
    plain = rms_norm(x, weight, 1e-6, r)
    fused = rms_norm(x, weight, 1e-6, r, quantize=True)
    (out, res), ((q, scales), fused_res) = (plain, fused) if residual else ((plain, None), (fused, None))
    ref_q, ref_scales = quantize_activations(out, hidden)
    assert q.dtype == FP8_DTYPE and scales.shape == (6, 1)
    assert res is None or torch.equal(fused_res, res)
    if dtype == torch.float32 and DEVICE.type == "cuda":
        torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
        assert ((q.float() - ref_q.float()).abs() <= torch.maximum(q.float().abs(), ref_q.float().abs()) * 2**-3
                + 2**-9).all()
    else:
        assert torch.equal(scales, ref_scales) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 1500])
@pytest.mark.parametrize("blocked_rows", [256, 0], ids=["blocks", "row_programs"])
def test_silu_and_mul_quantized_equals_silu_and_mul_then_quantizer(dtype, width, blocked_rows, monkeypatch):
    """SiLU-and-mul's kernels quantizing what they write (for an FP8 down_proj; both forms:
    over column blocks, and a row a program past _BLOCKED_ROWS) give bit for bit the plain
    output put through quantize_activations, on rows wider than they are used."""
    from nanovllm.kernels import activation

    monkeypatch.setattr(activation, "_BLOCKED_ROWS", blocked_rows)
    x = (torch.randn(5, 2 * width + 8, dtype=dtype, device=DEVICE) * 3)[:, : 2 * width]
    x[3] = 0  # an all-zero row keeps its floor scale
    q, scales = silu_and_mul(x, quantize=True)
    ref_q, ref_scales = quantize_activations(silu_and_mul(x), width)
    assert q.dtype == FP8_DTYPE and scales.shape == (5, 1)
    assert torch.equal(scales, ref_scales) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_silu_and_mul_quantizes_a_row_over_many_blocks(monkeypatch):
    """A row over five column blocks (the last ragged; the blocks' maxima read through a
    power-of-two mask), and rows wider than a program holds taking the blocks whatever their
    count: bit for bit the plain output put through quantize_activations."""
    from nanovllm.kernels import activation

    monkeypatch.setattr(activation, "_QUANTIZED_BLOCK", 64)
    monkeypatch.setattr(activation, "_MAX_ROW_PROGRAM", 256)  # a row this wide takes the blocks at any row count
    monkeypatch.setattr(activation, "_BLOCKED_ROWS", 0)
    x = torch.randn(3, 2 * 300, device=DEVICE) * 3
    x[1, :300] = 0  # an all-zero row keeps its floor scale
    q, scales = silu_and_mul(x, quantize=True)
    ref_q, ref_scales = quantize_activations(silu_and_mul(x), 300)
    assert torch.equal(scales, ref_scales) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("tokens", [1, 16, 64, 128, 256])
def test_channel_gemm_tiles_fit_the_gpus_shared_memory(tokens):
    """Six K steps in flight on an H200; fewer where a block's shared memory is smaller (an
    Ada GPU's 101,376 bytes), never under two. The splits fill the SMs."""
    from nanovllm.kernels.decode_gemm import tile_config

    h200 = tile_config(tokens, 4096, 4096, 1, 132)
    assert h200.num_stages == 6 and h200.block_t == min(128, max(16, tokens))
    ada = tile_config(tokens, 4096, 4096, 1, 142, 101_376)
    assert 2 <= ada.num_stages and (ada.block_n + ada.block_t) * ada.block_k * ada.num_stages <= 101_376
    tiles = 4096 // h200.block_n * -(-tokens // h200.block_t)
    assert h200.splits == max(1, min(132 // tiles, 4096 // 128 // 4))
