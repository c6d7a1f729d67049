"""GEMMs of decode batches (up to 128 tokens) on tiles of 64 weight rows, y = x W^T (+ b):

    y = channel_gemm(q, q_scale, w, w_scale, bias, dtype)   FP8 x and W, one scale per token
                                                            and per output channel
    y = decode_gemm(x, weight, bias)                        16-bit (or fp32) x and W

cuBLAS tiles a few tokens' GEMM as it tiles a large one: its row-wise scaled FP8 kernel
runs one program per 128 output channels and never splits K, so a batch's 4,096-channel
projection is 32 programs on 132 SMs. Here program (tile, split) multiplies BLOCK_N
weight rows by up to BLOCK_T tokens over a split of K, the weights as the tensor cores'
wide operand (a decode batch has few tokens), with 128 bytes of each row per K step and
six steps in flight; K is split as far as the tiles leave SMs idle, and the last split to
finish (kernels/split_counters.py) sums the fp32 partials in split order, so every launch
rounds alike. FP8 scales are applied once, at the end; FP8 products are summed as
utils/fp8.py's FAST_ACCUM says (the tensor cores' own accumulation, or promoted to fp32
after every K step).

Tiles from a sweep on the H200 (benchmarks/bench_kernels.py --fp8-gemm-only --fp8-gemm-sweep,
RESULTS.md session 20). layers/quantization.py sends FP8 decode batches here
(channel_gemm_wins). The 16-bit form is the benchmark's alternative to cuBLAS (bench_kernels.py
--decode-gemm-only), not the engine's: at 9-64 rows it was no faster, with programmatic
dependent launch neither (RESULTS.md, session 21).
"""
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import dot_acc
from nanovllm.kernels.gpu import H200_SHARED_MEMORY, is_float_matrix, num_sms, shared_memory_per_block
from nanovllm.kernels.launch import launch
from nanovllm.kernels.split_counters import last_to_count, split_counters
from nanovllm.utils.fp8 import fp8_promote

_ROW_BYTES_PER_STEP = 128  # of each weight row and token per K step: 128 FP8 or 64 bf16 values


@triton.jit
def _tile_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counters_ptr,
                      M, N, K, a_stride, w_stride, out_stride, K_PER_SPLIT, SCALED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, PROMOTE: tl.constexpr):
    """Program (tile, split): BLOCK_N output channels x BLOCK_T tokens over the split's
    K_PER_SPLIT columns (see the module doc); SCALED: FP8 with a_scale [M] and w_scale [N],
    its products promoted to fp32 every PROMOTE columns (0: never)."""
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
        acc = dot_acc(w, a, acc, SCALED, PROMOTE, DOT_PRECISION)
    if num_splits > 1:
        cells = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        tile_size = BLOCK_N * BLOCK_T
        tl.store(partial_ptr + (split * tl.num_programs(0) + tile).to(tl.int64) * tile_size + cells, acc)
        # Release the partial above, acquire everyone else's (as decode attention's merge).
        if not last_to_count(counters_ptr + tile, num_splits):
            return
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
        for other in range(0, num_splits):
            # .cg: read from L2, where the other programs' stores are, never a stale L1 line
            acc += tl.load(partial_ptr + (other * tl.num_programs(0) + tile).to(tl.int64) * tile_size + cells,
                           cache_modifier=".cg")
    if SCALED:
        acc *= tl.load(a_scale_ptr + offs_t, mask=t_ok, other=0.0)[None, :]
        acc *= tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_t.to(tl.int64)[None, :] * out_stride + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


@dataclass(frozen=True)
class TileConfig:
    block_n: int = 64
    block_t: int = 128
    block_k: int = 128
    splits: int = 1
    num_stages: int = 6
    num_warps: int = 4


