"""Per-request logits processors: what one request changes in its own row of the logits.

The sampler runs them after it has taken logprobs from the raw logits and before the
penalties, the temperature and the filters (sampler.py), so every sampling mode and
every completion of an n > 1 request respects them. A processor has two halves:

    prepare(seqs, params) -> inputs | None     host, every step: the inputs for the rows
                                               that need it, None when none does (the step
                                               then pays nothing for this processor)
    apply(logits, inputs) -> logits            device: change those rows

min_tokens is one. prepare runs while the previous step is still in flight, so a
sequence's last token may not be known yet (PENDING_TOKEN): min_tokens needs only the
count. A processor that needs the tokens themselves (a grammar matcher advancing on each
one, for a structured-output bitmask) must also make the engine read the step in flight
back before it launches the next, as LLMEngine.step already does before a schedule that
may preempt.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch

from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.utils.buffers import index_lists


class LogitsProcessor(ABC):
    @abstractmethod
    def prepare(self, seqs: SequenceABC[Sequence], params: list[SamplingParams]) -> Any | None:
        """This step's inputs for apply, from its sequences (row i is seqs[i]) and their
        distinct SamplingParams; None if no row needs this processor."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, inputs: Any) -> torch.Tensor:
        """logits [batch, vocab] with this processor's rows changed (a new tensor or the same)."""


class MinTokensProcessor(LogitsProcessor):
    """min_tokens: end-of-sequence and stop tokens may not be drawn while a sequence has
    fewer than min_tokens completion tokens."""

    def __init__(self, eos_token_ids: frozenset[int], device: torch.device):
        self.eos_token_ids = eos_token_ids
        self.device = device

    def prepare(self, seqs: SequenceABC[Sequence], params: list[SamplingParams]) -> torch.Tensor | None:
        """[2, m] (row, token id) pairs that may not be drawn."""
        if not any(p.min_tokens for p in params):
            return None
        rows, ids = [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.min_tokens > seq.num_completion_tokens:
                stops = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stops |= self.eos_token_ids
                rows += [i] * len(stops)
                ids += sorted(stops)
        return index_lists([rows, ids], self.device) if rows else None

    def apply(self, logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        return logits.index_put((banned[0], banned[1]),
                                torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
