"""The FP8 formats the engine stores: e4m3 for weights and activations and, by default, the
KV cache; e5m2 for a KV cache asked for it. Plain torch, so that the torch paths need no triton."""
import torch

from nanovllm.utils.env import env_flag

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype; 0.0 for any other (the kernels' FP8_MAX,
    which switches quantization off)."""
    return torch.finfo(dtype).max if is_fp8(dtype) else 0.0


# FP8 products on the tensor cores (cuBLAS's row-wise GEMM, channel_gemm, the wide tiles' FP8
# form) summed in the tensor cores' own accumulator over the whole of K, as vLLM's CUTLASS FP8
# kernels on Hopper sum (NANOVLLM_FP8_FAST_ACCUM=1, the default), or promoted to fp32 every
# PROMOTE_COLUMNS (0). Its error stays an order below the FP8 operands' own rounding, and the
# demo model's perplexity and Qwen3-8B's throughput were measured both ways (RESULTS.md,
# sessions 21 and 40). The variable is read once, at import; the kernels read this attribute
# at each launch, so a test may switch it.
FAST_ACCUM = env_flag("NANOVLLM_FP8_FAST_ACCUM", True)
PROMOTE_COLUMNS = 128


def fp8_promote(block_k: int) -> int:
    """max_num_imprecise_acc for a kernel's FP8 dot over K steps of block_k columns: the
    columns summed in the tensor cores' accumulator before each fp32 add, or 0 (FAST_ACCUM:
    never promoted, the dot's own accumulation)."""
    return 0 if FAST_ACCUM else min(PROMOTE_COLUMNS, block_k)


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (FP8 [rows, cols], fp32 scales [ceil(rows / block), ceil(cols / block)]):
    each [block, block] block divided by its largest |value| / FP8_MAX, as block-scaled FP8
    checkpoints store a weight (the scales are their `weight_scale_inv`)."""
    rows, cols = w.shape
    r, c = -(-rows // block), -(-cols // block)
    padded = w.new_zeros(r * block, c * block, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.view(r, block, c, block)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(r * block, c * block)
    return q[:rows, :cols].contiguous(), scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """quantize_blocks's inverse: q [rows, cols] times its block's scale (scales [ceil(rows /
    block), ceil(cols / block)]), computed in float32, in dtype."""
    rows, cols = q.shape
    expanded = scales.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (q.float() * expanded).to(dtype)
