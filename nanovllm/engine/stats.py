"""Step statistics: what the engine did, for users, benchmarks and metrics; and, for a
diagnosis, a trace of every step (NANOVLLM_STEP_TRACE)."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanovllm.executor.executor import Executor
    from nanovllm.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepStats:
    """Counters since the engine started (LLMEngine.reset_stats starts a new one). A
    prefill step computes prompt chunks, often with decode tokens riding along (counted
    apart, in prefill_step_decode_tokens), or drafts to verify (speculative decoding: a
    sequence's last token and its drafts are its decode tokens); a decode step (the
    CUDA-graph path) one token per sequence, each counted in decode_tokens."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed in prefill steps, and those a preemption recomputes
    decode_tokens: int = 0  # tokens of decode steps
    prefill_step_decode_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0

    def record(self, is_prefill: bool, prompt_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step's tokens: of a decode step all are decode tokens (prompt_tokens 0)."""
        if is_prefill:
            self.prefill_steps += 1
            self.prefill_tokens += prompt_tokens
            self.prefill_step_decode_tokens += decode_tokens
            self.prefill_time_s += seconds
        else:
            self.decode_steps += 1
            self.decode_tokens += decode_tokens
            self.decode_time_s += seconds

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class StepTrace:
    """NANOVLLM_STEP_TRACE=FILE: one line per step (seconds since the engine started, p for
    a prefill step or d, prompt tokens, decode tokens, running and waiting sequences after
    scheduling, and the tokens of K/V the step's attention reads: every scheduled
    sequence's context through its new tokens), written to FILE.<pid> when the engine shuts
    down, after a header line with the terms of a step's memory floor: the cache's bytes per
    token, the weights' bytes, and of an MoE model its experts' bytes and the share of them a
    token routes to. A step is recorded once it is launched and the step before it is read,
    so consecutive records lie about one step's time apart. benchmarks/step_trace.py
    summarizes a trace: how a run's steps and batches went over time, and where it stands
    against the floor by batch size."""

    def __init__(self, path: str, executor: Executor):
        self.path = f"{path}.{os.getpid()}"
        self.start = time.perf_counter()
        _, expert_bytes, share = executor.experts()
        self.rows = [f"# kv_bytes_per_token {executor.kv_bytes_per_token()!r} weight_bytes {executor.weights()[1]} "
                     f"expert_bytes {expert_bytes} expert_share {share!r}\n"]

    @classmethod
    def from_env(cls, executor: Executor) -> StepTrace | None:
        path = os.environ.get("NANOVLLM_STEP_TRACE")
        return cls(path, executor) if path else None

    def add(self, is_prefill: bool, prompt_tokens: int, decode_tokens: int, running: int, waiting: int,
            context_tokens: int) -> None:
        self.rows.append(f"{time.perf_counter() - self.start:.5f} {'p' if is_prefill else 'd'} {prompt_tokens} "
                         f"{decode_tokens} {running} {waiting} {context_tokens}\n")

    def write(self) -> None:
        try:
            with open(self.path, "w") as f:
                f.writelines(self.rows)
        except OSError as exc:  # a diagnostic: never the reason a shutdown fails
            logger.warning("cannot write the step trace to %s: %s", self.path, exc)


def token_counts(seqs: list[Sequence], is_prefill: bool, traced: bool) -> tuple[int, int, int]:
    """A scheduled step's (prompt tokens, decode tokens, K/V tokens its attention reads):
    a decode step's tokens are all decode tokens; in a prefill step, a sequence that
    samples after a token it generated decodes that one (and its drafts), and the rest
    is prefill (prompts, and what a preempted sequence computes again); the K/V tokens
    only where the step is traced (0 otherwise)."""
    num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
    decode_tokens = num_tokens if not is_prefill else sum(
        1 + seq.num_draft_tokens for seq in seqs if seq.num_completion_tokens and seq.step_samples)
    context_tokens = sum(seq.num_cached_tokens + seq.num_scheduled_tokens for seq in seqs) if traced else 0
    return num_tokens - decode_tokens, decode_tokens, context_tokens


def _speculation(outputs: Any) -> dict[str, float | list[int]]:
    """Speculative decoding's counts (vLLM's spec_decode metrics: the kept drafts also by
    their place among a step's drafts), and the share of drafted tokens kept; zeros (and
    an empty list) without speculation."""
    return dict(spec_decode_num_drafts=outputs.num_drafts, spec_decode_num_draft_tokens=outputs.num_draft_tokens,
                spec_decode_num_accepted_tokens=outputs.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=list(outputs.num_accepted_per_pos),
                spec_decode_acceptance_rate=outputs.num_accepted_tokens / max(outputs.num_draft_tokens, 1))


def engine_stats(engine: Any) -> dict[str, float | str]:
    """What an LLMEngine has done so far: steps, tokens and time per phase, CUDA-graph
    replays and padding, prefix-cache hit rate, KV blocks and sequences, start-up times;
    what the KV cache holds (kv_cache_tokens, in kv_cache_dtype)."""
    scheduler, manager = engine.scheduler, engine.scheduler.block_manager
    stats = engine.step_stats.as_dict()
    graphs = engine.executor.graph_stats()
    replays, rows = graphs["graph_replays"], graphs["graph_real_rows"] + graphs["graph_padded_rows"]
    stats.update(
        graph_replays=replays,
        eager_decode_steps=stats["decode_steps"] - replays,
        mean_decode_batch=stats["decode_tokens"] / max(stats["decode_steps"], 1),
        mean_graph_bucket=rows / max(replays, 1),
        graph_padding_ratio=graphs["graph_padded_rows"] / max(rows, 1),
        prefill_graph_replays=graphs["prefill_graph_replays"],
        eager_prefill_steps=stats["prefill_steps"] - graphs["prefill_graph_replays"],
        prefill_graph_padding_ratio=graphs["prefill_graph_padded_tokens"] / max(
            graphs["prefill_graph_real_tokens"] + graphs["prefill_graph_padded_tokens"], 1),
        prefix_cache_hit_rate=manager.num_prompt_tokens_hit / max(manager.num_prompt_tokens_queried, 1),
        prefix_cache_queries=manager.num_prompt_tokens_queried,
        prefix_cache_hits=manager.num_prompt_tokens_hit,
        kv_blocks_used=manager.num_used_blocks,
        kv_blocks_total=manager.num_blocks,
        kv_cache_usage=manager.num_used_blocks / max(manager.num_blocks, 1),
        kv_cache_tokens=manager.num_blocks * engine.config.kvcache_block_size,
        kv_cache_dtype=str(engine.config.kv_cache_torch_dtype).removeprefix("torch."),
        num_requests_running=len(scheduler.running),
        num_requests_waiting=scheduler.num_waiting,
        preemptions=scheduler.num_preemptions,
        **_speculation(engine.output_processor),
        startup_s=engine.startup_s,
        **{f"startup_{k}": v for k, v in engine.startup_timings.items()},
        startup_sampler_warm_up_s=engine.sampler_warm_up_s,
        startup_process_s=engine.process_start_s,
    )
    return stats
