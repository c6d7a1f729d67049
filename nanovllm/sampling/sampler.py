"""Sampler: next tokens for a whole batch at once from the last-token logits.

Every per-request parameter arrives as a [batch] tensor (SamplingTensors); parts that no
request in the batch uses are None and cost nothing. The order follows vLLM: logprobs
are taken from the raw logits; then the per-request logits processors run
(logits_processors.py: min_tokens' bans, allowed token ids with logit_bias, bad words,
the grammars' bitmasks), the repetition / frequency / presence penalties apply, greedy
rows take the argmax and the others divide by their temperature, keep min-p, top-k and
then top-p of what is left, and draw with the keyed noise of utils/keyed_noise.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from nanovllm.sampling.logits_processors import LogitsProcessor
from nanovllm.sampling.ops import (
    MIN_COMPILED_K, apply_penalties, chunk_width, penalized, sample_fast, sample_nucleus, sample_top_k,
)
from nanovllm.utils.env import env_flag


# On CUDA filtered batches take kernels/sample_filtered.py, which needs no compile at a
# server's start-up; NANOVLLM_SAMPLER_KERNEL=0 takes the compiled paths instead.
FILTERED_KERNEL = env_flag("NANOVLLM_SAMPLER_KERNEL", True)


@dataclass(slots=True)
class Penalties:
    output_counts: torch.Tensor  # [slots, vocab] int32: times each token was generated, per sequence
    in_prompt: torch.Tensor  # [slots, vocab] bool: the token occurs in the sequence's prompt
    rows: torch.Tensor  # [batch] int64: each row's slot in the two tables
    repetition: torch.Tensor  # [batch] float32 (1 = off)
    frequency: torch.Tensor  # [batch] float32
    presence: torch.Tensor  # [batch] float32
    count_slots: torch.Tensor | None = None  # [batch] int64: where each row's sampled token is counted
    drafts: DraftPenalties | None = None  # a step that verifies drafts of penalized sequences

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.output_counts, self.in_prompt, self.rows, self.repetition, self.frequency, self.presence


@dataclass(slots=True)
class DraftPenalties:
    """Penalties on a step whose rows follow drafts (speculative decoding): a row after its
    sequence's j-th draft counts the first j drafts as output too, and only the tokens the
    step keeps are counted."""

    fixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, token ids, drafts of it before the row) [m] int64
    next_drafts: torch.Tensor  # [batch] int64: the draft after each row (-1: none), which its token must equal
    first_rows: torch.Tensor  # [batch] int64: each row's sequence's first row

    def penalize(self, before: torch.Tensor, after: torch.Tensor, p: Penalties) -> torch.Tensor:
        """`after` (apply_penalties of `before`) with each fixed (row, token) penalized as by
        penalize (sampling/ops.py) at its count plus the drafts before the row."""
        rows, ids, extra = self.fixes
        logits, slots = before[rows, ids].float(), p.rows[rows]
        counts = p.output_counts[slots, ids] + extra  # >= 1: seen
        return after.index_put((rows, ids), penalized(logits, None, counts, p.repetition[rows], p.frequency[rows],
                                                      p.presence[rows]))

    def kept_slots(self, tokens: torch.Tensor, count_slots: torch.Tensor, sink: int) -> torch.Tensor:
        """count_slots where a row's token is kept (every row of its sequence before it drew
        its next draft), else sink: on the device, before the step is read."""
        missed = (tokens != self.next_drafts).int()
        before = missed.cumsum(0) - missed  # rows before each that missed their draft
        return torch.where(before == before[self.first_rows], count_slots, sink)


@dataclass(slots=True)
class SamplingTensors:
    # [batch] float32, 0 = greedy. None (keys and positions too): a batch that a decode
    # graph samples from host_temperatures and host_keys, never sent on their own.
    temperatures: torch.Tensor | None
    # The random draws hash these: [batch] int64 per-sequence keys (from the seed when
    # there is one) and positions of the tokens being drawn. None: random keys, for tensors
    # that the tests and benchmarks/bench_sampler.py build (the engine's always have keys).
    keys: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    # top_k [batch] int64 (0 = off), top_p [batch], min_p [batch]: all three or none.
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    max_top_k: int = 0  # the largest top_k of any row; 0: no row sets one
    all_top_k: bool = False  # every row sets top_k (its draw needs only the max_top_k best candidates)
    penalties: Penalties | None = None
    # The per-request logits processors that have rows in this batch, with their inputs.
    logits_processors: tuple[tuple[LogitsProcessor, Any], ...] = ()
    num_logprobs: int | None = None  # alternatives to return per row; None: no logprobs
    outputs: HostOutputs | None = None  # where this step's tokens (and logprobs) are copied to the host
    # The temperatures and keys as numpy arrays on the host (the decode graphs pack them).
    host_temperatures: np.ndarray | None = None  # [batch] float32
    host_keys: np.ndarray | None = None  # [batch] int64
    # A decode graph samples this batch (SamplingState.prepare decides, once): it needs
    # nothing beyond temperatures and keys, which the graph takes from the host arrays.
    in_graph: bool = False
    # Rows per sequence where some verify drafts (speculative decoding: 1 + its drafts);
    # None: a row each.
    seq_rows: list[int] | None = None

    @property
    def is_fast(self) -> bool:
        """Temperature (and keys) only: what sample_fast does."""
        return ((self.keys is not None or self.host_keys is not None) and self.filters is None and self.penalties is None
                and not self.logits_processors and self.num_logprobs is None)


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


@dataclass(slots=True)
class HostOutputs:
    """Host copies of what one step samples, pinned on CUDA so the copies do not wait. A
    LaunchedStep reads them until the step after next reuses them (SamplingState keeps
    two sets, and the engine reads step N back before it prepares step N + 2)."""

    tokens: torch.Tensor  # [rows] int64
    chosen_logprob: torch.Tensor  # [rows] float32
    chosen_rank: torch.Tensor  # [rows] int64
    top_ids: torch.Tensor  # [rows, max_logprobs] int64
    top_logprobs: torch.Tensor  # [rows, max_logprobs] float32

    @classmethod
    def allocate(cls, rows: int, max_logprobs: int, device: torch.device) -> HostOutputs:
        pin = device.type == "cuda"
        return cls(
            tokens=torch.empty(rows, dtype=torch.int64, pin_memory=pin),
            chosen_logprob=torch.empty(rows, dtype=torch.float32, pin_memory=pin),
            chosen_rank=torch.empty(rows, dtype=torch.int64, pin_memory=pin),
            top_ids=torch.empty(rows, max_logprobs, dtype=torch.int64, pin_memory=pin),
            top_logprobs=torch.empty(rows, max_logprobs, dtype=torch.float32, pin_memory=pin),
        )

    def copy(self, tokens: torch.Tensor, logprobs: SampledLogprobs | None
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Queue the copies of a step's tokens (and logprobs); they are complete once the
        device has passed this point. Returns the host views that will hold them."""
        n = tokens.size(0)
        host_tokens = self.tokens[:n]
        host_tokens.copy_(tokens, non_blocking=True)
        if logprobs is None:
            return host_tokens, None
        width = logprobs.top_ids.size(1)
        copies = []
        for target, value in ((self.chosen_logprob[:n], logprobs.chosen), (self.chosen_rank[:n], logprobs.rank),
                              (self.top_ids[:n, :width], logprobs.top_ids),
                              (self.top_logprobs[:n, :width], logprobs.top_values)):
            target.copy_(value, non_blocking=True)
            copies.append(target)
        return host_tokens, tuple(copies)


