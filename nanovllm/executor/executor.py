"""Executor: the engine's one handle on the model, whatever the topology.

    executor = Executor.create(config)                   # one rank, or rank 0 + TP workers
    launched = executor.launch(seqs, is_prefill, prev)   # queued; prev: the step still in flight
    token_ids = launched.token_ids()                     # waits for that step alone
    launched = executor.sample(executor.forward(seqs, is_prefill, prev))  # the same, in two halves

On one rank a step is ModelRunner.launch. With tensor_parallel_size > 1 (TPExecutor) rank 0
sends each step to the workers (worker.py) as StepSeq records before computing its own
part from the very same records; every rank runs the same ModelRunner.forward, and only
rank 0 samples. A token still pending on the host reaches the other ranks through a
broadcast of rank 0's sampled tokens at the start of the next step (share_sampled).
"""
from __future__ import annotations

import logging

import torch

from nanovllm.config import Config, num_experts_of
from nanovllm.executor.model_runner import ModelRunner, rank_device
from nanovllm.executor.step import ForwardedStep, LaunchedStep, StepSeq
from nanovllm.executor.worker import TPWorkers
from nanovllm.layers.fused_moe import expert_parameters
from nanovllm.sequence import PENDING_TOKEN, Sequence

logger = logging.getLogger(__name__)


class Executor:
    """Runs every step on one rank."""

    def __init__(self, config: Config):
        self.runner = ModelRunner(config)

    @staticmethod
    def create(config: Config) -> Executor:
        executor = TPExecutor if config.tensor_parallel_size > 1 else Executor
        return executor(config)

    def set_eos_token_ids(self, eos_token_ids: frozenset[int]) -> None:
        """The end-of-sequence ids min_tokens holds back (rank 0 samples), known once the
        tokenizer is loaded, after the model."""
        self.runner.sampling.set_eos_token_ids(eos_token_ids)

    @property
    def num_kvcache_blocks(self) -> int:
        return self.runner.num_kvcache_blocks

    @property
    def timings(self) -> dict[str, float]:
        """Seconds each start-up phase took."""
        return self.runner.timings

    def launch(self, seqs: list[Sequence], is_prefill: bool, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step for seqs and the copy of its sampled tokens to the host. prev: the
        step still in flight, whose tokens some of seqs' last tokens are."""
        return self.runner.launch(seqs, is_prefill, prev)

    def forward(self, seqs: list[Sequence], is_prefill: bool, prev: LaunchedStep | None = None) -> ForwardedStep:
        """Queue the model's part of a step alone; `sample` queues the rest. In between the
        host may read `prev`'s tokens: structured outputs' bitmasks need them, and the
        model runs meanwhile."""
        output = self.runner.forward(seqs, is_prefill, prev)  # first: the GPU may be idle
        return ForwardedStep(seqs, output, self.runner.prepare_sampling(seqs, defer_late=True))

    def sample(self, step: ForwardedStep) -> LaunchedStep:
        """Sample a forwarded step (rank 0) and queue the copy of its tokens to the host."""
        self.runner.sampling.prepare_late(step.sampling, step.seqs)
        return self.runner.sample(step.seqs, step.sampling, step.output)

    def propose(self, seqs: list[StepSeq], counts: list[int]) -> list[list[int]] | None:
        """The draft model's drafts, counts[i] of them for seqs[i] (DraftRunner.propose);
        None where the draft failed (out of memory, say) on this one rank: the step goes
        without them, and the ranks stay in step."""
        try:
            return self.runner.drafter.propose(seqs, counts)
        except Exception as e:
            logger.warning("the draft model failed, a step goes without its drafts: %s", e)
            return None

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.graph_runner is not None

    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token takes on this rank (over all layers)."""
        return self.runner.kv_bytes_per_block() / self.runner.block_size

    def weights(self) -> tuple[int, int]:
        """This rank's parameters: (how many, how many bytes)."""
        return _sizes(list(self.runner.model.parameters()))

    def experts(self) -> tuple[int, int, float]:
        """This rank's MoE expert weights: (parameters, bytes, the share of experts a token
        routes to); zeros for a dense model."""
        experts = expert_parameters(self.runner.model)
        hf = self.runner.config.hf_config
        share = hf.num_experts_per_tok / num_experts_of(hf) if experts else 0.0
        return *_sizes(experts), share

    def warm_up_sampler(self) -> float:
        """Compile the sampler's filtered paths now; returns the seconds it took."""
        return self.runner.warm_up_sampler()

    def graph_stats(self) -> dict[str, int]:
        """CUDA-graph replays and their real and padded rows or tokens (zeros without graphs)."""
        return self.runner.graph_stats()

    def reset_graph_stats(self) -> None:
        self.runner.reset_graph_stats()

    def shutdown(self) -> None:
        """Release the model's CUDA graphs; unusable afterwards."""
        self.runner.shutdown()


def _sizes(params: list[torch.Tensor]) -> tuple[int, int]:
    """(elements, bytes) of the tensors together."""
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


class TPExecutor(Executor):
    """Rank 0 in this process, ranks 1..N-1 in worker processes."""

    def __init__(self, config: Config):
        self.workers = TPWorkers(config, rank_device(config, 0))
        try:
            self.runner = ModelRunner(config, self.workers.group)
        except BaseException as e:
            self.workers.fail(e)
            raise

    def launch(self, seqs: list[Sequence], is_prefill: bool, prev: LaunchedStep | None = None) -> LaunchedStep:
        """As Executor.launch; only rank 0 samples, so it is forward then sample."""
        return self.sample(self.forward(seqs, is_prefill, prev))

    @torch.no_grad()
    def forward(self, seqs: list[Sequence], is_prefill: bool, prev: LaunchedStep | None = None) -> ForwardedStep:
        """The step goes to the workers as StepSeq records, and rank 0 computes from the
        very same records. Tokens still pending come from `prev` through share_sampled."""
        runner = self.runner
        prev_rows = [prev.row_of(seq) if seq.scheduled_token_ids[-1] == PENDING_TOKEN else -1 for seq in seqs]
        records = [StepSeq.pack(seq, row) for seq, row in zip(seqs, prev_rows)]
        num_prev = len(prev.seqs) if max(prev_rows, default=-1) >= 0 else 0
        try:  # a failure part-way leaves the ranks out of step: stop them all
            self.workers.call("execute", (is_prefill, records, num_prev))
            shared = runner.share_sampled(num_prev, prev.tokens if num_prev else None)
            output = runner.forward([StepSeq(*r) for r in records], is_prefill, shared)
        except BaseException as e:
            self.workers.fail(e)
            raise
        return ForwardedStep(seqs, output, runner.prepare_sampling(seqs, defer_late=True))

    def propose(self, seqs: list[StepSeq], counts: list[int]) -> list[list[int]] | None:
        """As Executor.propose, every rank running the draft's shard (or rank 0 the whole
        draft, which may fail alone). A shard's failure leaves the ranks out of step: it
        stops them all, and raises."""
        if self.runner.drafter.group.size == 1:
            return super().propose(seqs, counts)
        try:
            self.workers.call("propose", ([(s.scheduled_token_ids, s.num_cached_tokens, s.block_table) for s in seqs],
                                          counts))
            return self.runner.drafter.propose(seqs, counts)
        except BaseException as e:
            self.workers.fail(e)
            raise

    def shutdown(self) -> None:
        """Free the CUDA graphs, then stop the workers: a graph that captured NCCL calls
        holds its communicator, whose teardown blocks until the graph is gone."""
        self.runner.shutdown()
        self.workers.shutdown()
