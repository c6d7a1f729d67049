"""SamplingState: a step's sequences -> SamplingTensors, and the device state penalties need.

Per step, each sequence's SamplingParams are written into pinned host buffers and copied
to the device with the step's other inputs. Only what some request in the batch uses is
built: a batch that samples with temperature alone costs three [batch] copies (the
temperatures, and the key and position that its random draws are hashed from).

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
from operator import attrgetter

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Penalties, SamplingTensors
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams

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


class PenaltyTables:
    """Output-token counts and prompt-token masks, one row (slot) per sequence."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.owners: list[Sequence | None] = [None] * num_slots
        self.slot_of: dict[int, int] = {}  # seq_id -> slot

    def slot(self, seq: Sequence) -> tuple[int, bool]:
        """seq's slot, and whether it was just given one (its row must be cleared)."""
        slot = self.slot_of.get(seq.seq_id)
        if slot is not None:
            return slot, False
        free = next((i for i in range(FIRST_SLOT, len(self.owners))
                     if self.owners[i] is None or self.owners[i].is_finished), None)
        if free is None:  # more unfinished penalized sequences than slots (preemption): grow
            free = len(self.owners)
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.owners += [None] * free
        old = self.owners[free]
        if old is not None:
            del self.slot_of[old.seq_id]
        self.owners[free] = seq
        self.slot_of[seq.seq_id] = free
        return free, True


class SamplingState:
    def __init__(self, vocab_size: int, max_num_seqs: int, device: torch.device, eos_token_ids: frozenset[int]):
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.tables: PenaltyTables | None = None  # made when the first penalized request comes

    def prepare(self, seqs: list[Sequence], buffers) -> SamplingTensors:
        """The sampler's inputs for seqs, built in the step's buffers (HostBuffers). This
        runs every step for every row: what the batch uses is decided over its distinct
        SamplingParams (often one object for all), and each field is filled with one slice
        assignment (a single value when all rows share their parameters)."""
        b, n = buffers.np, len(seqs)
        params = [seq.params for seq in seqs]
        distinct = list({id(p): p for p in params}.values())

        def fill(name: str, value_of) -> None:
            b[name][:n] = value_of(distinct[0]) if len(distinct) == 1 else list(map(value_of, params))

        fill("temperatures", _temperature)
        b["sampling_keys"][:n] = [seq.sampling_key for seq in seqs]
        b["sampling_positions"][:n] = list(map(len, seqs))  # where the drawn token goes: len(token_ids)
        t = SamplingTensors(*(buffers.to_device(name, n) for name in ("temperatures", "sampling_keys", "sampling_positions")))
        if any(p.filters for p in distinct):
            row_top_k = functools.partial(_row_top_k, vocab_size=self.vocab_size)
            fill("top_k", row_top_k)
            fill("top_p", _top_p)
            fill("min_p", _min_p)
            t.filters = tuple(buffers.to_device(name, n) for name in ("top_k", "top_p", "min_p"))
            top_k = set(map(row_top_k, distinct))
            t.max_top_k, t.all_top_k = max(top_k), 0 not in top_k
        if any(p.logprobs is not None for p in distinct):
            t.num_logprobs = max(p.logprobs for p in distinct if p.logprobs is not None)
        if any(p.min_tokens for p in distinct) and any(seq.params.min_tokens > seq.num_completion_tokens for seq in seqs):
            t.banned = self._banned(seqs)
        if any(p.penalized for p in distinct):
            t.penalties = self._penalties(seqs, buffers, fill)
        return t

    def _banned(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """min_tokens: (row, token) pairs of end-of-sequence and stop tokens that rows
        still short of min_tokens may not draw."""
        rows, ids = [], []
        for i, seq in enumerate(seqs):
            params = seq.params
            if params.min_tokens > seq.num_completion_tokens:
                stops = set(params.stop_token_ids or ())
                if not params.ignore_eos:
                    stops |= self.eos_token_ids
                rows += [i] * len(stops)
                ids += sorted(stops)
        return self._index_pairs(rows, ids)

    def _index_pairs(self, rows: list[int], cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Two int64 index lists on the device, copied without waiting for the GPU."""
        pairs = torch.tensor([rows, cols], dtype=torch.int64)
        if self.device.type == "cuda":
            pairs = pairs.pin_memory().to(self.device, non_blocking=True)
        return pairs[0], pairs[1]

    def _penalties(self, seqs: list[Sequence], buffers, fill) -> Penalties:
        if self.tables is None:
            self.tables = PenaltyTables(FIRST_SLOT + self.max_num_seqs, self.vocab_size, self.device)
        tables, b, n = self.tables, buffers.np, len(seqs)
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
        b["penalty_slots"][:n] = slots
        # The slot that counts each row's sampled token: the sink for rows without
        # penalties and for prefill chunks that sample nothing.
        b["count_slots"][:n] = [
            slot if slot != NEUTRAL_SLOT and seq.num_cached_tokens + seq.num_scheduled_tokens == len(seq.token_ids)
            else SINK_SLOT for slot, seq in zip(slots, seqs)]
        fill("repetition", _repetition)
        fill("frequency", _frequency)
        fill("presence", _presence)
        if new_slots:
            b["new_slots"][: len(new_slots)] = new_slots
            fresh = buffers.to_device("new_slots", len(new_slots))
            tables.counts[fresh] = 0
            tables.in_prompt[fresh] = False
            tables.in_prompt[self._index_pairs(prompt_rows, prompt_ids)] = True
        self.count_slots = buffers.to_device("count_slots", n)
        return Penalties(
            tables.counts, tables.in_prompt, buffers.to_device("penalty_slots", n),
            *(buffers.to_device(name, n) for name in ("repetition", "frequency", "presence")),
        )

    def count(self, tokens: torch.Tensor, t: SamplingTensors) -> None:
        """After sampling: add each penalized row's token to its sequence's counts. A real
        slot occurs at most once per step (only the sink repeats, and it is never read),
        so a plain gather-add-scatter does; accumulate=True would take a sort on CUDA."""
        if t.penalties is not None:
            index = (self.count_slots, tokens)
            counts = self.tables.counts
            counts[index] = counts[index] + 1


def sampling_buffer_shapes(max_seqs: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Host buffers the per-step sampling inputs are built in, and those the logprobs
    come back in."""
    per_seq_float = ("temperatures", "top_p", "min_p", "repetition", "frequency", "presence", "lp_chosen")
    per_seq_int = ("top_k", "sampling_keys", "sampling_positions", "penalty_slots", "count_slots", "new_slots", "lp_rank")
    shapes = {name: ((max_seqs,), torch.float32) for name in per_seq_float}
    shapes.update({name: ((max_seqs,), torch.int64) for name in per_seq_int})
    shapes["lp_top_ids"] = ((max_seqs, MAX_LOGPROBS), torch.int64)
    shapes["lp_top_values"] = ((max_seqs, MAX_LOGPROBS), torch.float32)
    return shapes
