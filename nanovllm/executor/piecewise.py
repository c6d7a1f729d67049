"""CUDA graphs for steps with prompt tokens, captured in pieces around attention.

A step that carries prompt tokens (a prefill, or a prompt chunk mixed into the running
sequences' decode tokens) runs the model eagerly: some 250 kernel launches and compiled
calls from Python, which take longer on the host than the GPU takes to run them (a
1,024-token step, benchmarks/RESULTS.md, session 11). Every decode stream waits for such a
step, so its host time is the serving ITL tail.

Only attention depends on how a step's tokens divide into sequences. Everything between
two attention calls (o_proj, the norms and residual adds, the MLP, the next layer's q/k/v
projection) depends on the token count alone, so it is captured once per bucket of token
counts: L + 1 pieces for L layers. A step of n tokens replays bucket N >= n piece by
piece, and between the pieces runs each layer's attention eagerly on the first n rows
(with the Triton backend, two kernels: rotary and cache store, then paged prefill
attention, which writes into the next piece's input), reading the step's forward context
as usual.
Rows n..N-1 are padding: they hold stale activations, which no real row ever reads
(every op in the pieces works on rows alone), and attention never sees them.

The pieces pass their results through static buffers (the q/k/v projection, the
residual stream, attention's output, the final hidden states), so no piece holds another
piece's memory alive: all buckets share one buffer of each, sized for the largest, and
the pieces share the decode graphs' memory pool. The LM head runs after the pieces, on
each sequence's last token, as in the eager path.

Whole graphs (capture_attention): where the backend's prefill attention can run inside
a graph (the Triton backend: its grid depends on the shapes alone, kernels/
prefill_attention.py), each bucket is one graph, attention included, over a static
forward context: the step's positions, cache slots (-1 on padding rows: nothing is
stored), cu_seqlens, block tables and number of sequences are copied into fixed buffers.
One replay instead of L + 1, and no Python between the layers.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.executor.graphs import EagerPiece, Replayable, capture_graph, release_graphs
from nanovllm.utils.context import Context, get_context, using_context

logger = logging.getLogger(__name__)

# Buckets: powers of two from SMALLEST_BUCKET to 256, then multiples of each step up to
# its limit: padding costs GPU time once a step is GPU-bound (beyond ~2,000 tokens on the
# H200, Qwen3-0.6B), so the grid stays fine there; beyond 4,096 tokens, capture costs more
# than the host time it saves. Steps of up to 8 tokens take bucket 16 (projections of 16
# rows, not the GEMV kernels: eagerly they would be bound by the host).
SMALLEST_BUCKET = 16
BUCKET_STEPS = ((2048, 256), (4096, 512), (1 << 62, 1024))  # (up to, step)


def prefill_graph_buckets(max_tokens: int) -> list[int]:
    """[16, 32, 64, 128, 256, 512, 768, ..., 2048, 2560, ..., 4096, 5120, ...] up to
    max_tokens rounded up to a multiple of 16 (the last bucket)."""
    if max_tokens <= 0:
        return []
    top = -(-max_tokens // SMALLEST_BUCKET) * SMALLEST_BUCKET
    buckets, size = [], SMALLEST_BUCKET
    while size < min(top, 256):
        buckets.append(size)
        size *= 2
    for limit, step in BUCKET_STEPS:
        while size < min(top, limit):
            buckets.append(size)
            size += step
    return sorted({*buckets, top})


class PrefillGraphRunner:
    """Graphs of a Llama-family model (models/llama.py) for every bucket up to max_tokens:
    L + 1 pieces each, or one whole graph with capture_attention (then max_seqs and
    max_blocks size the static context).

    graphs=False keeps them as plain calls (EagerPiece): what runs on CPU to test the
    buffers, padding and ordering that the graphs replay on CUDA."""

    def __init__(self, model: nn.Module, max_tokens: int, dtype: torch.dtype, device: torch.device,
                 graphs: bool = True, capture_attention: bool = False,
                 max_seqs: int = 0, max_blocks: int = 0):
        self.decoder = decoder = model.model
        self.embed, self.layers, self.norm = decoder.embed_tokens, decoder.layers, decoder.norm
        self.use_graphs = graphs
        self.capture_attention = capture_attention
        self.buckets = prefill_graph_buckets(max_tokens)
        attn = self.layers[0].self_attn
        n, hidden = self.buckets[-1], self.embed.weight.size(1)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        if capture_attention:  # the static forward context (the module docstring)
            if max_seqs <= 0 or max_blocks <= 0:
                raise ValueError(f"capture_attention needs max_seqs and max_blocks, got {max_seqs} and {max_blocks}")
            self.max_seqs = min(max_seqs, n)
            self.positions = torch.zeros(n, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
            self.cu_seqlens_q = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=device)
            self.cu_seqlens_k = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=device)
            self.num_seqs = torch.zeros(1, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(self.max_seqs, max_blocks, dtype=torch.int32, device=device)
        # Zeros, not empty: a padding row never holds NaNs that a kernel could trip on.
        if not capture_attention:  # what the pieces hand over (a whole graph keeps it inside)
            self.qkv = torch.zeros(n, attn.q_size + 2 * attn.kv_size, dtype=dtype, device=device)
            self.residual = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.attn_out = torch.zeros(n, attn.q_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.pieces: dict[int, list[Replayable]] = {}
        self.pool: tuple | None = None  # the graphs' memory pool (capture's, or a new one)
        self.num_replays = 0
        self.num_real_tokens = 0
        self.num_padded_tokens = 0

    # -- the pieces of a bucket of `size` tokens --------------------------------------------

    def _first(self, size: int) -> None:
        """Embedding, then layer 0 up to its attention."""
        qkv, residual = self.layers[0].pre_attention(self.embed(self.input_ids[:size]), None)
        self._hand_over(size, qkv, residual)

    def _between(self, i: int, size: int) -> None:
        """Layer i - 1 from its attention's output on, then layer i up to its attention."""
        hidden, residual = self.layers[i - 1].post_attention(self.attn_out[:size], self.residual[:size])
        self._hand_over(size, *self.layers[i].pre_attention(hidden, residual))

    def _last(self, size: int) -> None:
        """The last layer from its attention's output on, and the final norm."""
        hidden, residual = self.layers[-1].post_attention(self.attn_out[:size], self.residual[:size])
        self.hidden[:size].copy_(self.norm(hidden, residual)[0])

    def _hand_over(self, size: int, qkv: torch.Tensor, residual: torch.Tensor) -> None:
        self.qkv[:size].copy_(qkv)
        self.residual[:size].copy_(residual)

    def _piece_functions(self, size: int) -> list[Callable[[], None]]:
        if self.capture_attention:
            return [lambda: self._whole(size)]
        middle = [lambda i=i: self._between(i, size) for i in range(1, len(self.layers))]
        return [lambda: self._first(size), *middle, lambda: self._last(size)]

    # -- one whole graph of a bucket ---------------------------------------------------------

    def _static_context(self, size: int) -> Context:
        """The context a whole graph of `size` tokens captures: its first min(size,
        max_seqs) sequences, max_seqlen_q unknown (kernels size their grids by shape)."""
        seqs = min(size, self.max_seqs)
        return Context(is_prefill=True, cu_seqlens_q=self.cu_seqlens_q[: seqs + 1],
                       cu_seqlens_k=self.cu_seqlens_k[: seqs + 1], max_seqlen_q=None,
                       slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:seqs],
                       num_seqs=self.num_seqs)

    def _whole(self, size: int) -> None:
        """The model's forward over `size` tokens with the static context; attention writes
        into the static attn_out, whose rows past the step's tokens stay finite."""
        with using_context(self._static_context(size)):
            self.hidden[:size].copy_(self.decoder(self.input_ids[:size], self.positions[:size], self.attn_out[:size]))

    def _set_static_context(self, positions: torch.Tensor, context: Context) -> None:
        """Copy a step's context into the static one; attention reads its first num_seqs
        sequences, and the cache store skips the padding rows (slot -1)."""
        n, seqs = positions.size(0), context.cu_seqlens_q.size(0) - 1
        if seqs > self.max_seqs:
            raise RuntimeError(f"a step of {seqs} sequences exceeds the static context's {self.max_seqs}")
        width = context.block_tables.size(1)
        if width > self.block_tables.size(1):
            raise RuntimeError(f"block tables {width} wide exceed the static context's {self.block_tables.size(1)}")
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(context.slot_mapping)
        self.slot_mapping[n:].fill_(-1)
        self.cu_seqlens_q[: seqs + 1].copy_(context.cu_seqlens_q)
        self.cu_seqlens_k[: seqs + 1].copy_(context.cu_seqlens_k)
        self.num_seqs.fill_(seqs)
        self.block_tables[:seqs, :width].copy_(context.block_tables)

    # -- capture and replay ---------------------------------------------------------------

    @torch.no_grad()
    def precompile(self) -> None:
        """Each bucket's pieces once, inside kernels/launch.precompiling(): the kernels
        compile side by side instead of running, before capture needs them."""
        if self.use_graphs:
            for size in reversed(self.buckets):
                for fn in self._piece_functions(size):
                    fn()

    @torch.no_grad()
    def capture(self, pool: tuple | None = None) -> None:
        """Capture every bucket, the largest first so the smaller ones reuse its memory pool
        (pool: the decode graphs', shared)."""
        self.pool = pool
        for size in reversed(self.buckets):
            pieces = []
            for fn in self._piece_functions(size):
                if self.use_graphs:
                    graph, self.pool = capture_graph(fn, self.pool)
                    pieces.append(graph)
                else:
                    pieces.append(EagerPiece(fn))
            self.pieces[size] = pieces
        if self.use_graphs:
            torch.cuda.synchronize()
            logger.info("prefill graphs: %d buckets of up to %d tokens, %s", len(self.buckets), self.buckets[-1],
                        "attention captured" if self.capture_attention else f"{len(self.layers) + 1} pieces each")

    def can_run(self, num_tokens: int) -> bool:
        """Whether a step of num_tokens replays the graphs; not before they are captured, nor
        while an FP8 cache waits for its scales from a step's keys (computed on the eager
        path, layers/attention.py)."""
        if not self.pieces:  # not captured yet: start-up's warm-up prefills run eagerly
            return False
        if self.capture_attention and not self.layers[0].self_attn.attn.stores_rotated():
            return False
        return 0 < num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step with prompt tokens, whose forward
        context is set (attention reads it between the pieces)."""
        n = input_ids.size(0)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:n].copy_(input_ids)
        pieces = self.pieces[bucket]
        if self.capture_attention:
            self._set_static_context(positions, get_context())
            pieces[0].replay()
        else:
            qkv, attn_out = self.qkv[:n], self.attn_out[:n]
            pieces[0].replay()
            for layer, piece in zip(self.layers, pieces[1:]):
                if layer.self_attn.attend(positions, qkv, out=attn_out).data_ptr() != attn_out.data_ptr():
                    raise RuntimeError("the attention backend did not write into its `out` buffer")
                piece.replay()
        self.num_replays += 1
        self.num_real_tokens += n
        self.num_padded_tokens += bucket - n
        return self.hidden[:n]

    def stats(self) -> dict[str, int]:
        return dict(prefill_graph_replays=self.num_replays, prefill_graph_real_tokens=self.num_real_tokens,
                    prefill_graph_padded_tokens=self.num_padded_tokens)

    def reset_stats(self) -> None:
        self.num_replays = self.num_real_tokens = self.num_padded_tokens = 0

    def release(self) -> None:
        """Free the graphs and their pool; unusable afterwards (see CUDAGraphRunner.release)."""
        release_graphs(graph for pieces in self.pieces.values() for graph in pieces)
        self.pieces.clear()
        self.pool = None
