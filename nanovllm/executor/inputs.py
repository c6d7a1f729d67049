"""A step's model inputs: the scheduled sequences packed into tensors, and the forward
context that every attention layer reads (utils/context.py).

Prefill packs each sequence's scheduled tokens (after its cached prefix) along one axis.
Sequence A with 4 cached tokens and 2 new ones, B with 3 new ones:

    input_ids    = [a4, a5, b0, b1, b2]      positions = [4, 5, 0, 1, 2]
    cu_seqlens_q = [0, 2, 5]                 cu_seqlens_k = [0, 6, 9]
    slot_mapping = flat cache slot of each new token (block id * block_size + offset)
    block_tables = [[A's blocks], [B's blocks, -1, ...]]

Decode has one token per sequence: its last, at position len - 1, seeing len tokens
(context_lens), block tables padded with -1. A last token still pending on the host (the
engine launches a step before it reads the previous one's tokens) is taken from the
previous step's sampled tokens on the device; in a prefill step too, where a decoding
sequence is a one-token chunk.

Everything is built in preallocated host buffers and copied to the device; two sets
alternate, so filling one never races the copy still reading the other. A decode step
that replays a CUDA graph is packed into one array instead (pack_decode), which one copy
sends and the graph's first kernel unpacks (kernels/decode_inputs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.executor.step import PreviousTokens, StepSeq
from nanovllm.sampling.state import rows_per_seq
from nanovllm.sequence import PENDING_TOKEN, Sequence
from nanovllm.utils.buffers import DoubleBuffered, StagedBuffer
from nanovllm.utils.context import Context

ScheduledSeqs = list[Sequence] | list[StepSeq]


@dataclass(slots=True)
class InputBuffers:
    input_ids: StagedBuffer  # [max_tokens] int64
    positions: StagedBuffer  # [max_tokens] int64
    slot_mapping: StagedBuffer  # [max_tokens] int64
    cu_seqlens_q: StagedBuffer  # [max_seqs + 1] int32
    cu_seqlens_k: StagedBuffer  # [max_seqs + 1] int32
    context_lens: StagedBuffer  # [max_seqs] int32
    block_tables: StagedBuffer  # [max_seqs, max_blocks] int32
    prev_rows: StagedBuffer  # [max_tokens] int64: a pending token's row in the previous step's output, else -1
    logit_rows: StagedBuffer  # [max_tokens] int64: the rows whose logits are sampled (with drafts to verify)

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> InputBuffers:
        def buffer(shape: tuple[int, ...], dtype: torch.dtype) -> StagedBuffer:
            return StagedBuffer(shape, dtype, device)

        return cls(
            input_ids=buffer((max_tokens,), torch.int64),
            positions=buffer((max_tokens,), torch.int64),
            slot_mapping=buffer((max_tokens,), torch.int64),
            cu_seqlens_q=buffer((max_seqs + 1,), torch.int32),
            cu_seqlens_k=buffer((max_seqs + 1,), torch.int32),
            context_lens=buffer((max_seqs,), torch.int32),
            block_tables=buffer((max_seqs, max_blocks), torch.int32),
            prev_rows=buffer((max_tokens,), torch.int64),
            logit_rows=buffer((max_tokens,), torch.int64),
        )


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64 on the device
    positions: torch.Tensor  # [num_tokens] int64
    context: Context


# A packed decode step: [rows, width], these per-row fields in this order, then the block
# tables [rows, width]. pack_decode writes it; kernels/decode_inputs.py (which the layering
# keeps from importing this module) and cuda_graph.unpack_torch read it by position, and
# tests/kernels/test_decode_inputs.py checks all three against each other.
PACKED_FIELDS = ("tokens", "prev_rows", "positions", "slots", "keys", "temperature_bits")


def packed_size(rows: int, width: int) -> int:
    """Words (int64) of a packed decode step of `rows` rows and block tables `width` wide."""
    return 2 + len(PACKED_FIELDS) * rows + rows * width


def _pack_sampling(keys: np.ndarray, bits: np.ndarray, sampling: tuple[np.ndarray, np.ndarray] | None) -> None:
    """A packed step's draw keys and temperatures (as float32 bits) from `sampling`
    (temperatures, keys); zeros without."""
    if sampling is None:
        keys[:] = bits[:] = 0
    else:
        keys[:] = sampling[1]
        bits[:] = sampling[0].astype(np.float32, copy=False).view(np.int32)


def take_pending(ids: torch.Tensor, rows: torch.Tensor, prev: PreviousTokens) -> torch.Tensor:
    """ids with each position whose row is >= 0 taken from prev's sampled tokens (on the device)."""
    return torch.where(rows >= 0, prev.tokens[rows.clamp(min=0)], ids)