def tile_config(M: int, N: int, K: int, itemsize: int = 1, num_sms: int = 132,
                shared_memory: int = H200_SHARED_MEMORY) -> TileConfig:
    """The tile for a batch of M tokens of itemsize-byte operands: 64 channels, BLOCK_T
    covering the batch (up to 128 tokens a tile, then eight warps), 128 bytes of each row
    per K step, six steps in flight (fewer where a block's shared memory, e.g. an Ada GPU's,
    holds fewer), and K split as far as the tiles leave SMs idle, each split keeping four
    K steps or more."""
    block_t = min(128, max(16, triton.next_power_of_2(M)))
    config = TileConfig(block_t=block_t, block_k=_ROW_BYTES_PER_STEP // itemsize, num_warps=8 if block_t == 128 else 4)
    stage_bytes = (config.block_n + block_t) * _ROW_BYTES_PER_STEP
    tiles = triton.cdiv(N, config.block_n) * triton.cdiv(M, block_t)
    splits = max(1, min(num_sms // tiles, triton.cdiv(K, config.block_k) // 4))
    return replace(config, splits=splits, num_stages=max(2, min(config.num_stages, shared_memory // stage_bytes)))


def channel_gemm_wins(M: int, N: int, device: torch.device) -> bool:
    """Whether channel_gemm beats cuBLAS's row-wise kernel for M tokens and N channels (the
    H200 sweep): up to 64 tokens always; up to 128 where cuBLAS's 128-channel tiles leave
    SMs idle (not for Qwen3-8B's 24,576-wide gate_up)."""
    return M <= 64 or N < 128 * num_sms(device)


def _tile_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
               bias: torch.Tensor | None, out_dtype: torch.dtype, config: TileConfig | None) -> torch.Tensor:
    M, K = a.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    config = config or tile_config(M, N, K, a.element_size(), num_sms(a.device), shared_memory_per_block(a.device))
    tiles = triton.cdiv(N, config.block_n) * triton.cdiv(M, config.block_t)
    k_per_split = triton.cdiv(triton.cdiv(K, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(K, k_per_split)  # none empty
    counters = split_counters(a.device, tiles)  # allocated on the first call, before any capture
    partial = torch.empty(splits if splits > 1 else 0, tiles, config.block_n * config.block_t, dtype=torch.float32,
                          device=a.device)
    scaled = a_scale is not None
    if M:
        launch(_tile_gemm_kernel, (tiles, splits), a, w, a_scale if scaled else out, w_scale if scaled else out,
               bias if bias is not None else out, out, partial, counters, M, N, K, a.stride(0), w.stride(0),
               out.stride(0), k_per_split, SCALED=scaled, HAS_BIAS=bias is not None, BLOCK_N=config.block_n,
               BLOCK_T=config.block_t, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
               DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
               PROMOTE=fp8_promote(config.block_k) if scaled else 0, num_warps=config.num_warps)
    return out


def channel_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, config: TileConfig | None = None) -> torch.Tensor:
    """kernels/fp8.py's scaled_gemm with per-channel scales (a_scale [M, 1], w_scale [N, 1])
    for decode batches; config: the tile (default: tile_config's for the device)."""
    M, K = a.shape
    N = w.shape[0]
    if (w.shape[1] != K or a_scale.shape != (M, 1) or not a_scale.is_contiguous() or w_scale.shape != (N, 1)
            or a.stride(1) != 1 or not w.is_contiguous()):
        raise ValueError(f"channel_gemm: a {tuple(a.shape)} / a_scale {tuple(a_scale.shape)} and w {tuple(w.shape)} / "
                         f"w_scale {tuple(w_scale.shape)} must be [M, K] / contiguous [M, 1] and contiguous [N, K] / "
                         f"[N, 1]")
    return _tile_gemm(a, w, a_scale, w_scale, bias, out_dtype, config)


def supports(weight: torch.Tensor) -> bool:
    """Whether decode_gemm takes this weight: contiguous floating-point [N, K] (not FP8)."""
    return is_float_matrix(weight)


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: TileConfig | None = None) -> torch.Tensor:
    """x [M, K] (unit stride in K) times weight [N, K] (supports(weight), x's dtype) -> [M, N]."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype \
            or not supports(weight):
        raise ValueError(f"decode_gemm takes x [M, K] with unit stride in K and a contiguous weight [N, K] of its "
                         f"dtype; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    return _tile_gemm(x, weight, None, None, bias, x.dtype, config)