def logprobs_around(logprobs: torch.Tensor, tokens: torch.Tensor, num: int) -> SampledLogprobs:
    """From [rows, vocab] log-softmax values: each row's token's, its rank, and the `num`
    most likely tokens' (the sampled tokens', or the prompt tokens' each row predicts)."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))  # [rows, 1]
    rank = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num, dim=-1) if num > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
    return SampledLogprobs(chosen.squeeze(1), rank, top_ids, top_values)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """logits: [batch, vocab]. Returns the [batch] int64 token ids and, when asked
        for, their logprobs."""
        logprobs = None
        if t.num_logprobs is not None:
            logprobs = logits.float().log_softmax(dim=-1)
        for processor, inputs in t.logits_processors:
            logits = processor.apply(logits, inputs)
        keys, positions = t.keys, t.positions
        if keys is None:
            keys = torch.randint(0, 1 << 62, (logits.size(0),), device=logits.device)
            positions = torch.zeros_like(keys)
        if t.penalties is not None:
            applied = apply_penalties(logits, t.penalties.as_tuple())
            drafts = t.penalties.drafts
            logits = applied if drafts is None else drafts.penalize(logits, applied, t.penalties)
        if t.filters is None:
            tokens = sample_fast(logits, t.temperatures, keys, positions)
        else:
            tokens = self._sample_filtered(logits, t, keys, positions)
        if logprobs is None:
            return tokens, None
        return tokens, logprobs_around(logprobs, tokens, t.num_logprobs)

    @staticmethod
    def _sample_filtered(logits: torch.Tensor, t: SamplingTensors, keys: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
        """On CUDA the Triton kernel; elsewhere (or with NANOVLLM_SAMPLER_KERNEL=0) the
        compiled paths: top-k on every row, or the sort-free filters. torch.compile specializes a
        size of 1, so one row goes in twice: batch 1 shares the graphs of larger batches
        instead of compiling each path again (warm_up compiles both)."""
        if logits.is_cuda and FILTERED_KERNEL:  # one Triton kernel, nothing compiled
            from nanovllm.kernels.sample_filtered import sample_filtered_tokens  # imports triton: only on CUDA

            return sample_filtered_tokens(logits, t.temperatures, *t.filters, keys, positions)
        # Always float32 (penalized logits are): torch.compile would compile each path once
        # per dtype. The paths take .float() first anyway; here it costs one pass more.
        logits = logits.float()
        temperatures, filters, one = t.temperatures, t.filters, logits.size(0) == 1
        if one:
            logits, temperatures, keys, positions = (x.repeat(2, *[1] * (x.dim() - 1))
                                                     for x in (logits, temperatures, keys, positions))
            filters = tuple(x.repeat(2) for x in filters)
        vocab_size = logits.size(-1)
        # The rows' own top_k tensors cut; k only sizes the candidate set, so it is never
        # below MIN_COMPILED_K (a top_k of 1, or none, would each compile again).
        k = min(max(t.max_top_k, MIN_COMPILED_K), vocab_size)
        width = chunk_width(vocab_size, k)
        if t.all_top_k and t.max_top_k < vocab_size:  # only the k best candidates matter
            tokens = sample_top_k(logits, temperatures, filters, keys, positions, k, width)
        else:
            tokens = sample_nucleus(logits, temperatures, filters, keys, positions, k, width)
        return tokens[:1] if one else tokens

    def warm_up(self, vocab_size: int, device: torch.device, dtype: torch.dtype) -> None:
        """Run both compiled paths once, top-k on every row and the sort-free filters (batch
        1 runs as two rows, so one batch size covers all; they always take float32), or the
        filtered kernel on the model's dtype and on penalized (float32) logits, and the
        penalty kernel. The compiles then happen here rather than when the first such
        request joins a running batch."""
        batch = 2
        logits = torch.randn(batch, vocab_size, device=device, dtype=dtype)
        ones = torch.ones(batch, device=device)
        keys = torch.arange(batch, device=device)
        positions = keys + 1  # not keys itself: a compiled function guards on which arguments alias
        counts = torch.zeros(batch + 2, vocab_size, dtype=torch.int32, device=device)
        penalties = Penalties(counts, counts > 0, keys + 2, ones * 1.1, ones * 0.1, ones * 0.1)
        filters = (torch.full((batch,), 2, device=device), ones * 0.9, ones * 0.05)
        for all_top_k in (True, False):
            self(logits, SamplingTensors(ones, keys, positions, filters, 2, all_top_k))
        self(logits, SamplingTensors(ones, keys, positions, penalties=penalties))
        self(logits, SamplingTensors(ones, keys, positions, filters, 2, True, penalties=penalties))
