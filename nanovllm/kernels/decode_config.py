"""Launch parameters of decode attention (kernels/decode_attention.py), from host-known
shapes only (batch, KV heads, the block table's width), so that a launch's grid is the
same for every replay of a CUDA graph; and its arguments' checks (checked_output)."""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.gpu import num_sms
from nanovllm.kernels.paged import tma_tiles
from nanovllm.kernels.store_kvcache import check_head_dim, check_kv_cache, check_scale
from nanovllm.utils.env import env_flag, env_int
from nanovllm.utils.fp8 import is_fp8

# Bytes of one K (or V) tile: 64 tokens x 128 dims in bf16. Compiled for sm_90 (bf16,
# head_dim 128, 3 stages, Triton 3.6) a program takes 150 registers (128 without TMA tiles)
# and 70 KiB of shared memory, so three are resident per H200 SM (228 KiB), each with up to
# two 32 KiB K+V tiles in flight.
_TILE_BYTES = 16 * 1024
_MIN_BLOCK_N = 16  # a guard: the checked head sizes and dtypes never tile below it
_MAX_BLOCK_N = 128
_NUM_WARPS = 4
# The pipeliner keeps num_stages - 1 K/V tiles in flight (cp.async double buffering).
_NUM_STAGES = 3
# Aim for this many programs per SM: about three are resident at a time, so the work
# comes in ~5 waves or more and a ragged last wave costs little.
# NANOVLLM_DECODE_PROGRAMS_PER_SM sets it (A/B measurements: at batch 32 it cuts a
# 512-token row into one-tile splits, RESULTS session 13).
_TARGET_PROGRAMS_PER_SM = env_int("NANOVLLM_DECODE_PROGRAMS_PER_SM", 16)
# Over an FP8 cache: half as many programs (longer splits; RESULTS.md, session 17), on a
# 16-bit cache's usual tiles (64 tokens at head_dim 128, three stages, by TMA; not the few
# rows' wider tiles below), half their bytes (session 41), in two warps rather than four
# (sessions 43 and 60). NANOVLLM_DECODE_FP8_WARPS sets the warps.
_FP8_PROGRAMS_DIVISOR = 2
_FP8_NUM_WARPS = env_int("NANOVLLM_DECODE_FP8_WARPS", 2, least=1)
# A split shorter than this spends as long on setup and merge as on streaming K/V.
_MIN_SPLIT_TOKENS = 128
# Upper bound on splits: past this, merging costs more than the parallelism gains.
_MAX_SPLITS = 64
# Fewest tokens a split of a row takes at run time (in whole tiles): a short split pays its
# setup, the partial's store and the merge's atomic round trip for little streaming. Four
# 64-token tiles won the A/B of sessions 13 and 14 over one and two; eight (512 tokens) beat
# four at 32 requests in session 25, as one split per row beat two for 16 and 32 rows at
# context 512 (benchmarks/RESULTS.md); over an FP8 cache eight too (32 requests with an FP8
# cache: within noise).
# NANOVLLM_DECODE_MIN_SPLIT_TOKENS sets it (and caps the few rows' two tiles below).
MIN_SPLIT_RUN_TOKENS = env_int("NANOVLLM_DECODE_MIN_SPLIT_TOKENS", 512)
# Where the rows' (sequence, KV head) pairs are few against the SMs (at most a quarter
# of them: Qwen3's 8 KV heads, up to 4 rows on an H200), most SMs would idle anyway, and
# shorter splits put more of them to work: at one request, splits of at least two tiles
# beat four and one, while 32 requests did worse with two at every batch size
# (benchmarks/RESULTS.md, session 23). The quarter beat an eighth, a half and all of them
# at 32 requests (session 33); NANOVLLM_DECODE_FEW_ROWS_SHARE=N moves it to 1/N of the SMs.
_FEW_ROWS_SHARE = env_int("NANOVLLM_DECODE_FEW_ROWS_SHARE", 4, least=1)
_FEW_ROWS_MIN_SPLIT_TILES = 2
# There, over a 16-bit cache, tiles hold twice the tokens (128 at head_dim 128), in eight
# warps and a two-stage pipeline: each tile is one load of twice the bytes, and the first
# (read before the wait for the projection) covers twice the context. Two of them per split
# beat one, and both beat two-tile splits of the usual tiles (benchmarks/bench_pdl.py
# --layers and the engine at one and 32 requests, RESULTS.md session 24).
_FEW_ROWS_TILE_FACTOR = 2
_FEW_ROWS_NUM_WARPS = 8
_FEW_ROWS_NUM_STAGES = 2