class InputBuilder:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.buffers = DoubleBuffered(lambda: InputBuffers.allocate(max_tokens, max_seqs, max_blocks_per_seq, device))

    def prefill(self, seqs: ScheduledSeqs, prev: PreviousTokens | None = None) -> ModelInputs:
        """Pack each sequence's scheduled tokens (after its cached prefix) along one axis.
        A decoding sequence's last token may be pending: it comes from `prev`, as in decode."""
        b = self.buffers.flip()
        input_ids, positions, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
        cu_q, cu_k = b.cu_seqlens_q.np, b.cu_seqlens_k.np
        num_tokens, max_q = 0, 0
        cu_q[0] = cu_k[0] = 0
        pending = []  # (flat index, row in prev) of the tokens still pending on the host
        for i, seq in enumerate(seqs):
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            end = start + n
            input_ids[num_tokens : num_tokens + n] = seq.scheduled_token_ids
            if seq.last_token == PENDING_TOKEN and end == len(seq):
                assert prev is not None, "a pending token needs the step that samples it"
                pending.append((num_tokens + n - 1, prev.row_of(seq)))
            positions[num_tokens : num_tokens + n] = np.arange(start, end)
            slots[num_tokens : num_tokens + n] = self._slots(seq, start, end)
            cu_q[i + 1] = cu_q[i] + n
            cu_k[i + 1] = cu_k[i] + end
            num_tokens += n
            max_q = max(max_q, n)
        # The paged kernels read through block tables; the memory-profiling run holds no blocks.
        block_tables = self._block_tables(b, seqs) if seqs[0].block_table else None
        context = Context(
            is_prefill=True,
            cu_seqlens_q=b.cu_seqlens_q.to_device(len(seqs) + 1),
            cu_seqlens_k=b.cu_seqlens_k.to_device(len(seqs) + 1),
            max_seqlen_q=max_q,
            slot_mapping=b.slot_mapping.to_device(num_tokens),
            block_tables=block_tables,
            logit_rows=self._logit_rows(b, seqs, cu_q),
        )
        ids = b.input_ids.to_device(num_tokens)
        if pending:
            rows = b.prev_rows.np
            rows[:num_tokens] = -1
            for index, row in pending:
                rows[index] = row
            ids = take_pending(ids, b.prev_rows.to_device(num_tokens), prev)
        return ModelInputs(ids, b.positions.to_device(num_tokens), context)

    @staticmethod
    def _logit_rows(b: InputBuffers, seqs: ScheduledSeqs, cu_q: np.ndarray) -> torch.Tensor | None:
        """Context.logit_rows: where drafts are to be verified (speculative decoding), the rows
        of each sequence's last token and its drafts (the sampler's rows_per_seq); else None
        (the last tokens alone)."""
        counts = rows_per_seq(seqs)
        if counts is None:
            return None
        num_rows = sum(counts)
        within = np.arange(num_rows) - np.repeat(np.cumsum(counts) - counts, counts)  # 0.. in each sequence
        b.logit_rows.np[:num_rows] = np.repeat(cu_q[1 : len(seqs) + 1] - counts, counts) + within
        return b.logit_rows.to_device(num_rows)

    def _decode_rows(self, seqs: ScheduledSeqs, prev: PreviousTokens | None, input_ids: np.ndarray,
                     positions: np.ndarray, slots: np.ndarray, prev_rows: np.ndarray) -> bool:
        """Each sequence's last token, its position and cache slot, and its row in `prev`
        (-1: the token is on the host) into the arrays' first rows; whether any is pending."""
        block_size = self.block_size
        any_pending = False
        for i, seq in enumerate(seqs):
            pos = len(seq) - 1
            token = seq.last_token
            input_ids[i] = token
            positions[i] = pos
            slots[i] = seq.block_table[pos // block_size] * block_size + pos % block_size
            if token == PENDING_TOKEN:
                assert prev is not None, "a pending token needs the step that samples it"
                prev_rows[i] = prev.row_of(seq)
                any_pending = True
            else:
                prev_rows[i] = -1
        return any_pending

    def pack_decode(self, seqs: ScheduledSeqs, prev: PreviousTokens | None, packed: np.ndarray,
                    sampling: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, bool]:
        """A decode step packed into `packed` (int64, PACKED_FIELDS' layout), with each row's
        temperature and draw key from `sampling` (zeros without): (words used, whether a
        token is pending in `prev`)."""
        n = len(seqs)
        width = max(len(seq.block_table) for seq in seqs)
        packed[0], packed[1] = n, width
        tokens, prev_rows, positions, slots, keys, bits = packed[2: 2 + len(PACKED_FIELDS) * n].reshape(-1, n)
        any_pending = self._decode_rows(seqs, prev, tokens, positions, slots, prev_rows)
        _pack_sampling(keys, bits, sampling)
        end = packed_size(n, width)
        self._fill_tables(packed[end - n * width: end].reshape(n, width), seqs)
        return end, any_pending

    def pack_rows(self, seqs: ScheduledSeqs, prev: PreviousTokens | None, packed: np.ndarray,
                  sampling: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, bool]:
        """pack_decode's layout with a row per scheduled token, each a query at its own
        position seeing the tokens before it (the decode graphs' multi_row steps: a sequence's
        last token and its drafts, or a draft model's few tokens behind); `sampling`'s arrays
        a value per row. A row's token may be pending only where it is its sequence's only one."""
        counts = [seq.num_scheduled_tokens for seq in seqs]
        n = sum(counts)
        width = max(len(seq.block_table) for seq in seqs)
        packed[0], packed[1] = n, width
        tokens, prev_rows, positions, slots, keys, bits = packed[2: 2 + len(PACKED_FIELDS) * n].reshape(-1, n)
        tables = packed[packed_size(n, width) - n * width: packed_size(n, width)].reshape(n, width)
        tables.fill(-1)
        prev_rows.fill(-1)
        row, any_pending = 0, False
        for seq, count in zip(seqs, counts):
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + count
            tokens[row : row + count] = seq.scheduled_token_ids
            positions[row : row + count] = np.arange(start, end)
            slots[row : row + count] = self._slots(seq, start, end)
            tables[row : row + count, : len(seq.block_table)] = seq.block_table
            if seq.scheduled_token_ids[0] == PENDING_TOKEN:
                assert prev is not None and count == 1, "a pending token needs the step that samples it, alone"
                prev_rows[row] = prev.row_of(seq)
                any_pending = True
            row += count
        _pack_sampling(keys, bits, sampling)
        return packed_size(n, width), any_pending

    def decode(self, seqs: ScheduledSeqs, prev: PreviousTokens | None = None) -> ModelInputs:
        """One token per sequence: its last, at position len - 1, seeing len tokens. A last
        token still pending on the host is taken from `prev`'s sampled tokens on the device."""
        b = self.buffers.flip()
        n = len(seqs)
        any_pending = self._decode_rows(seqs, prev, b.input_ids.np, b.positions.np, b.slot_mapping.np,
                                        b.prev_rows.np)
        b.context_lens.np[:n] = b.positions.np[:n] + 1
        context = Context(
            is_prefill=False,
            slot_mapping=b.slot_mapping.to_device(n),
            context_lens=b.context_lens.to_device(n),
            block_tables=self._block_tables(b, seqs),
        )
        ids = b.input_ids.to_device(n)
        if any_pending:
            ids = take_pending(ids, b.prev_rows.to_device(n), prev)
        return ModelInputs(ids, b.positions.to_device(n), context)

    def _slots(self, seq: Sequence | StepSeq, start: int, end: int) -> np.ndarray:
        """Flat cache slots of tokens start..end-1 of seq (-1 when it holds no blocks: profiling)."""
        if not seq.block_table:
            return np.full(end - start, -1)
        positions = np.arange(start, end)
        table = np.asarray(seq.block_table)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    @staticmethod
    def _fill_tables(tables: np.ndarray, seqs: ScheduledSeqs) -> None:
        """Each sequence's block table into its row of tables, -1 past its own blocks."""
        tables.fill(-1)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table

    @classmethod
    def _block_tables(cls, b: InputBuffers, seqs: ScheduledSeqs) -> torch.Tensor:
        """[num_seqs, widest table] int32, each row -1 past the sequence's own blocks."""
        width = max(len(seq.block_table) for seq in seqs)
        cls._fill_tables(b.block_tables.np[: len(seqs), :width], seqs)
        return b.block_tables.to_device(len(seqs), width)
