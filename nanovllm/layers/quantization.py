"""FP8 weights for the linear layers (quantization="fp8", or an FP8 checkpoint).

Two sources, one layout (kernels/fp8.py): an FP8 weight [out, in] with fp32 scales per
output row and input group, w_scale [out, in // group_k].

  - Online: a bf16/fp32 checkpoint is loaded as usual, then each layer's weight is
    quantized with one scale per output channel (group_k = in): quantize_after_loading.
  - Block-scaled checkpoints (Qwen3's -FP8 releases): `quantization_config` with
    quant_method "fp8" and weight_block_size [128, 128]; the layer is made FP8 from the
    start and the loader fills `weight` (float8_e4m3fn) and `weight_scale` from
    `*.weight_scale_inv` ([out / 128, in / 128], the factor that dequantizes), repeated over
    each block's rows so that fused layers (q|k|v, gate|up) and tensor-parallel slices
    cut the scales exactly where they cut the weight.

Activations are quantized per token (and per input group) as they arrive. Embeddings,
norms, the LM head and an MoE router stay in the model's dtype (an FP8 checkpoint's router is
dequantized as it loads: utils/loader.py). MoE experts take FP8 weights with block scales
(layers/fused_moe.py's ExpertScales), their inputs quantized by the fused MoE kernel.
Repeating the block scales over their rows costs 4 bytes per 128 weights (3% of the FP8
weight bytes) and buys one layout for both sources and every fusion and slicing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanovllm.utils.build_setting import BuildSetting
from nanovllm.utils.env import env_int
from nanovllm.utils import fp8 as fp8_format
from nanovllm.utils.fp8 import FP8_DTYPE, FP8_MAX


# Per-channel layers send decode batches of up to this many tokens to kernels/decode_gemm.py's
# channel_gemm where channel_gemm_wins (at 65-128 tokens not where cuBLAS's tiles already
# fill the SMs), larger ones to cuBLAS, whose 128 x 128 tiles win from 256 tokens on
# (RESULTS.md, session 20). NANOVLLM_FP8_CHANNEL_GEMM_MAX_ROWS=0: never channel_gemm. Steps
# that kernels/wide_gemm.py's FP8 form takes (NANOVLLM_FP8_WIDE_ROWS, the weight's shape) go
# there first.
CHANNEL_GEMM_MAX_ROWS = env_int("NANOVLLM_FP8_CHANNEL_GEMM_MAX_ROWS", 128, least=0)
# cuBLAS's row-wise FP8 GEMM picks slower tiles for 129-192 rows than for 256 where the
# output is at least four times the input (N >= 4 K: Qwen3-8B's gate_up; from 224 rows its
# own are faster; RESULTS.md, session 41). Such a step of more than P / 2 and at most 3 P / 4
# rows goes to cuBLAS as P = NANOVLLM_FP8_CUBLAS_PAD_ROWS rows (the rest never read back);
# 0: never padded.
CUBLAS_PAD_ROWS = env_int("NANOVLLM_FP8_CUBLAS_PAD_ROWS", 256, least=0)


@dataclass(frozen=True)
class Fp8Options:
    # A checkpoint's block size ([block, block] weight blocks); None: quantize online, per channel.
    block: int | None = None
    # "triton": the kernels of kernels/fp8.py (CUDA, or the interpreter on CPU); "torch":
    # dequantize and matmul (CPU).
    kernel: str = "torch"


FP8_WEIGHTS: BuildSetting[Fp8Options | None] = BuildSetting(None)
use_fp8 = FP8_WEIGHTS.use  # linear layers built inside take FP8 weights (None: none do)


class QuantizedInput(NamedTuple):
    """A per-channel FP8 layer's input, already quantized per token by the kernel before
    it (an RMSNorm's or SiLU-and-mul's: layers/layernorm.py, layers/activation.py), as
    fp8_linear would quantize it."""

    q: torch.Tensor  # [M, K] FP8
    scales: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the layer's output's (the model's dtype)


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (FP8 [rows, K], fp32 scales [rows, K // group]): each group of a row
    divided by its largest |value| / FP8_MAX (the torch counterpart of the Triton kernel)."""
    groups = x.float().unflatten(-1, (-1, group))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    # A tensor divisor: on CUDA torch multiplies by a Python number's reciprocal instead,
    # which can differ from IEEE division (the kernels') in the last bit.
    scales = amax / torch.full_like(amax, FP8_MAX)
    return (groups / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(-2), scales.squeeze(-1)


def dequantize_per_group(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """quantize_per_group's inverse, in float32: q [rows, K] times its group's scale."""
    group = q.shape[-1] // scales.shape[-1]
    return (q.float().unflatten(-1, (-1, group)) * scales[..., None]).flatten(-2)


def decode_route(rows: int, weight: torch.Tensor, wide_plan=None) -> str | None:
    """The kernel that multiplies `rows` rows by a per-channel FP8 weight (with its wide_plan),
    where a decode GEMM does: "wide" (kernels/wide_gemm.py's FP8 form, asked first: where the
    plan has tiles for the rows), "channel" (channel_gemm: up to CHANNEL_GEMM_MAX_ROWS where
    channel_gemm_wins), or None (fp8_linear's cuBLAS or scaled_gemm)."""
    from nanovllm.kernels.decode_gemm import channel_gemm_wins

    if wide_plan is not None and wide_plan.tiles(rows) is not None:
        return "wide"
    if rows <= CHANNEL_GEMM_MAX_ROWS and channel_gemm_wins(rows, weight.shape[0], weight.device):
        return "channel"
    return None


def fp8_linear(x: torch.Tensor | QuantizedInput, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, kernel: str, wide_plan=None) -> torch.Tensor:
    """y = x W^T (+ b) with W = weight * weight_scale (per row and input group) and x
    quantized per token and group on the way in (a QuantizedInput: already, on the kernels).
    wide_plan: the weight's kernels/wide_gemm.py fp8_plan, for the steps it takes."""
    if isinstance(x, QuantizedInput):
        q, scales, dtype = x
        shape = q.shape[:-1]
    else:
        shape, dtype = x.shape[:-1], x.dtype
        x, group = x.reshape(-1, x.shape[-1]), weight.shape[1] // weight_scale.shape[1]
        if kernel == "torch":
            q, scales = quantize_per_group(x, group)
        else:
            from nanovllm.kernels.fp8 import quantize_activations

            q, scales = quantize_activations(x, group)
    if kernel == "torch":  # dequantize both and multiply: what the kernels compute, slowly
        x_deq, w_deq = dequantize_per_group(q, scales), dequantize_per_group(weight, weight_scale)
        return F.linear(x_deq, w_deq, None if bias is None else bias.float()).to(dtype).view(*shape, -1)
    from nanovllm.kernels.decode_gemm import channel_gemm
    from nanovllm.kernels.fp8 import scaled_gemm
    from nanovllm.kernels.wide_gemm import fp8_wide_gemm

    (M, K), N = q.shape, weight.shape[0]
    per_channel = weight_scale.shape[1] == 1
    route = decode_route(M, weight, wide_plan) if per_channel else None
    if route == "wide":
        y = fp8_wide_gemm(q, scales, weight, weight_scale, bias, dtype, wide_plan)
    elif route == "channel":
        y = channel_gemm(q, scales, weight, weight_scale, bias, dtype)
    elif per_channel and q.is_cuda and dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0:
        # cuBLAS's row-wise scaled FP8 GEMM (its shapes: K and N multiples of 16)
        if CUBLAS_PAD_ROWS // 2 < M <= CUBLAS_PAD_ROWS * 3 // 4 and N >= 4 * K:
            q, scales = _padded(q, CUBLAS_PAD_ROWS), _padded(scales, CUBLAS_PAD_ROWS)
        y = torch._scaled_mm(q, weight.t(), scale_a=scales, scale_b=weight_scale.view(1, -1), out_dtype=dtype,
                             use_fast_accum=fp8_format.FAST_ACCUM)[:M]
        if bias is not None:
            y += bias
    else:
        y = scaled_gemm(q, scales, weight, weight_scale, bias, dtype)
    return y.view(*shape, -1)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [M, ...] as the first M of `rows` rows; the others are left as allocated (their
    products are never read)."""
    out = x.new_empty(rows, *x.shape[1:])
    out[: x.shape[0]].copy_(x)
    return out
