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

scaled_gemm takes either kind of scales; channel_gemm, per-channel scales at decode batch
sizes, where cuBLAS's row-wise kernel leaves SMs idle.
"""
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from nanovllm.kernels.gpu import num_sms, shared_memory_per_block
from nanovllm.kernels.launch import launch
from nanovllm.kernels.split_counters import split_counters
from nanovllm.utils.fp8 import FP8_DTYPE, FP8_MAX

# Quantization reads a group in chunks of this many elements (a per-token group is a whole row).
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
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def fp8_scale(amax, FP8_MAX: tl.constexpr):
    """A group's scale from its largest |value|: amax / FP8_MAX, so that an all-zero group
    (amax floored at 1e-12) stays zero."""
    return tl.div_rn(tl.maximum(amax, 1e-12), FP8_MAX)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, x_stride, K, GROUP_K: tl.constexpr, BLOCK: tl.constexpr,
                     FP8_MAX: tl.constexpr):
    """Program (row, group): scale = max |x| / FP8_MAX over the group, q = x / scale."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP_K
    x_row = x_ptr + row * x_stride + start
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k in range(0, GROUP_K, BLOCK):
        x = tl.load(x_row + k + offs, mask=k + offs < GROUP_K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_scale(tl.max(amax, axis=0), FP8_MAX)
    tl.store(scale_ptr + row * (K // GROUP_K) + group, scale)
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
        launch(_quantize_kernel, (M, K // group_k), x, q, scales, x.stride(0), K, GROUP_K=group_k,
                                            BLOCK=min(_QUANT_BLOCK, triton.next_power_of_2(group_k)), FP8_MAX=FP8_MAX)
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


# Per-channel scales at decode batch sizes (layers/quantization.py's limit): channel_gemm.
# cuBLAS's row-wise scaled kernel tiles 128 tokens x 128 channels and never splits K, so a
# batch's 4,096-channel projection is 32 programs on 132 SMs.


@triton.jit
def _channel_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counters_ptr,
                         M, N, K, a_stride, w_stride, out_stride, K_PER_SPLIT, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """Program (tile, split) of out = (a * a_scale) @ (w * w_scale)^T with one scale per
    token and one per output channel: BLOCK_N channels x BLOCK_T tokens over the split's
    K_PER_SPLIT columns, the weights as the tensor cores' wide operand (a decode batch has
    few tokens), the scales applied once at the end. With several splits each stores its
    fp32 partial and the last to finish (kernels/split_counters.py) sums them in split
    order, so every launch rounds alike."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = (tile // tiles_n) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    t_ok = offs_t < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride + offs_k[None, :]
    a_rows = a_ptr + offs_t.to(tl.int64)[:, None] * a_stride + offs_k[None, :]
    start = split * K_PER_SPLIT  # a multiple of BLOCK_K: only K's last step is partial
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k in tl.range(start, tl.minimum(start + K_PER_SPLIT, K), BLOCK_K, num_stages=NUM_STAGES):
        k_ok = k + offs_k < K
        w = tl.load(w_rows + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_rows + k, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        # Promoted to fp32 after every K step, as cuBLAS's default (not fast) accumulation:
        # Hopper's FP8 products otherwise accumulate with fewer mantissa bits over all of K.
        acc = tl.dot(w, tl.trans(a), acc, max_num_imprecise_acc=BLOCK_K)
    if num_splits > 1:
        cells = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        tile_size = BLOCK_N * BLOCK_T
        tl.store(partial_ptr + (split * tl.num_programs(0) + tile).to(tl.int64) * tile_size + cells, acc)
        # Release the partial above, acquire everyone else's (as decode attention's merge).
        counter = counters_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") != num_splits - 1:
            return
        tl.atomic_xchg(counter, 0, sem="relaxed")
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
        for other in range(0, num_splits):
            # .cg: read from L2, where the other programs' stores are, never a stale L1 line
            acc += tl.load(partial_ptr + (other * tl.num_programs(0) + tile).to(tl.int64) * tile_size + cells,
                           cache_modifier=".cg")
    a_scale = tl.load(a_scale_ptr + offs_t, mask=t_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)
    acc = acc * a_scale[None, :] * w_scale[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_t.to(tl.int64)[None, :] * out_stride + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


@dataclass(frozen=True)
class ChannelGemmConfig:
    block_n: int = 64
    block_t: int = 128
    block_k: int = 128
    splits: int = 1
    num_stages: int = 6
    num_warps: int = 4


def channel_gemm_config(M: int, N: int, K: int, num_sms: int, shared_memory: int = 232_448) -> ChannelGemmConfig:
    """The tile for a batch of M tokens, from a sweep on the H200 over Qwen3-8B's
    projections at 1-256 tokens (RESULTS.md, session 20): 64 channels, BLOCK_T covering the
    batch (up to 128 tokens a tile, then eight warps), six K steps in flight (fewer where a
    block's shared memory, e.g. an Ada GPU's, holds fewer), and K split as far as the tiles
    leave SMs idle, each split keeping four K steps or more."""
    block_t = min(128, max(16, triton.next_power_of_2(M)))
    config = ChannelGemmConfig(block_t=block_t, num_warps=8 if block_t == 128 else 4)
    stage_bytes = (config.block_n + block_t) * config.block_k  # one K step of FP8 weights and tokens
    tiles = triton.cdiv(N, config.block_n) * triton.cdiv(M, block_t)
    splits = max(1, min(num_sms // tiles, triton.cdiv(K, config.block_k) // 4))
    return replace(config, splits=splits, num_stages=max(2, min(config.num_stages, shared_memory // stage_bytes)))


def channel_gemm_wins(M: int, N: int, device: torch.device) -> bool:
    """Whether channel_gemm beats cuBLAS's row-wise kernel for M tokens and N channels (the
    sweep above): up to 64 tokens always; up to 128 where cuBLAS's 128-channel tiles leave
    SMs idle (not for Qwen3-8B's 24,576-wide gate_up)."""
    return M <= 64 or N < 128 * num_sms(device)


def channel_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype,
                 config: ChannelGemmConfig | None = None) -> torch.Tensor:
    """scaled_gemm with per-channel scales (a_scale [M, 1], w_scale [N, 1]) for decode
    batches; config: the tile (default: channel_gemm_config's for the device)."""
    M, K = a.shape
    N = w.shape[0]
    if (w.shape[1] != K or a_scale.shape != (M, 1) or w_scale.shape != (N, 1) or a.stride(1) != 1
            or not w.is_contiguous()):
        raise ValueError(f"channel_gemm: a {tuple(a.shape)} / a_scale {tuple(a_scale.shape)} and w {tuple(w.shape)} / "
                         f"w_scale {tuple(w_scale.shape)} must be [M, K] / [M, 1] and contiguous [N, K] / [N, 1]")
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    config = config or channel_gemm_config(M, N, K, num_sms(a.device), shared_memory_per_block(a.device))
    tiles = triton.cdiv(N, config.block_n) * triton.cdiv(M, config.block_t)
    k_per_split = triton.cdiv(triton.cdiv(K, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(K, k_per_split)  # none empty
    counters = split_counters(a.device, tiles)  # allocated on the first call, before any capture
    partial = torch.empty(splits if splits > 1 else 0, tiles, config.block_n * config.block_t, dtype=torch.float32,
                          device=a.device)
    if M:
        launch(_channel_gemm_kernel, (tiles, splits), a, w, a_scale, w_scale, bias if bias is not None else w_scale,
               out, partial, counters, M, N, K, a.stride(0), w.stride(0), out.stride(0), k_per_split,
               HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_T=config.block_t, BLOCK_K=config.block_k,
               NUM_STAGES=config.num_stages, num_warps=config.num_warps)
    return out
