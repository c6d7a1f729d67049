"""DraftRunner: speculative decoding's draft model (speculative_config method "draft_model")
on one rank, beside the model's ModelRunner.

Once the scheduler has made room for a step's drafts, the engine's DraftModelProposer
(engine/speculative.py) asks for them: per sequence, the tokens the draft has not computed
yet (what came since its last proposal; a prompt it computes chunk by chunk in the steps
that compute it, no drafts asked), ending with the sequence's last token, and how many
drafts to make. propose() computes those tokens in one
varlen forward (a decode step where each sequence has one; in the decode graphs a row per
token, where none is more than 1 + drafts behind), whose last logits give each sequence's
first draft (the draft's greedy token), then runs one decode step per further draft, fed
the draft before it on the device; the drafts reach the host once, at the end. A draft's
K/V is computed as the next draft is made, so the drafts that the model keeps need no
computing again. On CUDA both kinds of step replay the draft's own graphs (cuda_graph.py's
for decode, greedy sampling included on one GPU; piecewise.py's for the varlen step).

The draft's KV cache has as many blocks as the model's, of the same size, and is read
through the same block tables: the scheduler's blocks hold both models' K/V of their
tokens, and the slots it gives a step's drafts take the draft's K/V of them first. Each
sequence's draft computes its own prefix (a prefix-cache hit shares the model's K/V only).

Under tensor parallelism every rank runs the draft's shard; rank 0 takes the greedy tokens
and broadcasts them, so that every rank feeds the same draft to the next step.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.executor.cuda_graph import CUDAGraphRunner
from nanovllm.executor.graphs import graph_plan
from nanovllm.executor.inputs import InputBuilder, ModelInputs
from nanovllm.executor.kv_cache import allocate_kv_cache, kv_bytes_per_block
from nanovllm.executor.loading import bind_attention, build_model
from nanovllm.executor.piecewise import PrefillGraphRunner
from nanovllm.executor.step import SharedTokens, StepSeq
from nanovllm.sequence import PENDING_TOKEN
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.distributed import TPGroup

# The varlen step's graphs take up to this many tokens (a sequence's draft is a few tokens
# behind, but a prompt chunk is up to max_num_batched_tokens, which runs eagerly past this):
# where CUDA graphs run, and no more than max_prefill_graph_tokens where that is given (0: none).
PREFILL_GRAPH_TOKENS = 256


class DraftRunner:
    def __init__(self, config: Config, group: TPGroup, device: torch.device, max_blocks_per_seq: int):
        """config: the model's (the draft's own is config.draft)."""
        self.config = draft = config.draft
        # Drafts are the model's tokens: of the smaller vocabulary where the two pad theirs differently.
        self.vocab_size = min(draft.hf_config.vocab_size, config.hf_config.vocab_size)
        self.group = group
        self.device = device
        self.block_size = config.kvcache_block_size
        self.model = build_model(draft, device, group)
        self.attention_layers, backend = bind_attention(self.model, draft)
        max_seqs = config.max_num_seqs
        self.inputs = InputBuilder(config.max_num_batched_tokens, max_seqs, max_blocks_per_seq, self.block_size,
                                   device)
        # Graphs, captured once the cache exists (capture): for the decode steps, as many rows
        # as a step may draft for (one GPU samples in them: greedily, temperature 0 and no
        # keys); for the varlen step, the few tokens a sequence's draft is behind. On CPU they
        # run as plain calls over the graphs' buffers where asked (executor/graphs.py's graph_plan).
        self.graphs: CUDAGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        plan = graph_plan(config, device, PREFILL_GRAPH_TOKENS)  # as the model's runner decides
        if plan.decode:
            batch = min(max_seqs, (config.speculative.disable_by_batch_size or max_seqs + 1) - 1)
            # A catch-up of up to 1 + drafts tokens a sequence replays them too, a row per token.
            self.catch_up_rows = 1 + config.speculative.num_speculative_tokens
            self.graphs = CUDAGraphRunner(self.model, batch, max_blocks_per_seq, draft.hf_config.hidden_size,
                                          draft.torch_dtype, device, samples=group.size == 1,
                                          vocab_size=draft.hf_config.vocab_size, graphs=plan.graphs,
                                          unpack_kernel=draft.kernels == "triton", rows_per_seq=self.catch_up_rows,
                                          sees_step_rows=backend.decode_sees_step_rows,
                                          sampled_vocab_size=self.vocab_size)
            rows = self.graphs.buckets[-1]
            self.greedy = (np.zeros(rows, dtype=np.float32), np.zeros(rows, dtype=np.int64))
        if plan.prefill_tokens:
            self.prefill_graphs = PrefillGraphRunner(self.model, min(plan.prefill_tokens, PREFILL_GRAPH_TOKENS),
                                                     draft.torch_dtype, device, graphs=plan.graphs,
                                                     capture_attention=backend.captures_prefill(),
                                                     max_seqs=max_seqs, max_blocks=max_blocks_per_seq)
        # The host buffers of a step's inputs are reused two steps later: their copies must
        # have run by then (the model's runner has the engine's reads for that).
        self.copies: deque[torch.cuda.Event] = deque()
        # Where the ranks other than 0 receive each step's greedy tokens (a row each).
        rows = max(max_seqs, self.graphs.buckets[-1] if self.graphs is not None else 0)
        self.shared = torch.zeros(rows, dtype=torch.int64, device=device) if group.rank else None

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.attention_layers, self.block_size, self.config.kv_cache_torch_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft's cache, as many blocks as the model's."""
        self.kv_cache = allocate_kv_cache(self.attention_layers, num_blocks, self.block_size,
                                          self.config.kv_cache_torch_dtype, self.device, "the draft model's KV cache")

    @torch.no_grad()
    def capture(self, pool: tuple | None) -> None:
        """Capture the graphs (pool: the model's graphs' memory pool, shared)."""
        if self.graphs is not None:  # (none on a CPU without NANOVLLM_PLAIN_CALL_GRAPHS)
            self.graphs.pool = pool
            self.graphs.capture()
            pool = self.graphs.pool
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture(pool)

    def release(self) -> None:
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()

    @torch.no_grad()
    def propose(self, seqs: list[StepSeq], counts: list[int]) -> list[list[int]] | None:
        """counts[i] drafts for seqs[i] (its scheduled tokens: those the draft has yet to
        compute, ending with its last token; 0 drafts: only compute them), on rank 0; None
        on the other ranks. The drafts' slots follow the last token's in the block table."""
        behind = [len(seq.scheduled_token_ids) for seq in seqs]
        row_of = list(range(len(seqs)))  # each sequence's row in the last step's tokens
        if max(behind) == 1:  # (the model kept not every draft)
            tokens = self._decode(seqs, None)
        elif (self.graphs is not None and max(behind) <= self.catch_up_rows
              and self.graphs.can_run(sum(behind), multi_row=True)):  # a row per token: its last row's token
            tokens = self._decode(seqs, None, multi_row=True)
            row_of = (np.cumsum(behind) - 1).tolist()
        else:
            with self._copies_done():
                inputs = self.inputs.prefill(seqs)
            tokens = self._greedy(self._logits(inputs), len(seqs))
        if not any(counts):  # (prompt chunks only: nothing to read back, no wait for the device)
            return None if self.group.rank else [[] for _ in seqs]
        active = [i for i, n in enumerate(counts) if n]
        made = [(active, [row_of[i] for i in active], tokens)]  # per step: who drafts, in which rows, the tokens
        for j in range(1, max(counts)):
            active = [i for i in active if counts[i] > j]
            steps = [StepSeq([PENDING_TOKEN], len(seqs[i]) + j - 1, seqs[i].block_table, row_of[i]) for i in active]
            tokens = self._decode(steps, tokens)
            for row, i in enumerate(active):
                row_of[i] = row
            made.append((active, list(range(len(active))), tokens))
        if self.group.rank:
            return None
        values = torch.cat([tokens for _, _, tokens in made]).tolist()
        drafts: list[list[int]] = [[] for _ in seqs]
        start = 0
        for active, rows, tokens in made:
            for i, row in zip(active, rows):
                drafts[i].append(values[start + row])
            start += len(tokens)
        return drafts

    def _decode(self, steps: list[StepSeq], prev: torch.Tensor | None, multi_row: bool = False) -> torch.Tensor:
        """One decode step of the draft (each last token on the host, or pending: its row in
        `prev`, the step before's tokens): the greedy tokens, a row each. multi_row: a row per
        scheduled token (pack_rows; its graphs can run it)."""
        n = sum(step.num_scheduled_tokens for step in steps) if multi_row else len(steps)
        shared = SharedTokens(prev) if prev is not None else None
        if not multi_row and (self.graphs is None or not self.graphs.can_run(n)):  # (more rows than graphs have)
            with self._copies_done():
                inputs = self.inputs.decode(steps, shared)
            return self._greedy(self._logits(inputs), n)
        graphs, samples = self.graphs, self.graphs.samples
        with self._copies_done():
            packed = graphs.next_host_buffer()
            pack = self.inputs.pack_rows if multi_row else self.inputs.pack_decode
            size, _ = pack(steps, shared, packed.numpy(), (self.greedy[0][:n], self.greedy[1][:n]) if samples else None)
            out, tokens = graphs.replay(packed[:size], n, prev, in_graph=samples, multi_row=multi_row)
        if tokens is None:
            return self._greedy(self.model.compute_logits(out), n)
        return tokens.clone()  # not the graphs' buffer, which the next replay writes

    @contextmanager
    def _copies_done(self):
        """Around the filling of host buffers and the queueing of their copies: first wait
        for the copies queued two such blocks before (CUDA; they read the same buffers)."""
        if self.device.type != "cuda":
            yield
            return
        if len(self.copies) == 2:
            self.copies.popleft().synchronize()
        try:
            yield
        finally:  # (what was queued before an error too)
            self.copies.append(torch.cuda.Event())
            self.copies[-1].record()

    def _logits(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The draft's logits at each sequence's last input (rank 0; None on the others)."""
        set_context(inputs.context)
        try:
            graphs = self.prefill_graphs
            if inputs.context.is_prefill and graphs is not None and graphs.can_run(inputs.input_ids.size(0)):
                hidden = graphs.run(inputs.input_ids, inputs.positions)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions)
            return self.model.compute_logits(hidden)
        finally:
            reset_context()

    def _greedy(self, logits: torch.Tensor | None, num_seqs: int) -> torch.Tensor:
        """Each row's greedy token, on every rank (rank 0's, broadcast)."""
        if self.group.size == 1:
            return logits[:, : self.vocab_size].argmax(dim=-1)
        tokens = logits[:, : self.vocab_size].argmax(dim=-1) if self.group.rank == 0 else self.shared[:num_seqs]
        self.group.broadcast(tokens)
        return tokens
