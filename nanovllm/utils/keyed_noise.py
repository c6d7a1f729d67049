"""The sampler's random numbers: an Exp(1) draw per (key, position, token id), by hashing.

Sampling is the Gumbel-max trick in its exponential-race form: with E ~ Exp(1),
argmax(softmax(x / T) / E) = argmax(x / T - log E), so no softmax and no cumulative sum
are needed unless a filter asks for them. E is a hash of (the sequence's key, the token's
position, the token id): a seeded request (its key derives from the seed) draws the same
tokens whatever else is in the batch, and the draw fuses into the pass over the logits.

This module defines the draw once. The torch functions run inside the compiled sampling
paths (sampling/ops.py); the Triton samplers (kernels/sample.py, kernels/sample_filtered.py)
compute the same bits from the same constants, so every path gives the same token for a row.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Multiplier of a well-known 32-bit integer hash (xor-shift and multiply, twice, then a
# final xor-shift). It is below 2**27, so products of 32-bit values stay inside int64.
HASH_MULTIPLIER = 0x45D9F3B
# Uniforms take the top 23 bits of a 32-bit hash. With 24, the top value rounds to 1.0 in
# float32, its E to 0, and a token with that draw (one in 2**24: ~1% of rows over a 152k
# vocabulary) would always win.
UNIFORM_DROPPED_BITS = 9
UNIFORM_SCALE = 2.0**-23


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective mix of 32-bit values held in int64."""
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    return (x >> 16) ^ x


def open_unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) -> float32 uniforms strictly inside (0, 1)."""
    return ((bits >> UNIFORM_DROPPED_BITS).float() + 0.5) * UNIFORM_SCALE


def keyed_exponential(keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws that depend only on (key, position, token id): keys and positions
    [batch] int64, token_ids [batch, n] or [n] int64; returns [batch, n] float32."""
    row = hash32(hash32(hash32(keys & MASK32) ^ (keys >> 32)) ^ (positions & MASK32))
    bits = hash32(row.unsqueeze(1) ^ hash32(token_ids * 2 + 1 & MASK32))
    return -open_unit_interval(bits).log()
