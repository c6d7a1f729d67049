"""Projections of 65-256-row steps on tiles with x as the tensor cores' row operand, on
Hopper (or the Triton interpreter): x in tiles of 64 or 128 rows and the weight in tiles of
64 rows, both by TMA copies in a pipelined loop over K.

- 16-bit row-parallel projections whose output is narrow beside their reduction (K >= 2 N)
  and at most 1,024 wide (Qwen3-0.6B's o_proj and down_proj, one rank): K is cut into
  WIDE_SPLITS splits so that the few output tiles still fill the SMs, and the fp32 partials
  are a SplitSum (kernels/split_gemm.py) that the norm reading them sums. cuBLAS runs such
  a projection as a handful of output tiles and was slower at 128 and 256 rows; it keeps
  q/k/v and gate_up, whose wide outputs fill the SMs without splits, and wider outputs
  (Qwen3-8B's down_proj), where the tiles lost (benchmarks/RESULTS.md, sessions 38-39).
- FP8 projections with one scale per token and per output channel (fp8_wide_gemm, up to
  NANOVLLM_FP8_WIDE_ROWS rows): one split, the products summed as utils/fp8.py's
  FAST_ACCUM says (by default in the tensor cores' own accumulator, as cuBLAS and
  channel_gemm then sum them), both scales applied once at the end, the output dense. Only
  the weight shapes and rows where it beat channel_gemm and cuBLAS's row-wise kernel take
  it (fp8_plan: square weights, and outputs narrower than K past channel_gemm's rows).

    out = wide_split_gemm(x, weight, wide_descriptor(weight), bias)   -> SplitSum
    plan = fp8_plan(weight)                                            once per weight
    y = fp8_wide_gemm(q, q_scale, weight, w_scale, bias, dtype, plan)  -> [M, N] in dtype

The kernel waits for the kernel before it at its start: no weights are fetched early,
unlike the smaller tiles' (a first weight step fetched before the PDL wait was slower
offline; RESULTS.md, session 39).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import dot_acc
from nanovllm.kernels.gpu import is_hopper_or_later
from nanovllm.kernels.launch import launch
from nanovllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from nanovllm.kernels.split_gemm import MOST_ROWS, SplitSum, supports, tma_addressable
from nanovllm.utils.env import env_int
from nanovllm.utils.fp8 import fp8_promote, is_fp8

# The rows from and up to which the 16-bit tiles take a narrow-output projection
# (NANOVLLM_SPLIT_GEMM_WIDE_ROWS below WIDE_MIN_ROWS: none, cuBLAS), and their shape: 64
# weight rows x 128 columns a step, four stages, K in four splits; 64-row x tiles up to 128
# rows, then 128 (for o_proj and down_proj at 128 and 256 rows the best, or near it, of the
# shapes swept; RESULTS.md, session 38).
WIDE_MIN_ROWS = MOST_ROWS + 1  # above split_gemm's tiles
_MEASURED_ROWS = 256  # measured up to here; larger steps (prefill chunks) stay with cuBLAS
WIDE_MAX_ROWS = min(env_int("NANOVLLM_SPLIT_GEMM_WIDE_ROWS", _MEASURED_ROWS, least=0), _MEASURED_ROWS)
# FP8 steps of up to this many rows (from WIDE_MIN_ROWS) go to fp8_wide_gemm where the
# weight's plan takes them (0: none).
FP8_WIDE_MAX_ROWS = min(env_int("NANOVLLM_FP8_WIDE_ROWS", _MEASURED_ROWS, least=0), _MEASURED_ROWS)
WIDE_SPLITS = 4
# The widest output the 16-bit tiles take: with their norm they beat cuBLAS and its norm at
# 1,024 columns (K 2,048 / 3,072) and lost at 2,048 and up (K 4,096 to 12,288, Qwen3-8B's
# down_proj among them; RESULTS.md, session 39).
WIDE_MOST_COLUMNS = 1024
_BLOCK_N = 64
_STEP_BYTES = 256  # of each row per K step: 128 16-bit values, 64 fp32, 256 FP8
_STAGES = 4
_NUM_WARPS = 4


class Tiles(NamedTuple):
    """A launch's tiles: x rows, weight rows, K step columns, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    stages: int


# The FP8 form's tiles (64 x rows, 128 weight rows, 256-byte K steps, four stages: at
# Qwen3-8B's shapes the best or near it at the rows swept, the tensor cores summing over all
# of K) and the rows each weight shape takes them for, where they beat channel_gemm and
# cuBLAS's row-wise kernel (RESULTS.md, session 40): square weights (o_proj) at every row
# count, outputs narrower than K (down_proj) past channel_gemm's 128. Wider outputs (q/k/v,
# gate_up) stay with channel_gemm and cuBLAS, which won or tied there.
_FP8_TILES = Tiles(64, 128, 256, 4)
_FP8_SMALL_ROWS = 128  # channel_gemm's default reach (layers/quantization.py's CHANNEL_GEMM_MAX_ROWS)


