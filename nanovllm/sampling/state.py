"""SamplingState: a step's sequences -> SamplingTensors, and the device state penalties need.

Per step, each sequence's SamplingParams are written into pinned host buffers and copied
to the device with the step's other inputs, a row per sampled token: one per sequence, and
one more per draft to verify (speculative decoding, engine/speculative.py), drawn at its
own position. Only what some request in the batch uses is
built: a batch that samples with temperature alone costs three [batch] copies (the
temperatures, and the key and position that its random draws are hashed from), or none
where a decode graph samples it (the graph's packed inputs carry them).

The penalties need, per sequence, how often each token was generated and whether it is in
the prompt. Both live on the device in [slots, vocab] tables: counts are incremented
right after each step samples (so they are correct while the tokens are still on their
way to the host), and a sequence's prompt tokens are marked when it gets its slot. Slot 0
is all zeros and serves rows without penalties; slot 1 absorbs the counts of rows that do
not count (no penalties, or a prefill chunk that samples nothing); a sequence keeps its
slot until it has finished.
"""
from __future__ import annotations

import functools
import weakref
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch

from nanovllm.sampling.logits_processors import (BadWordsProcessor, GrammarBitmaskProcessor, LogitsProcessor,
                                                  MinTokensProcessor, TokenBiasProcessor, draft_places)
from nanovllm.sampling.sampler import DraftPenalties, HostOutputs, Penalties, SamplingTensors
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.utils.buffers import DoubleBuffered, StagedBuffer, index_lists

NEUTRAL_SLOT, SINK_SLOT = 0, 1
FIRST_SLOT = 2


# Per-row values of a SamplingParams, as the sampler's tensors hold them.
_temperature = attrgetter("temperature")
_top_p = attrgetter("top_p")
_min_p = attrgetter("min_p")
_repetition = attrgetter("repetition_penalty")
_frequency = attrgetter("frequency_penalty")
_presence = attrgetter("presence_penalty")


def _row_top_k(p: SamplingParams, vocab_size: int) -> int:
    """top_k with 0 for none (also for top_k >= the vocabulary); a greedy row ignores its
    draw, and one candidate keeps the batch on the top-k path."""
    return 1 if p.greedy else p.top_k if 0 < p.top_k < vocab_size else 0


@dataclass(slots=True)
class SamplingInputs:
    """One step's per-row sampling parameters, staged on the host."""

    temperatures: StagedBuffer  # [rows] float32
    top_k: StagedBuffer  # [rows] int64
    top_p: StagedBuffer  # [rows] float32
    min_p: StagedBuffer  # [rows] float32
    keys: StagedBuffer  # [rows] int64: each row's draw key
    positions: StagedBuffer  # [rows] int64: where the drawn token goes
    repetition: StagedBuffer  # [rows] float32
    frequency: StagedBuffer  # [rows] float32
    presence: StagedBuffer  # [rows] float32
    penalty_slots: StagedBuffer  # [rows] int64: each row's slot in the penalty tables
    count_slots: StagedBuffer  # [rows] int64: the slot that counts each row's token
    new_slots: StagedBuffer  # [rows] int64: slots given out this step, to clear

    @classmethod
    def allocate(cls, rows: int, device: torch.device) -> SamplingInputs:
        def floats() -> StagedBuffer:
            return StagedBuffer((rows,), torch.float32, device)

        def ints() -> StagedBuffer:
            return StagedBuffer((rows,), torch.int64, device)

        return cls(temperatures=floats(), top_k=ints(), top_p=floats(), min_p=floats(), keys=ints(),
                   positions=ints(), repetition=floats(), frequency=floats(), presence=floats(),
                   penalty_slots=ints(), count_slots=ints(), new_slots=ints())


def rows_per_seq(seqs: list[Any]) -> list[int] | None:
    """The rows each sequence of a step (Sequence or StepSeq) samples, 1 + the drafts it
    verifies (speculative decoding); None where every sequence samples one. The LM head
    computes logits in the same rows (executor/inputs.py)."""
    counts = [1 + seq.num_draft_tokens for seq in seqs]
    return None if len(counts) == sum(counts) else counts