# Where the rows alone fill every SM's resident programs (about three each), a row uses as
# many splits as hold min_split_tiles each and shares its tiles evenly among them: a 540-token
# row is one split of nine 64-token tiles, not eight and one (whose one-tile program pays
# setup, the partial's store and the merge for 28 tokens). That made decode attention at 256
# rows of ~540 tokens faster; at 32 rows the short split's parallelism won (RESULTS.md,
# session 27). NANOVLLM_DECODE_JOIN_TAIL=0 keeps short last splits everywhere.
# bf16's programs; an FP8 cache's two-warp ones fit four (kernel_sass.py), but the rule counts three
# for both (on an H200 at 8 KV heads only 50-65 rows would change; not measured)
_RESIDENT_PROGRAMS_PER_SM = 3
JOIN_TAIL = env_flag("NANOVLLM_DECODE_JOIN_TAIL", True)
# Whole K/V tiles by TMA copies (one instruction per tile instead of a 16-byte copy per thread
# and row, with their addresses) where a tile is one contiguous range of the cache: faster
# in decode attention and on the offline workloads (RESULTS.md, session 35).
# NANOVLLM_DECODE_TMA=0 keeps loads everywhere (A/B measurements).
TMA_TILES = env_flag("NANOVLLM_DECODE_TMA", True)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters of decode attention, fixed by the shapes, dtypes and device (and the
    NANOVLLM_DECODE_* switches)."""

    num_splits: int  # KV ranges per (sequence, kv head); the grid's third dimension
    block_n: int  # tokens per tile of the K/V loop
    num_warps: int
    num_stages: int
    min_split_tiles: int = 1  # a row's splits take at least this many tiles each
    # ptxas's cap on registers per thread (None: its own choice): caps that fit more programs
    # an SM (and spill) were slower in every sweep (bench_kernels.py --fp8-only --sweep;
    # RESULTS.md, sessions 22 and 41).
    max_registers: int | None = None
    # A row's last split shorter than min_split_tiles joins the others (JOIN_TAIL).
    join_tail: bool = False


def decode_config(
    batch: int,
    num_kv_heads: int,
    max_context: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    cache_dtype: torch.dtype | None = None,
) -> DecodeConfig:
    """Pick the launch parameters from host-known shapes only.

    Args:
        max_context: the most tokens a row can hold, block_tables.shape[1] * block_size.
        dtype: the queries'; cache_dtype: the cache's, when it differs (FP8).

    The split count is the smallest that gives about `_TARGET_PROGRAMS_PER_SM` programs
    per SM (half that over an FP8 cache), capped so that a full-length context still
    gives each split `_MIN_SPLIT_TOKENS` tokens, and at the most splits a full-length row
    can use at run time (each takes `min_split_tiles` tiles at least): a launched split no
    row uses is a program that only exits. At run time each row divides its actual length
    by this count, so short rows simply use fewer splits.
    """
    fp8 = cache_dtype is not None and is_fp8(cache_dtype)
    few_rows = batch * num_kv_heads * _FEW_ROWS_SHARE <= num_sms(device)
    block_n = max(_MIN_BLOCK_N, min(_MAX_BLOCK_N, _TILE_BYTES // (head_dim * dtype.itemsize)))
    num_warps, num_stages = (_FP8_NUM_WARPS if fp8 else _NUM_WARPS), _NUM_STAGES
    if few_rows and not fp8 and block_n * _FEW_ROWS_TILE_FACTOR <= _MAX_BLOCK_N:
        block_n *= _FEW_ROWS_TILE_FACTOR
        num_warps, num_stages = _FEW_ROWS_NUM_WARPS, _FEW_ROWS_NUM_STAGES
    min_split_tiles = max(1, MIN_SPLIT_RUN_TOKENS // block_n)
    if few_rows:
        min_split_tiles = min(min_split_tiles, _FEW_ROWS_MIN_SPLIT_TILES)
    programs_per_sm = _TARGET_PROGRAMS_PER_SM
    if fp8:
        programs_per_sm = max(1, programs_per_sm // _FP8_PROGRAMS_DIVISOR)
    wanted = triton.cdiv(programs_per_sm * num_sms(device), max(batch * num_kv_heads, 1))
    useful = triton.cdiv(max_context, max(_MIN_SPLIT_TOKENS, min_split_tiles * block_n))
    num_splits = max(1, min(wanted, useful, _MAX_SPLITS))
    rows_fill_sms = batch * num_kv_heads >= _RESIDENT_PROGRAMS_PER_SM * num_sms(device)
    return DecodeConfig(num_splits, block_n, num_warps, num_stages, min_split_tiles,
                        join_tail=JOIN_TAIL and rows_fill_sms)


def tile_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple | None:
    """Decode attention's K/V tile descriptors (kernels/paged.py's tma_tiles) where TMA_TILES
    is on; None: loads."""
    return tma_tiles(k_cache, v_cache, block_n) if TMA_TILES else None


def checked_output(q: torch.Tensor, batch: int, num_heads: int, head_dim: int, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                   out: torch.Tensor | None, kv_scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Decode attention's arguments checked, and its output (`out`, or a new one in dtype: q's,
    or the projection's for a SplitSum's fp32 parts)."""
    num_kv_heads = k_cache.shape[2]
    check_head_dim(head_dim)
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_dim, dtype, kv_scales)
    check_scale(scale)
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {tuple(context_lens.shape)}")
    shape = (batch, num_heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=q.device)
    elif out.shape != shape or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {shape} {dtype}, contiguous in head_dim")
    return out


@triton.jit
def num_tiles(context_len, BLOCK_N: tl.constexpr):
    """Tiles of BLOCK_N tokens that hold a row of context_len (the last one partial)."""
    return (context_len + BLOCK_N - 1) // BLOCK_N


@triton.jit
def tiles_per_split(context_len, num_splits, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
                    JOIN_TAIL: tl.constexpr):
    """Whole tiles covered by each split of one row: at least MIN_TILES >= 1, also for empty rows;
    JOIN_TAIL: as many splits as hold MIN_TILES each (at least one) share the row's tiles evenly,
    so a row shorter than MIN_TILES tiles is one split of all its tiles (an empty row's: one)."""
    tiles = num_tiles(context_len, BLOCK_N)
    if JOIN_TAIL:
        used = tl.maximum(tl.minimum(tiles // MIN_TILES, num_splits), 1)
        return tl.maximum((tiles + used - 1) // used, 1)
    return tl.maximum((tiles + num_splits - 1) // num_splits, MIN_TILES)
