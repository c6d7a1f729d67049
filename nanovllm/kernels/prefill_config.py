"""Launch parameters of prefill attention (kernels/prefill_attention.py): tile sizes from
the head size, the queries' dtype and the longest run of new tokens."""
from dataclasses import dataclass

import torch
import triton

from nanovllm.kernels.paged import MIN_DOT_ROWS

_MIN_BLOCK_M = MIN_DOT_ROWS  # tl.dot needs every operand dimension >= 16
# 64 queries a program: on the H200 (16 prompts x 1,024 tokens, head_dim 128, bf16) 64 x 64
# tiles in four warps beat 128 x 64 tiles in eight, fresh and over a cached half, by TMA
# copies and by loads (benchmarks/RESULTS.md, session 37).
_MAX_BLOCK_M = 64
# Q tile budget (it stays resident for the whole key loop): binds below _MAX_BLOCK_M only for
# float32 queries at head_dim 256 (32 rows).
_Q_TILE_BYTES = 32 * 1024
# K (or V) tile budget: 64 keys x 128 dims in bf16. A program keeps two K/V tiles in flight
# during the math (three stages).
_KV_TILE_BYTES = 16 * 1024
_MIN_BLOCK_N = 16
_MAX_BLOCK_N = 64
# Eight warps (two Hopper warpgroups) once the Q tile reaches 128 x 128 elements: now only
# 16-bit queries at head_dim 256 (64 rows; not measured). At head_dim 128, 64-row tiles in
# eight warps were slower than in four (session 37).
_LARGE_Q_TILE = 128 * 128
_NUM_STAGES = 3


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Launch parameters of prefill attention."""

    block_m: int  # queries per program
    block_n: int  # keys per tile of the inner loop
    num_warps: int
    num_stages: int


def prefill_config(max_seqlen_q: int, head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Pick tile sizes from the head size, dtype and the longest query run.

    Short query runs (decode-like chunks, one-token prefix hits) get a smaller BLOCK_M
    so that little of the Q tile is padding.
    """
    element_size = dtype.itemsize
    row_bytes = head_dim * element_size
    block_m = min(_MAX_BLOCK_M, _Q_TILE_BYTES // row_bytes, triton.next_power_of_2(max_seqlen_q))
    block_m = max(_MIN_BLOCK_M, block_m)
    block_n = max(_MIN_BLOCK_N, min(_MAX_BLOCK_N, _KV_TILE_BYTES // row_bytes))
    num_warps = 8 if block_m * head_dim >= _LARGE_Q_TILE else 4
    return PrefillConfig(block_m, block_n, num_warps, _NUM_STAGES)