def sample_rows(seqs: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
    """A step's sampled rows, each as its sequence (repeated for each draft it verifies), and
    rows_per_seq."""
    counts = rows_per_seq(seqs)
    if counts is None:
        return seqs, None
    return [seq for seq, count in zip(seqs, counts) for _ in range(count)], counts


class PenaltyTables:
    """Output-token counts and prompt-token masks, one row (slot) per sequence."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        # Each slot's sequence (its id, and a weak reference: a finished sequence's tokens and
        # outputs are not kept alive by a slot that may not be handed out again for long).
        self.owners: list[tuple[int, weakref.ref[Sequence]] | None] = [None] * num_slots
        self.slot_of: dict[int, int] = {}  # seq_id -> slot

    def slot(self, seq: Sequence) -> tuple[int, bool]:
        """seq's slot, and whether it was just given one (its row must be cleared)."""
        slot = self.slot_of.get(seq.seq_id)
        if slot is not None:
            return slot, False
        free = next((i for i in range(FIRST_SLOT, len(self.owners)) if self._is_free(i)), None)
        if free is None:  # more unfinished penalized sequences than slots (preemption): grow
            free = len(self.owners)
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.owners += [None] * free
        old = self.owners[free]
        if old is not None:
            del self.slot_of[old[0]]
        self.owners[free] = (seq.seq_id, weakref.ref(seq))
        self.slot_of[seq.seq_id] = free
        return free, True

    def _is_free(self, slot: int) -> bool:
        """Whether a slot can be handed out: never given, or its sequence finished or gone."""
        if self.owners[slot] is None:
            return True
        owner = self.owners[slot][1]()
        return owner is None or owner.is_finished


class SamplingState:
    def __init__(self, vocab_size: int, max_num_seqs: int, device: torch.device, max_logprobs: int = 20,
                 max_drafts: int = 0):
        """max_drafts: the most drafts a sequence verifies in a step (speculative decoding)."""
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.device = device
        max_rows = max_num_seqs * (1 + max_drafts)
        self.buffers = DoubleBuffered(lambda: (SamplingInputs.allocate(max_rows, device),
                                               HostOutputs.allocate(max_rows, max_logprobs, device)))
        # Applied in this order, before penalties and temperature (the sampler's hook).
        self.min_tokens = MinTokensProcessor(frozenset(), device)  # its eos ids: set_eos_token_ids
        self.logits_processors: list[LogitsProcessor] = [
            self.min_tokens, TokenBiasProcessor(device), BadWordsProcessor(device),
            GrammarBitmaskProcessor(max_rows, device)]
        self.tables: PenaltyTables | None = None  # made when the first penalized request comes

    def set_eos_token_ids(self, eos_token_ids: frozenset[int]) -> None:
        self.min_tokens.eos_token_ids = eos_token_ids

    def prepare(self, seqs: list[Sequence], defer_late: bool = False, graph_samples: bool = False
                ) -> SamplingTensors:
        """The sampler's inputs for seqs, built in the next set of buffers. This runs every
        step for every row: what the batch uses is decided over its distinct
        SamplingParams (often one object for all), and each field is filled with one slice
        assignment (a single value when all rows share their parameters). `defer_late`
        leaves out the logits processors that read the previous step's tokens, for
        prepare_late to add once they are known. `graph_samples`: a decode graph will
        sample the batch if it needs nothing beyond temperatures and keys, taking them
        from the host arrays; then they are not sent to the device on their own."""
        (b, outputs), (seqs, seq_rows) = self.buffers.flip(), sample_rows(seqs)
        n = len(seqs)
        # Where each drawn token goes: after the sequence's known tokens and the drafts before its row.
        positions = list(map(len, seqs)) if seq_rows is None else [
            len(seq) - seq.num_draft_tokens + place for seq, place in zip(seqs, draft_places(seqs))]
        params = [seq.params for seq in seqs]
        distinct = list({id(p): p for p in params}.values())

        def stage(buffer: StagedBuffer, value_of) -> None:
            buffer.np[:n] = value_of(distinct[0]) if len(distinct) == 1 else list(map(value_of, params))

        def fill(buffer: StagedBuffer, value_of) -> torch.Tensor:
            stage(buffer, value_of)
            return buffer.to_device(n)

        stage(b.temperatures, _temperature)
        b.keys.np[:n] = [seq.sampling_key for seq in seqs]
        b.positions.np[:n] = positions
        t = SamplingTensors(None, outputs=outputs, host_temperatures=b.temperatures.np[:n], host_keys=b.keys.np[:n],
                            seq_rows=seq_rows)
        if any(p.filters for p in distinct):
            row_top_k = functools.partial(_row_top_k, vocab_size=self.vocab_size)
            t.filters = (fill(b.top_k, row_top_k), fill(b.top_p, _top_p), fill(b.min_p, _min_p))
            top_k = set(map(row_top_k, distinct))
            t.max_top_k, t.all_top_k = max(top_k), 0 not in top_k
        if any(p.logprobs is not None for p in distinct):
            t.num_logprobs = max(p.logprobs for p in distinct if p.logprobs is not None)
        t.logits_processors = self._processor_inputs(seqs, distinct, late=False if defer_late else None)
        if any(p.penalized for p in distinct):
            t.penalties = self._penalties(seqs, b, fill)
        t.in_graph = graph_samples and t.is_fast
        if not t.in_graph:
            t.temperatures, t.keys, t.positions = (buffer.to_device(n) for buffer in (b.temperatures, b.keys,
                                                                                        b.positions))
        return t

    def prepare_late(self, t: SamplingTensors, seqs: list[Sequence]) -> None:
        """Add to t (from prepare(seqs, defer_late=True)) the logits processors that read
        the previous step's tokens, now that they are on the host."""
        if t.in_graph:  # a graph that samples would not see them
            raise ValueError("prepare_late is for tensors prepared with defer_late, not for a decode graph's sampling")
        distinct = list({id(seq.params): seq.params for seq in seqs}.values())
        t.logits_processors += self._processor_inputs(sample_rows(seqs)[0], distinct, late=True)

    def _processor_inputs(self, seqs: list[Sequence], distinct: list[SamplingParams], late: bool | None
                          ) -> tuple[tuple[LogitsProcessor, Any], ...]:
        """(processor, inputs) of the logits processors with rows in this batch: those that
        read the previous step's tokens (late=True), the others (False), or all (None)."""
        return tuple((processor, inputs) for processor in self.logits_processors
                     if (late is None or processor.reads_last_token == late)
                     and (inputs := processor.prepare(seqs, distinct)) is not None)

    def _penalties(self, seqs: list[Sequence], b: SamplingInputs, fill) -> Penalties:
        if self.tables is None:
            self.tables = PenaltyTables(FIRST_SLOT + self.max_num_seqs, self.vocab_size, self.device)
        tables, n = self.tables, len(seqs)
        slot_of = tables.slot_of
        slots = [slot_of.get(seq.seq_id, NEUTRAL_SLOT) for seq in seqs]
        new_slots, prompt_rows, prompt_ids = [], [], []
        for i, seq in enumerate(seqs):
            if slots[i] == NEUTRAL_SLOT and seq.params.penalized:  # penalized, no slot yet
                slots[i], new = tables.slot(seq)
                if new:
                    new_slots.append(slots[i])
                    prompt_rows += [slots[i]] * seq.num_prompt_tokens
                    prompt_ids += seq.prompt_token_ids
        b.penalty_slots.np[:n] = slots
        # The slot that counts each row's sampled token: the sink for rows without
        # penalties and for prefill chunks that sample nothing.
        b.count_slots.np[:n] = [
            slot if slot != NEUTRAL_SLOT and seq.step_samples else SINK_SLOT for slot, seq in zip(slots, seqs)]
        drafts = self._draft_penalties(seqs) if any(s.num_draft_tokens for s in seqs) else None
        if new_slots:
            b.new_slots.np[: len(new_slots)] = new_slots
            fresh = b.new_slots.to_device(len(new_slots))
            tables.counts[fresh] = 0
            tables.in_prompt[fresh] = False
            marks = index_lists([prompt_rows, prompt_ids], self.device)
            tables.in_prompt[marks[0], marks[1]] = True
        return Penalties(tables.counts, tables.in_prompt, b.penalty_slots.to_device(n),
                         fill(b.repetition, _repetition), fill(b.frequency, _frequency), fill(b.presence, _presence),
                         b.count_slots.to_device(n), drafts)

    def _draft_penalties(self, rows: list[Sequence]) -> DraftPenalties:
        """For rows where some verify drafts: the (row, token, times) the drafts before a
        penalized row add to its counts, each row's next draft and its sequence's first row."""
        fixes: list[tuple[int, int, int]] = []
        next_drafts, first_rows = [], []
        for i, (seq, place) in enumerate(zip(rows, draft_places(rows))):
            drafts = seq.drafts
            next_drafts.append(drafts[place] if place < len(drafts) else -1)
            first_rows.append(i - place)
            if place and seq.params.penalized:
                fixes += [(i, token, extra) for token, extra in Counter(drafts[:place]).items()]
        fixed = index_lists(list(zip(*fixes)) if fixes else [[], [], []], self.device)
        next_drafts, first_rows = index_lists([next_drafts, first_rows], self.device)
        return DraftPenalties(tuple(fixed), next_drafts, first_rows)

    def count(self, tokens: torch.Tensor, t: SamplingTensors) -> None:
        """After sampling: add each penalized row's token to its sequence's counts. Without
        drafts a real slot occurs at most once per step (only the sink repeats, and it is
        never read), so a plain gather-add-scatter does; accumulate=True would take a sort
        on CUDA. With drafts a sequence's kept rows each add theirs."""
        if t.penalties is not None:
            slots, counts = t.penalties.count_slots, self.tables.counts
            if t.penalties.drafts is None:
                counts[slots, tokens] = counts[slots, tokens] + 1
            else:  # the rows of a sequence each count a token: the kept ones, maybe the same twice
                slots = t.penalties.drafts.kept_slots(tokens, slots, SINK_SLOT)
                counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