def takes_wide(weight: torch.Tensor) -> bool:
    """Whether the 16-bit tiles take this weight [N, K]: split_gemm.supports(weight), and an
    output narrow beside the reduction (K >= 2 N) and of at most WIDE_MOST_COLUMNS."""
    n, k = weight.shape[0], weight.shape[-1]
    return supports(weight) and k >= 2 * n and n <= WIDE_MOST_COLUMNS


class Fp8Plan:
    """The rows of a weight's FP8 steps fp8_wide_gemm takes (first to last, and at most
    FP8_WIDE_MAX_ROWS), on _FP8_TILES, with the weight's TMA descriptor made once (fp8_plan)."""

    def __init__(self, weight: torch.Tensor, first: int, last: int):
        from triton.tools.tensor_descriptor import TensorDescriptor

        self.first, self.last = first, last
        self._tiles = _FP8_TILES._replace(block_k=_block_k(weight.shape[1], 1, _FP8_TILES.block_k))
        self._descriptor = TensorDescriptor.from_tensor(weight, [self._tiles.block_n, self._tiles.block_k])

    def tiles(self, rows: int) -> Tiles | None:
        """The tiles of a step of `rows`, or None where the plan leaves it to channel_gemm or cuBLAS."""
        return self._tiles if self.first <= rows <= min(self.last, FP8_WIDE_MAX_ROWS) else None

    @property
    def descriptor(self):
        """The weight's TMA descriptor, of _FP8_TILES' weight tiles."""
        return self._descriptor


def fp8_plan(weight: torch.Tensor) -> Fp8Plan | None:
    """The FP8 form's plan for a per-channel FP8 weight [N, K] (contiguous, TMA-addressable)
    of a shape it takes (N <= K), on a Hopper or later GPU (or a CPU, under the
    interpreter); else None."""
    n, k = weight.shape
    if (n > k or not is_fp8(weight.dtype) or not weight.is_contiguous() or not tma_addressable(weight)
            or not (weight.device.type == "cpu" or is_hopper_or_later(weight.device))):
        return None
    return Fp8Plan(weight, WIDE_MIN_ROWS if n == k else _FP8_SMALL_ROWS + 1, _MEASURED_ROWS)


def takes_fp8(q: torch.Tensor, weight: torch.Tensor, plan: Fp8Plan | None) -> bool:
    """Whether fp8_wide_gemm takes FP8 rows q [M, K] (TMA-addressable) against this FP8
    weight by its plan (fp8_plan(weight); None: never): where the plan has tiles for M rows."""
    return (plan is not None and plan.tiles(q.shape[0]) is not None and q.dtype == weight.dtype
            and tma_rows(q))


