"""The FP8 formats the engine stores: e4m3 for weights and activations and, by default, the
KV cache; e5m2 for a KV cache asked for it. Plain torch, so that the torch paths need no triton."""
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype; 0.0 for any other (the kernels' FP8_MAX,
    which switches quantization off)."""
    return torch.finfo(dtype).max if is_fp8(dtype) else 0.0
