"""FP8 (e4m3) matmuls for quantized linear layers, and the FP8 rounding every kernel shares.

A quantized layer holds W as FP8 with fp32 scales per output row and per group of
GROUP_K input columns: W[n, k] = W_fp8[n, k] * w_scale[n, k // GROUP_K]. GROUP_K is the
whole input (per-channel scales: online quantization) or 128 (the block-scaled FP8
checkpoints, whose [128 x 128] blocks' scales are repeated over their 128 rows).
Activations are quantized the same way as they arrive, per token and GROUP_K group
(dynamic scales), so each K tile of the GEMM is an FP8 tensor-core product scaled by
a_scale[m, g] * w_scale[n, g]:

    a: [M, K] FP8, a_scale: [M, K // GROUP_K] fp32
    w: [N, K] FP8, w_scale: [N, K // GROUP_K] fp32
    out[m, n] = sum_g a_scale[m, g] * w_scale[n, g] * sum_{k in g} a[m, k] * w[n, k]

scaled_gemm takes either kind of scales; kernels/decode_gemm.py's channel_gemm, per-channel
scales at decode batch sizes, where cuBLAS's row-wise kernel leaves SMs idle.
"""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import launch
from nanovllm.utils.env import triton_interpreting
from nanovllm.utils.fp8 import FP8_DTYPE, FP8_MAX

# Quantization holds a group of up to this many elements in one program (one load, then the
# stores: a per-token group is a whole row, o_proj's input at decode batches), in row_warps'
# warps as the quantizing RMSNorm; wider groups it reads twice in chunks of _QUANT_BLOCK.
_QUANT_ONE_PASS = 16384
_QUANT_BLOCK = 1024
# GEMM tiles: 64 x 128 outputs, K steps of up to 128 (never across two scale groups).
_BLOCK_M = 64
_BLOCK_N = 128
_MAX_BLOCK_K = 128