def wide_descriptor(weight: torch.Tensor):
    """The TMA descriptor of a weight's tiles (made once per weight, or per call)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(weight, [_BLOCK_N, _block_k(weight.shape[1], weight.element_size())])


def tma_rows(x: torch.Tensor) -> bool:
    """Whether x [M, K] can be the x operand: unit stride in K, rows a TMA copy can address."""
    return x.dim() == 2 and x.stride(1) == 1 and tma_addressable(x)


def _block_k(k: int, itemsize: int, most: int | None = None) -> int:
    """A K step's columns: `most` (default _STEP_BYTES' worth), fewer for a short K (at least
    16; 32 for FP8, the least an FP8 product on the tensor cores takes)."""
    most = _STEP_BYTES // itemsize if most is None else most
    return min(most, max(32 if itemsize == 1 else 16, triton.next_power_of_2(k)))


@triton.jit
def _wide_gemm_kernel(x_desc, w_desc, x_scale_ptr, w_scale_ptr, b_ptr, out_ptr, M, N, split_k,
                      SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr, PROMOTE: tl.constexpr,
                      PARTS: tl.constexpr, PDL: tl.constexpr):
    """Program (tile of N, tile of M, split): x[M tile, split] W[N tile, split]^T, then for
    SCALED (FP8) times x_scale per row and w_scale per column, plus the bias in split 0: PARTS,
    fp32 parts [split, M, N] in out; else (one split) out [M, N] in its dtype. Rows and
    columns past M, N and K arrive as zeros from the TMA copies. FP8 products are promoted
    to fp32 every PROMOTE columns (0: never)."""
    tile_n = tl.program_id(0)
    tile_m = tl.program_id(1)
    split = tl.program_id(2)
    start = split * split_k
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < M
    c_ok = cols < N
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(start, start + split_k, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([tile_m * BLOCK_M, k])
        w = w_desc.load([tile_n * BLOCK_N, k])
        acc = dot_acc(x, w, acc, SCALED, PROMOTE, PRECISION)
    if SCALED:
        acc *= tl.load(x_scale_ptr + rows, mask=r_ok, other=0.0)[:, None]
        acc *= tl.load(w_scale_ptr + cols, mask=c_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :] * (split == 0).to(tl.float32)
    offsets = rows[:, None] * N + cols[None, :]
    if PARTS:
        tl.store(out_ptr + split * M * N + offsets, acc, mask=r_ok[:, None] & c_ok[None, :])
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


def _split_k(k: int, splits: int, block_k: int) -> int:
    """Columns of K a split takes: whole steps, so that at most `splits` splits cover K."""
    return triton.cdiv(triton.cdiv(k, splits), block_k) * block_k


def _launch(x, descriptor, n, splits, dtype, tiles: Tiles, x_scale=None, w_scale=None, bias=None) -> torch.Tensor:
    """The kernel over x [M, K] against a weight of n rows (descriptor: of its tiles): for
    splits > 1 its fp32 parts [S, M, N] (S: however many whole-step splits, at most `splits`,
    cover K), else [M, N] in dtype."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    block_m, block_n, block_k, stages = tiles
    split_k = _split_k(k, splits, block_k)
    if splits > 1:
        out = torch.empty(triton.cdiv(k, split_k), m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=dtype, device=x.device)
    pdl = pdl_enabled(x.device)
    launch(_wide_gemm_kernel, (triton.cdiv(n, block_n), triton.cdiv(m, block_m), triton.cdiv(k, split_k)),
           TensorDescriptor.from_tensor(x, [block_m, block_k]), descriptor,
           x_scale if x_scale is not None else out, w_scale if w_scale is not None else out,
           bias if bias is not None else out, out, m, n, split_k, SCALED=x_scale is not None,
           HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
           PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
           PROMOTE=fp8_promote(block_k), PARTS=splits > 1, PDL=pdl,
           num_warps=_NUM_WARPS, **launch_options(pdl))
    return out


def wide_split_gemm(x: torch.Tensor, weight: torch.Tensor, descriptor, bias: torch.Tensor | None = None) -> SplitSum:
    """x [M, K] (tma_rows(x)) times weight [N, K] (takes_wide(weight); descriptor =
    wide_descriptor(weight)) -> SplitSum of [M, N] in x's dtype, in WIDE_SPLITS splits of K
    (fewer where K is short)."""
    m, k = x.shape
    n = weight.shape[0]
    if not m or weight.shape[1] != k or not tma_rows(x) or x.dtype != weight.dtype:
        raise ValueError(f"wide_split_gemm takes rows of x in the weight's dtype, TMA-addressable; got x "
                         f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    tiles = Tiles(64 if m <= 128 else 128, _BLOCK_N, _block_k(k, x.element_size()), _STAGES)
    return SplitSum(_launch(x, descriptor, n, WIDE_SPLITS, x.dtype, tiles, bias=bias), x.dtype)


def fp8_wide_gemm(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, dtype: torch.dtype, plan: Fp8Plan | None) -> torch.Tensor:
    """(q * q_scale) (weight * w_scale)^T (+ bias) in dtype: q [M, K] FP8 with q_scale [M, 1]
    fp32, weight [N, K] FP8 with w_scale [N, 1] fp32, plan = fp8_plan(weight) (takes_fp8(q,
    weight, plan))."""
    m, k = q.shape
    n = weight.shape[0]
    scales_ok = all(scale.shape == (rows, 1) and scale.stride(0) == 1 and scale.dtype == torch.float32
                    for scale, rows in ((q_scale, m), (w_scale, n)))
    if not takes_fp8(q, weight, plan) or weight.shape[1] != k or not scales_ok:
        raise ValueError(f"fp8_wide_gemm takes the FP8 rows its weight's plan has tiles for ({WIDE_MIN_ROWS} to "
                         f"{FP8_WIDE_MAX_ROWS} at most), TMA-addressable, and fp32 scales [rows, 1] and [channels, 1] "
                         f"with unit stride; got q {tuple(q.shape)} {q.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype} ({'no plan' if plan is None else 'planned'}), scales "
                         f"{tuple(q_scale.shape)} / {tuple(w_scale.shape)}")
    tiles = plan.tiles(m)
    return _launch(q, plan.descriptor, n, 1, dtype, tiles, q_scale, w_scale, bias)
