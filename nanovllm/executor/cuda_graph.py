"""CUDA graphs for decode.

A decode step launches a few hundred small kernels; replaying them as one captured graph
removes the per-kernel CPU launch cost. A graph fixes its tensors' addresses and shapes, so
each batch-size bucket is captured once against static buffers. Each step's inputs arrive
packed in one array (InputBuilder.pack_decode), one copy to the device, and the graph's
first kernel unpacks them into the buffers (kernels/decode_inputs.py; on CPU, torch ops),
taking pending last tokens from the previous step's sampled tokens on the way. A batch of
3 replays the bucket-4 graph: its fourth row is padding (slot_mapping -1 so its K/V goes
nowhere that is read, context_lens 0 so it attends to nothing, block table cleared).

A step that verifies drafts (speculative decoding) and computes nothing else replays them
too, a row per scheduled token (each sequence's last token and its drafts, every row a
query at its own position that sees the rows before it: `multi_row`), in the smallest
bucket whose graph stores every row's K/V before any row attends
(AttentionBackend.decode_sees_step_rows); so does a draft model's catch-up of a few tokens.

On one GPU the graph goes on to the LM head, and a second small graph per bucket runs the
fast sampler (temperature, seeded keys) on its logits, so a temperature-only decode step
is two graph launches and nothing else; a batch that needs more (filters, penalties,
logprobs) replays only the first and takes its logits to the full sampler. Under tensor
parallelism the graph ends at the hidden states.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.executor.graphs import EagerPiece, Replayable, capture_graph, release_graphs
from nanovllm.executor.inputs import PACKED_FIELDS, packed_size
from nanovllm.sampling.ops import sample_fast
from nanovllm.utils.buffers import DoubleBuffered
from nanovllm.utils.context import Context, using_context

# nano-vllm's buckets: 1, 2, 4, 8, then every multiple of 16. Above the largest bucket
# (at most 512), decode runs eagerly: launch cost is small next to the work there.
MAX_GRAPH_BATCH = 512
# Graphs that take several rows a sequence (multi_row) have rows for that many at least.
MULTI_ROW_GRAPH_ROWS = 64


def graph_buckets(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 32, ...] up to min(max_num_seqs, 512), plus max_num_seqs itself
    where it is at most 512."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    buckets = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
    if max_num_seqs <= MAX_GRAPH_BATCH and max_num_seqs not in buckets:
        buckets.append(max_num_seqs)
    return sorted(buckets)


def graph_rows(max_num_seqs: int, rows_per_seq: int, sees_step_rows: Callable[[int], bool] | None) -> int:
    """The rows of decode graphs that also take steps of up to rows_per_seq rows a sequence
    (sees_step_rows: the attention backend's decode_sees_step_rows; None: one row each):
    max_num_seqs x rows_per_seq, up to MULTI_ROW_GRAPH_ROWS however small max_num_seqs is,
    and at least the fewest rows whose graph the backend can run so."""
    if sees_step_rows is None:
        return max_num_seqs
    least = next((rows for rows in range(2, MAX_GRAPH_BATCH) if sees_step_rows(rows)), MAX_GRAPH_BATCH)
    return max(max_num_seqs, min(max_num_seqs * rows_per_seq, MULTI_ROW_GRAPH_ROWS), least)


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, samples: bool = False, vocab_size: int = 0,
                 graphs: bool = True, unpack_kernel: bool = True, rows_per_seq: int = 1,
                 sees_step_rows: Callable[[int], bool] | None = None,
                 sampled_vocab_size: int | None = None):
        """sees_step_rows: whether a bucket's graph may hold several rows of one sequence (the
        attention backend's decode_sees_step_rows; None: every step one row a sequence), up
        to rows_per_seq (1 + the drafts a step verifies: graph_rows sizes the buckets).
        sampled_vocab_size: the leading columns of the logits [rows, vocab_size] that the
        graphs' sampling draws from (None: all)."""
        self.model = model
        self.samples = samples
        self.use_graphs = graphs  # False: every bucket as plain calls (EagerPiece)
        # The inputs unpacked by kernels/decode_inputs.py (always under graphs; on CPU with
        # the Triton kernels, through the interpreter) or else by torch ops (unpack_torch,
        # which graphs cannot capture).
        self.unpack_kernel = unpack_kernel or graphs
        self.buckets = graph_buckets(graph_rows(max_num_seqs, rows_per_seq, sees_step_rows))
        # The buckets a step of several rows of one sequence may replay (one that verifies drafts).
        self.multi_row_buckets = [b for b in self.buckets if sees_step_rows(b)] if sees_step_rows else []
        n = self.buckets[-1]
        # Static inputs and output, shared by every bucket's graph (each uses a leading slice).
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # As wide as max_model_len allows, whatever the batch holds now.
        self.block_tables = torch.full((n, max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.outputs = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        # Sampling inputs and outputs, when the graphs sample.
        self.temperatures = torch.zeros(n, dtype=torch.float32, device=device)
        self.keys = torch.zeros(n, dtype=torch.int64, device=device)
        self.draw_positions = torch.zeros(n, dtype=torch.int64, device=device)
        # The sampled tokens; also where the graphs take pending last tokens from (a step
        # that sampled elsewhere has its tokens copied here first): as many rows as any step.
        self.tokens = torch.zeros(max(n, max_num_seqs), dtype=torch.int64, device=device)
        # A step's packed inputs: on the device (where the graphs read them) and in two
        # sets of host memory (pinned on CUDA), one filled while the other may still be sent.
        size = packed_size(n, max_blocks_per_seq)
        self.packed = torch.zeros(size, dtype=torch.int64, device=device)
        self.host_packed = DoubleBuffered(
            lambda: torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda"))
        # The LM head writes here. One buffer for all buckets: keeping each capture's own
        # [bucket, vocab] logits alive would hold gigabytes of the pool at large vocabularies.
        self.logits = torch.empty(n, vocab_size, dtype=dtype, device=device) if samples else None
        self.sampled_vocab_size = sampled_vocab_size or vocab_size
        self.graphs: dict[int, Replayable] = {}
        self.sample_graphs: dict[int, Replayable] = {}
        self.pool = None
        # Statistics: replays, and real vs. padded rows.
        self.num_replays = 0
        self.num_real_rows = 0
        self.num_padded_rows = 0
        self.num_multi_row_replays = 0

    def _context(self, bs: int) -> Context:
        return Context(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:bs],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
        )

    def _unpack(self, bs: int) -> None:
        """The packed step into the first bs rows of the static buffers."""
        buffers = (self.input_ids[:bs], self.positions[:bs], self.slot_mapping[:bs], self.context_lens[:bs],
                   self.block_tables[:bs], self.temperatures[:bs], self.keys[:bs], self.draw_positions[:bs])
        if self.unpack_kernel:
            from nanovllm.kernels.decode_inputs import unpack_decode_inputs

            unpack_decode_inputs(self.packed, self.tokens, *buffers)
        else:
            unpack_torch(self.packed, self.tokens, *buffers)

    def _forward(self, bs: int) -> None:
        self._unpack(bs)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        if not self.samples:
            self.outputs[:bs] = hidden
            return
        self.model.compute_logits(hidden, out=self.logits[:bs])

    def _sample(self, bs: int) -> None:
        logits = self.logits[:bs, : self.sampled_vocab_size]
        self.tokens[:bs] = sample_fast(logits, self.temperatures[:bs], self.keys[:bs], self.draw_positions[:bs])

    def _capture(self, run, bs: int) -> Replayable:
        if not self.use_graphs:  # the bucket's run under its static context, called at each replay
            return EagerPiece(lambda: self._under_static_context(run, bs))
        graph, self.pool = capture_graph(lambda: run(bs), self.pool)
        return graph

    def _under_static_context(self, run, bs: int) -> None:
        """run(bs) as its graph replays it: with the bucket's static context, not the step's."""
        with using_context(self._context(bs)):
            run(bs)

    def _each_bucket(self, run) -> None:
        """run(bs) for every bucket, the largest first, with that bucket's context set."""
        for bs in reversed(self.buckets):
            self._under_static_context(run, bs)

    @torch.no_grad()
    def precompile(self) -> None:
        """Each bucket's forward (and sampling) once, inside kernels/launch.precompiling():
        the kernels compile side by side instead of running, before capture needs them."""
        def walk(bs: int) -> None:
            self._forward(bs)
            if self.samples:
                self._sample(bs)

        self._each_bucket(walk)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture the largest bucket first so the smaller ones reuse its memory pool."""
        def capture_bucket(bs: int) -> None:
            self.graphs[bs] = self._capture(self._forward, bs)
            if self.samples:
                self.sample_graphs[bs] = self._capture(self._sample, bs)
            if self.use_graphs:
                torch.cuda.synchronize()

        self._each_bucket(capture_bucket)

    def release(self) -> None:
        """Free the graphs and their memory pool; the runner is unusable afterwards (free
        it before the process group: graphs.release_graphs)."""
        release_graphs([*self.graphs.values(), *self.sample_graphs.values()])
        self.graphs.clear()
        self.sample_graphs.clear()
        self.pool = None

    def stats(self) -> dict[str, int]:
        """Replays so far and their real and padding rows."""
        return dict(graph_replays=self.num_replays, graph_real_rows=self.num_real_rows,
                    graph_padded_rows=self.num_padded_rows)

    def reset_stats(self) -> None:
        self.num_replays = self.num_real_rows = self.num_padded_rows = self.num_multi_row_replays = 0

    def can_run(self, batch_size: int, multi_row: bool = False) -> bool:
        """Whether a decode batch replays a graph (multi_row: batch_size rows, several of one
        sequence); not before capture (start-up's warm-ups)."""
        buckets = self.multi_row_buckets if multi_row else self.buckets
        return bool(self.graphs) and bool(buckets) and batch_size <= buckets[-1]

    def bucket_for(self, batch_size: int, multi_row: bool = False) -> int:
        buckets = self.multi_row_buckets if multi_row else self.buckets
        return buckets[bisect.bisect_left(buckets, batch_size)]

    def next_host_buffer(self) -> torch.Tensor:
        """The host array to pack the next step into (InputBuilder.pack_decode): the other of
        the two, once per step."""
        return self.host_packed.flip()

    def replay(self, packed: torch.Tensor, bs: int, prev_tokens: torch.Tensor | None,
               in_graph: bool = False, multi_row: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of bs rows from its packed inputs (a leading slice of
        next_host_buffer()); prev_tokens: the previous step's sampled tokens, where a row's last
        token is pending. Returns the logits [bs, vocab] (graphs that sample; else the
        hidden states [bs, hidden]) and, with `in_graph` (SamplingTensors.in_graph: the packed
        temperatures and keys are all the batch's sampling needs), the sampled tokens [bs]
        (else None). multi_row: rows of one sequence (InputBuilder.pack_rows)."""
        bucket = self.bucket_for(bs, multi_row)
        self.packed[: packed.numel()].copy_(packed, non_blocking=True)
        if prev_tokens is not None and prev_tokens.data_ptr() != self.tokens.data_ptr():
            self.tokens[: prev_tokens.numel()].copy_(prev_tokens)
        self.graphs[bucket].replay()
        self.num_replays += 1
        self.num_real_rows += bs
        self.num_padded_rows += bucket - bs
        self.num_multi_row_replays += multi_row
        if not self.samples:
            return self.outputs[:bs], None
        if not in_graph:
            return self.logits[:bs], None
        self.sample_graphs[bucket].replay()
        return self.logits[:bs], self.tokens[:bs]


def unpack_torch(packed: torch.Tensor, prev_tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                 temperatures: torch.Tensor, keys: torch.Tensor, draw_positions: torch.Tensor) -> None:
    """kernels/decode_inputs.py's unpack with torch ops (the CPU's path, and the kernel's
    reference); reads the header on the host, so it cannot be captured."""
    rows, width = packed[:2].tolist()
    fields = packed[2: 2 + len(PACKED_FIELDS) * rows].view(len(PACKED_FIELDS), rows)
    tokens, prev_rows, row_positions, slots, row_keys, bits = fields
    pending = prev_rows >= 0
    if pending.any():
        tokens = torch.where(pending, prev_tokens[prev_rows.clamp(min=0)], tokens)
    for buffer, value, padding in ((input_ids, tokens, 0), (positions, row_positions, 0), (slot_mapping, slots, -1),
                                   (context_lens, row_positions + 1, 0), (draw_positions, row_positions + 1, 0),
                                   (keys, row_keys, 0), (temperatures, bits.to(torch.int32).view(torch.float32), 0)):
        buffer[:rows] = value
        buffer[rows:] = padding
    block_tables.fill_(-1)
    end = packed_size(rows, width)
    block_tables[:rows, :width] = packed[end - rows * width: end].view(rows, width)
