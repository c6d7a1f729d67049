"""RMSNorm (with the residual add) as a PDL-aware kernel: it lets the projection after it
start at once (whose weights then stream in while it runs) and waits for the kernel before
it only to read x. Rounded as layers/layernorm.py's torch path rounds. One program per row.
Where the Triton kernels run it takes every batch (layers/kernel_plan.py).

    out = rms_norm(x, weight, eps)                          x [M, H]
    out, residual = rms_norm(x, weight, eps, residual)      x + residual, then the norm
    (q, scales), residual = rms_norm(x, weight, eps, residual, quantize=True)
    out, residual = rms_norm(split_sum, weight, eps, residual)   a projection's SplitSum as x

With quantize the output is what kernels/fp8.py's quantize_activations makes of it, per
token (q [M, H] FP8, scales [M, 1]), for an FP8 projection after the norm: one kernel
where there were two. A SplitSum x (kernels/split_gemm.py) is summed as it is loaded and
rounded to the residual's dtype, as the projection's own output would have been.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import row_warps, store_fp8_row
from nanovllm.kernels.launch import launch
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.kernels.split_gemm import SplitSum, kernel_args, load_output
from nanovllm.utils.fp8 import FP8_DTYPE, FP8_MAX

# A row summed from a SplitSum's parts (down_proj's 6 at Qwen3-0.6B's shapes; 12 on the
# narrower tiles it was measured with): more loads in flight per program (RESULTS.md, session 31).
_SPLIT_WARPS = 8


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, x_stride, res_stride, eps, split_stride,
                     H: tl.constexpr, HP: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr,
                     FP8_MAX: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One row; SPLITS > 0: x is a SplitSum's parts (then with a residual)."""
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
    offs = tl.arange(0, HP)
    ok = offs < H
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    if PDL:
        gdc_wait()
    dtype: tl.constexpr = res_ptr.dtype.element_ty if SPLITS else x_ptr.dtype.element_ty
    x = load_output(x_ptr + row * x_stride, offs, ok, dtype, SPLITS, split_stride).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * res_stride + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * H + offs, x.to(dtype), mask=ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    out = ((x * rstd).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)
    if QUANTIZE:  # quantize_activations' arithmetic on the rounded output
        store_fp8_row(out.to(tl.float32), out_ptr + row * H + offs, ok, scale_ptr + row, FP8_MAX)
    else:
        tl.store(out_ptr + row * H + offs, out, mask=ok)


def rms_norm(x: torch.Tensor | SplitSum, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False):
    """x [M, H] (and residual [M, H]) with unit stride in H, weight [H]; quantize: the
    output as (FP8 [M, H], fp32 scales [M, 1]). x may be a SplitSum where a residual is given."""
    if isinstance(x, SplitSum) and (residual is None or residual.dtype != x.dtype):
        raise ValueError("rms_norm takes a SplitSum with a residual of its dtype")
    x, splits, split_stride = kernel_args(x)
    rows, hidden = x.shape
    if x.stride(1) != 1 or weight.shape != (hidden,) or (residual is not None and (
            residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError(f"rms_norm takes x [M, H] and residual [M, H] with unit stride in H and a weight [H]; got "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    dtype = residual.dtype if splits else x.dtype
    out = torch.empty(rows, hidden, dtype=FP8_DTYPE if quantize else dtype, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if quantize else None
    residual_out = torch.empty_like(residual) if residual is not None else None
    if rows:
        pdl = pdl_enabled(x.device)
        hp = triton.next_power_of_2(hidden)
        launch(_rms_norm_kernel, (rows,),
            x, residual if residual is not None else x, weight, out,
            residual_out if residual is not None else out, scales if quantize else weight, x.stride(0),
            residual.stride(0) if residual is not None else 0, eps, split_stride,
            H=hidden, HP=hp, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize,
            FP8_MAX=FP8_MAX, SPLITS=splits, PDL=pdl, num_warps=_SPLIT_WARPS if splits else row_warps(hp),
            **launch_options(pdl))
    output = (out, scales) if quantize else out
    return output if residual is None else (output, residual_out)
