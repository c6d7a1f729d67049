"""Rotary position embedding (rotate-half layout, as Qwen and Llama use), with the
rope scalings their checkpoints ship: none, "linear", "llama3" (Llama 3.1+) and
"yarn" (Qwen2.5/Qwen3 long-context configs).

The parameters come as config.get_rope_parameters reads them (a dict holding rope_type,
rope_theta and the scaling fields); config.model_context_length says how many positions
the table holds.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nanovllm.utils.compile import maybe_compile


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any], head_dim: int, base: float,
                   max_pos: int) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate low frequencies, extrapolate high ones, a linear ramp between,
    # and scale attention by the returned factor.
    factor = p["factor"]
    old_len = p.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict[str, Any],
                 num_positions: int | None = None):
        """max_position: the config's max_position_embeddings; num_positions: the table's
        rows (config.model_context_length, which a linear or YaRN scaling stretches),
        max_position where None."""
        super().__init__()
        self.head_dim = head_dim
        base = float(rope_parameters["rope_theta"])
        rope_type = rope_parameters["rope_type"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        attention_factor = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / rope_parameters["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(inv_freq, rope_parameters, head_dim, base, max_position)
        elif rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, yarn")
        positions = torch.arange(num_positions or max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [num_positions, head_dim / 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor  # [num_positions, head_dim]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    @maybe_compile
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, head_dim / 2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