@triton.jit
def to_fp8(x, dtype: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp32 x saturated to +-FP8_MAX and rounded to nearest even in `dtype` (e4m3 when
    FP8_MAX is 448, else e5m2)."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    if FP8_MAX == 448.0:  # e4m3: 3 mantissa bits, normal down to 2^-6
        x = _round_to_fp8_grid(x, 3, -6)
    else:  # e5m2: 2 mantissa bits, normal down to 2^-14
        x = _round_to_fp8_grid(x, 2, -14)
    return x.to(dtype)


@triton.jit
def _round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """fp32 x rounded to nearest even on an FP8 format's grid, in fp32 arithmetic, so the
    cast after it is exact: the Triton interpreter's own FP8 cast loses the carry when
    rounding up crosses a power of two (1.99 -> 1.0), and one rounding rule everywhere
    keeps the CPU tests' kernels the GPU's. Adding 2^(e - MANTISSA_BITS + 23) to |x| in
    [2^e, 2^(e+1)) leaves fp32 exactly the format's ulp there, and fp32 rounds to it."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)  # one ulp across the subnormals
    magic = ((exponent + 23 - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    # x's sign bit (-0.0 too) put back by a multiply: Triton negates as 0 - x, which turns
    # a negative x rounded to zero into +0, where torch's cast keeps -0
    return rounded * tl.where(x.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)


@functools.cache
def fp8_converts_in_asm(device: torch.device) -> bool:
    """Whether kernels on `device` may convert FP8 with `fp8_to_f16`: the paired conversion
    instruction needs sm_89 or later, and the Triton interpreter runs no assembly."""
    return (device.type == "cuda" and torch.version.hip is None and not triton_interpreting()
            and torch.cuda.get_device_capability(device) >= (8, 9))


@triton.jit
def fp8_to_f16(x):
    """FP8 x (e4m3 or e5m2) as float16, exactly, through the hardware's paired conversion,
    four values per 32-bit register (where `fp8_converts_in_asm`). As inline assembly not
    marked pure, the conversion stays where it is written: Triton moves a plain cast after
    a layout change, to move fewer bytes through shared memory, which for a tile read
    transposed (the V operand of p @ v) meant loading it from shared memory one byte at a
    time."""
    if x.dtype == tl.float8e4nv:
        asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                             "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")
    else:
        asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                             "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }")
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False,
                                     pack=4)


@triton.jit
def fp8_scale(amax, FP8_MAX: tl.constexpr):
    """A group's scale from its largest |value|: amax / FP8_MAX, so that an all-zero group
    (amax floored at 1e-12) stays zero."""
    return tl.div_rn(tl.maximum(amax, 1e-12), FP8_MAX)


@triton.jit
def store_fp8_row(y, q_ptrs, mask, scale_ptr, FP8_MAX: tl.constexpr):
    """A whole row held by one program, quantized as quantize_activations quantizes a
    per-token group: y (fp32, 0 where masked) / scale to q_ptrs, scale = max |y| / FP8_MAX
    to scale_ptr. The kernels that quantize what they write (kernels/rmsnorm.py,
    kernels/activation.py) end with it."""
    scale = fp8_scale(tl.max(tl.abs(y), axis=0), FP8_MAX)
    tl.store(scale_ptr, scale)
    tl.store(q_ptrs, to_fp8(tl.div_rn(y, scale), q_ptrs.dtype.element_ty, FP8_MAX), mask=mask)


def row_warps(width_p2: int) -> int:
    """Warps a program holding a row of width_p2 values (a power of two) takes: 4 up to
    1,024, then one per 256 values up to 16 (more loads in flight for wide rows such as
    Qwen3-8B's 4,096; RESULTS.md, session 39). kernels/rmsnorm.py's norm takes the same with
    and without quantize, so both sum a row in one order; quantize_activations too."""
    return max(4, min(16, width_p2 // 256))


@triton.jit
def dot_acc(x, w, acc, SCALED: tl.constexpr, PROMOTE: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x w^T on the tensor cores (w as loaded, [N, K]): FP8 products (SCALED) promoted
    to fp32 every PROMOTE columns (0: never; utils/fp8.py's fp8_promote), others at PRECISION."""
    if SCALED and PROMOTE:
        return tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
    if SCALED:
        return tl.dot(x, tl.trans(w), acc)
    return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, x_stride, K, GROUP_K: tl.constexpr, BLOCK: tl.constexpr,
                     FP8_MAX: tl.constexpr):
    """Program (row, group): scale = max |x| / FP8_MAX over the group, q = x / scale; a group
    of up to BLOCK elements in one load (store_fp8_row), a wider one read twice."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP_K
    x_row = x_ptr + row * x_stride + start
    offs = tl.arange(0, BLOCK)
    scale_at = scale_ptr + row * (K // GROUP_K) + group
    if GROUP_K <= BLOCK:
        mask = offs < GROUP_K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        store_fp8_row(x, q_ptr + row * K + start + offs, mask, scale_at, FP8_MAX)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k in range(0, GROUP_K, BLOCK):
            x = tl.load(x_row + k + offs, mask=k + offs < GROUP_K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = fp8_scale(tl.max(amax, axis=0), FP8_MAX)
        tl.store(scale_at, scale)
        for k in range(0, GROUP_K, BLOCK):
            mask = k + offs < GROUP_K
            x = tl.load(x_row + k + offs, mask=mask, other=0.0).to(tl.float32)
            q = to_fp8(tl.div_rn(x, scale), q_ptr.dtype.element_ty, FP8_MAX)
            tl.store(q_ptr + row * K + start + k + offs, q, mask=mask)


def quantize_activations(x: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dimension contiguous) -> (FP8 [M, K], fp32 scales [M, K // group_k])."""
    M, K = x.shape
    if K % group_k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with K ({K}) a multiple of group_k ({group_k}) and contiguous rows")
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(M, K // group_k, dtype=torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(group_k)
        block = block if block <= _QUANT_ONE_PASS else _QUANT_BLOCK
        launch(_quantize_kernel, (M, K // group_k), x, q, scales, x.stride(0), K, GROUP_K=group_k, BLOCK=block,
               FP8_MAX=FP8_MAX, num_warps=row_warps(block))
    return q, scales


@triton.jit
def _scaled_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, a_stride, w_stride,
                        out_stride, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out = (a * a_scale) @ (w * w_scale)^T (+ bias)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_groups = K // GROUP_K
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * a_stride + offs_k[None, :]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * w_stride + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_rows + k, mask=mask_m[:, None] & (k + offs_k[None, :] < K), other=0.0)
        w = tl.load(w_cols + k, mask=mask_n[None, :] & (k + offs_k[:, None] < K), other=0.0)
        group = k // GROUP_K
        a_scale = tl.load(a_scale_ptr + offs_m * num_groups + group, mask=mask_m, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n * num_groups + group, mask=mask_n, other=0.0)
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def scaled_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N] = (a * a_scale) @ (w * w_scale)^T + bias, in out_dtype (see the module doc)."""
    M, K = a.shape
    N = w.shape[0]
    group_k = K // w_scale.shape[1]
    if (w.shape[1] != K or K % w_scale.shape[1] or a_scale.shape != (M, w_scale.shape[1])
            or w_scale.shape[0] != N or not (a.is_contiguous() and w.is_contiguous())):
        raise ValueError(f"scaled_gemm: a {tuple(a.shape)} / a_scale {tuple(a_scale.shape)} and w {tuple(w.shape)} / "
                         f"w_scale {tuple(w_scale.shape)} must be contiguous [M, K] / [M, G] and [N, K] / [N, G], "
                         f"G dividing K")
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M:
        # A K step never spans two scale groups: per-channel scales (one group) take any
        # step, block scales a step of the group's size (128, a power of two).
        block_k = min(_MAX_BLOCK_K, max(16, triton.next_power_of_2(K))) if group_k == K else group_k
        grid = (triton.cdiv(M, _BLOCK_M), triton.cdiv(N, _BLOCK_N))
        launch(_scaled_gemm_kernel, grid, a, w, a_scale, w_scale, bias if bias is not None else w_scale, out, M, N, K,
               a.stride(0), w.stride(0), out.stride(0), GROUP_K=group_k, HAS_BIAS=bias is not None,
               BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=block_k)
    return out
