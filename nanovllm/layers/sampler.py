"""Sampler: next tokens for a whole batch at once from the last-token logits.

Every per-request parameter arrives as a [batch] tensor (SamplingTensors); parts that no
request in the batch uses are None and cost nothing. The order follows vLLM: logprobs
are taken from the raw logits; then min_tokens bans end-of-sequence and stop tokens,
the repetition / frequency / presence penalties apply, greedy rows take the argmax and
the others divide by their temperature, keep min-p, top-k and then top-p of what is
left, and draw.

Drawing is the Gumbel-max trick in its exponential-race form: with E ~ Exp(1),
argmax(softmax(x / T) / E) = argmax(x / T - log E), so no softmax and no cumulative sum
are needed unless a filter asks for them. E comes from torch's generator, or, when a
request in the batch is seeded, from a hash of (the request's key, the token's position,
the token id): the same draw whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.utils.compile import maybe_compile

MASK32 = 0xFFFFFFFF
# Multiplier of a well-known 32-bit integer hash (xor-shift-multiply, three rounds). It is
# below 2**27, so products of 32-bit values stay inside int64.
HASH_MULTIPLIER = 0x45D9F3B


@dataclass(slots=True)
class Penalties:
    output_counts: torch.Tensor  # [batch, vocab] int32: times each token was generated
    in_prompt: torch.Tensor  # [batch, vocab] bool: the token occurs in the prompt
    repetition: torch.Tensor  # [batch] float32 (1 = off)
    frequency: torch.Tensor  # [batch] float32
    presence: torch.Tensor  # [batch] float32


@dataclass(slots=True)
class SamplingTensors:
    temperatures: torch.Tensor  # [batch] float32, 0 = greedy
    # top_k [batch] int64 (0 = off), top_p [batch], min_p [batch]: all three or none.
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    max_top_k: int = 0  # the largest top_k, 0 when some row has none (then the whole vocabulary is sorted)
    penalties: Penalties | None = None
    keys: torch.Tensor | None = None  # [batch] int64 per-request keys, when any request is seeded
    positions: torch.Tensor | None = None  # [batch] int64 position of the token being drawn
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [m], token ids [m]) that may not be drawn
    num_logprobs: int | None = None  # alternatives to return per row; None: no logprobs


@dataclass(slots=True)
class SampledLogprobs:
    """Log-softmax of the raw logits around each sampled token, on the device."""

    chosen: torch.Tensor  # [batch] float32: the sampled token's logprob
    rank: torch.Tensor  # [batch] int64: 1 + how many tokens are more likely
    top_ids: torch.Tensor  # [batch, num_logprobs] int64, most likely first
    top_values: torch.Tensor  # [batch, num_logprobs] float32


@dataclass(slots=True)
class StepLogprobs:
    """SampledLogprobs copied to the host, read row by row."""

    chosen: list[float]
    rank: list[int]
    top_ids: list[list[int]]
    top_values: list[list[float]]

    def row(self, i: int) -> tuple[float, int, list[int], list[float]]:
        return self.chosen[i], self.rank[i], self.top_ids[i], self.top_values[i]


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective mix of 32-bit values held in int64."""
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    return (x >> 16) ^ x


@maybe_compile
def keyed_exponential(keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws that depend only on (key, position, token id): keys and positions
    [batch] int64, token_ids [batch, n] or [n] int64; returns [batch, n] float32."""
    row = _hash32(_hash32(_hash32(keys & MASK32) ^ (keys >> 32)) ^ (positions & MASK32))
    bits = _hash32(row.unsqueeze(1) ^ _hash32(token_ids * 2 + 1 & MASK32))
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 random bits, strictly inside (0, 1)
    return -uniform.log()


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition (on prompt and output tokens, transformers' rule), then frequency and
    presence (on output tokens, OpenAI's rule)."""
    return _penalize(logits, p.output_counts, p.in_prompt, p.repetition, p.frequency, p.presence)


@maybe_compile
def _penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    seen = (counts > 0) | in_prompt
    repetition = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)


@maybe_compile
def _sample_unfiltered(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """The fast path: one fused pass over [batch, vocab] logits."""
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
    if noise is None:
        noise = torch.empty_like(scaled).exponential_(1.0)
    sampled = (scaled - noise.log()).argmax(dim=-1)
    return torch.where(temperatures == 0, greedy, sampled)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """logits: [batch, vocab]. Returns the [batch] int64 token ids and, when asked
        for, their logprobs."""
        logits = logits.float()
        logprobs = None
        if t.num_logprobs is not None:
            logprobs = logits.log_softmax(dim=-1)
        if t.banned is not None:
            logits = logits.index_put(t.banned, torch.full((), float("-inf"), device=logits.device))
        if t.penalties is not None:
            logits = apply_penalties(logits, t.penalties)
        if t.filters is None:
            noise = None if t.keys is None else self._noise(t, torch.arange(logits.size(-1), device=logits.device))
            tokens = _sample_unfiltered(logits, t.temperatures, noise)
        else:
            tokens = self._sample_filtered(logits, t)
        if logprobs is None:
            return tokens, None
        return tokens, self._logprobs(logprobs, tokens, t.num_logprobs)

    @staticmethod
    def _noise(t: SamplingTensors, token_ids: torch.Tensor) -> torch.Tensor:
        return keyed_exponential(t.keys, t.positions, token_ids)

    def _sample_filtered(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Draw among each row's candidates: the max_top_k most likely tokens (top-k
        itself when every row sets it, which avoids sorting the whole vocabulary), with
        min-p, then top-k, then top-p (over the renormalized remainder) masked out."""
        top_k, top_p, min_p = t.filters
        greedy = logits.argmax(dim=-1)
        scaled = logits / t.temperatures.clamp(min=1e-5).unsqueeze(1)
        vocab = scaled.size(-1)
        if 0 < t.max_top_k < vocab:
            values, ids = scaled.topk(t.max_top_k, dim=-1)  # [batch, k], most likely first
        else:
            values, ids = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(values.size(-1), device=values.device)
        k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
        # min-p: probability relative to the most likely token, exp(x - x_max) < min_p.
        drop = (rank >= k) | ((values - values[:, :1]).exp() < min_p.unsqueeze(1))
        drop[:, 0] = False
        values = values.masked_fill(drop, float("-inf"))
        probs = values.softmax(dim=-1)
        # top-p: drop a token once the mass ranked before it reaches p.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        values = values.masked_fill(drop, float("-inf"))
        noise = torch.empty_like(values).exponential_(1.0) if t.keys is None else self._noise(t, ids)
        choice = (values - noise.log()).argmax(dim=-1, keepdim=True)
        return torch.where(t.temperatures == 0, greedy, ids.gather(1, choice).squeeze(1))

    @staticmethod
    def _logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num: int) -> SampledLogprobs:
        chosen = logprobs.gather(1, tokens.unsqueeze(1))  # [batch, 1]
        rank = (logprobs > chosen).sum(dim=-1) + 1
        top_values, top_ids = logprobs.topk(num, dim=-1) if num > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
        return SampledLogprobs(chosen.squeeze(1), rank, top_ids, top_values)
