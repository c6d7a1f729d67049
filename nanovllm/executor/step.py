"""The records of one step as the executor sees it: what each rank computes from, and what
rank 0 hands back while the GPU still runs it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nanovllm.sampling.sampler import SamplingTensors, StepLogprobs
from nanovllm.sequence import Sequence


@dataclass(slots=True)
class StepSeq:
    """One sequence of a step as every tensor-parallel rank sees it: what building the
    step's inputs reads of a Sequence, without the token history."""

    scheduled_token_ids: list[int]  # the tokens computed this step (PENDING_TOKEN: not on the host yet)
    num_cached_tokens: int  # tokens before them whose K/V is cached
    block_table: list[int]
    prev_row: int = -1  # a pending last token's row in the previous step's sampled tokens
    prompt_logprob_rows: tuple[int, list[int]] | None = None  # Sequence.prompt_logprob_rows
    num_draft_tokens: int = 0  # the last scheduled tokens are drafts: their rows are sampled too

    @staticmethod
    def pack(seq: Sequence, prev_row: int = -1) -> tuple:
        """The fields of `seq` as a plain tuple (the cheapest thing to pickle); StepSeq(*t) rebuilds it."""
        return (seq.scheduled_token_ids, seq.num_cached_tokens, seq.block_table, prev_row, seq.prompt_logprob_rows,
                seq.num_draft_tokens)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.scheduled_token_ids)

    @property
    def last_token(self) -> int:
        return self.scheduled_token_ids[-1]

    def __len__(self) -> int:
        return self.num_cached_tokens + len(self.scheduled_token_ids)


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt logprobs one step computed, copied to the host (complete once the step's
    tokens are). Rows follow `spans`, one span per sequence that asked."""

    spans: list[tuple[int, int, int]]  # (the sequence's row in the step, position of the first row, rows)
    host: tuple[torch.Tensor, ...]  # SampledLogprobs' fields over all rows: chosen, rank, top ids, top values

    def read(self) -> StepLogprobs:
        """Row by row, on the host (after its LaunchedStep's wait())."""
        return StepLogprobs(*(t.tolist() for t in self.host))


@dataclass(slots=True)
class LaunchedStep:
    """A step whose kernels are queued; its sampled tokens arrive in `host_tokens`."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [num_seqs] int64 on the device
    host_tokens: torch.Tensor  # [num_seqs] int64 host copy, complete once `done` has passed
    done: torch.cuda.Event | None  # None on CPU, where the copy is synchronous
    host_logprobs: tuple[torch.Tensor, ...] | None = None  # SampledLogprobs' fields, host copies
    prompt_logprobs: PromptLogprobs | None = None  # of the sequences that asked (executor/prompt_logprobs.py)
    seq_rows: list[int] | None = None  # rows per sequence where some verify drafts (SamplingTensors.seq_rows)
    rows: dict[int, int] = field(default_factory=dict)  # seq_id -> row, filled on demand

    def wait(self) -> None:
        """Block until the step's host copies (tokens, logprobs, prompt logprobs) are complete."""
        if self.done is not None:
            self.done.synchronize()

    def token_ids(self) -> list[int]:
        self.wait()
        return self.host_tokens.tolist()

    def logprobs(self) -> StepLogprobs | None:
        """The sampled tokens' logprobs, if any request asked."""
        if self.host_logprobs is None:
            return None
        self.wait()
        return StepLogprobs(*(t.tolist() for t in self.host_logprobs))

    def row_of(self, seq: Sequence) -> int:
        assert self.seq_rows is None, "a step that verified drafts is read before the next is built"
        if not self.rows:
            self.rows.update((s.seq_id, i) for i, s in enumerate(self.seqs))
        return self.rows[seq.seq_id]


class ForwardOutput(NamedTuple):
    """What ModelRunner.forward queued: each sequence's last-token logits ([num_seqs,
    vocab] on rank 0, None on the others), the tokens a decode graph sampled (else None),
    and the prompt logprobs of the sequences that want them."""

    logits: torch.Tensor | None
    tokens: torch.Tensor | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class ForwardedStep:
    """A step whose model kernels are queued and whose sampling is not yet (see
    Executor.forward), on rank 0."""

    seqs: list[Sequence]
    output: ForwardOutput
    sampling: SamplingTensors  # all but the logits processors that read the tokens before


@dataclass(slots=True)
class SharedTokens:
    """The previous step's sampled tokens as a tensor-parallel rank holds them (rank 0's
    own, a worker's broadcast copy); each StepSeq record names its row."""

    tokens: torch.Tensor  # [previous step's num_seqs] int64 on the device

    def row_of(self, seq: StepSeq) -> int:
        return seq.prev_row


# The step whose sampled tokens a decode step's pending last tokens come from.
PreviousTokens = LaunchedStep | SharedTokens
