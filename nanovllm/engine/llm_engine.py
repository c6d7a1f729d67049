"""LLMEngine: requests in, finished sequences out; one scheduler step at a time."""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.model_runner import LaunchedStep, ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import StepStats
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


def load_eos_token_ids(model_path: str, tokenizer: PreTrainedTokenizerBase, hf_config) -> set[int]:
    """End-of-sequence ids: generation_config.json's eos_token_id (an int or a list),
    else config.json's, plus the tokenizer's."""
    ids: set[int] = set()
    path = os.path.join(model_path, "generation_config.json")
    value = None
    if os.path.isfile(path):
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is not None:
        ids.update(value if isinstance(value, list) else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, model: str, **engine_args):
        start = time.perf_counter()
        self.config = Config.from_kwargs(model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos_token_ids = load_eos_token_ids(model, self.tokenizer, self.config.hf_config)
        self.model_runner = ModelRunner(self.config)
        self.scheduler = Scheduler(self.config, self.model_runner.num_kvcache_blocks, self.eos_token_ids)
        self._seq_ids = itertools.count()
        self.step_stats = StepStats()
        # The launched step whose tokens are not read yet, with on_launch's samples.
        self.inflight: tuple[LaunchedStep, list[bool]] | None = None
        self.vocab_size = self.config.hf_config.vocab_size
        self.startup_s = time.perf_counter() - start
        logger.info("engine ready in %.1f s (%s)", self.startup_s,
                    ", ".join(f"{k} {v:.1f}" for k, v in self.model_runner.timings.items()))

    # -- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"a prompt must be a string or a list of token ids (ints); got {type(prompt).__name__}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def make_sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Tokenize and check a request; raises ValueError if it could never run."""
        token_ids = self.tokenize(prompt)
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        return Sequence(next(self._seq_ids), token_ids, params, self.config.kvcache_block_size)

    def add_sequence(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> tuple[list[Sequence], int, bool]:
        """Schedule and launch one step, then read back the previous step's tokens while
        this one runs on the GPU. Returns (finished sequences, tokens launched, was it prefill).

        Keeping one step in flight hides the host's work (reading tokens, scheduling,
        building inputs) behind the GPU's. When the next schedule might preempt, which
        needs every token id on the host, the step in flight is drained first; with
        tensor parallelism it always is, because a step sent to the workers carries
        token ids, not references to the previous step's device output.
        """
        start = time.perf_counter()
        finished: list[Sequence] = []
        if self.inflight is not None and (self.config.tensor_parallel_size > 1
                                          or not self.scheduler.can_schedule_without_results()):
            finished += self.drain()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return finished + self.drain(), 0, is_prefill
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        launched = self.model_runner.launch(seqs, is_prefill, self.inflight[0] if self.inflight else None)
        samples = self.scheduler.on_launch(seqs)
        finished += self.drain()
        self.inflight = (launched, samples)
        self.step_stats.record(is_prefill, num_tokens, time.perf_counter() - start)
        return finished, num_tokens, is_prefill

    def drain(self) -> list[Sequence]:
        """Wait for the step in flight and record its tokens; returns the finished sequences.
        Leaves the engine idle between calls."""
        if self.inflight is None:
            return []
        (launched, samples), self.inflight = self.inflight, None
        return self.scheduler.postprocess(launched.seqs, launched.token_ids(), samples)

    def reset_stats(self) -> None:
        """Start the step statistics afresh (e.g. after a warm-up); start-up times stay."""
        self.step_stats = StepStats()
        graphs = self.model_runner.graph_runner
        if graphs is not None:
            graphs.num_replays = graphs.num_real_rows = graphs.num_padded_rows = 0

    def stats(self) -> dict[str, float]:
        """What the engine has done so far: steps, tokens and time per phase, CUDA-graph
        replays and padding, prefix-cache hit rate, KV blocks in use, start-up times."""
        manager = self.scheduler.block_manager
        stats = self.step_stats.as_dict()
        graphs = self.model_runner.graph_runner
        replays = graphs.num_replays if graphs else 0
        stats.update(
            graph_replays=replays,
            eager_decode_steps=stats["decode_steps"] - replays,
            mean_decode_batch=stats["decode_tokens"] / max(stats["decode_steps"], 1),
            mean_graph_bucket=(graphs.num_real_rows + graphs.num_padded_rows) / max(replays, 1) if graphs else 0.0,
            graph_padding_ratio=graphs.num_padded_rows / max(graphs.num_real_rows + graphs.num_padded_rows, 1) if graphs else 0.0,
            prefix_cache_hit_rate=manager.num_prompt_tokens_hit / max(manager.num_prompt_tokens_queried, 1),
            kv_blocks_used=manager.num_used_blocks,
            kv_blocks_total=manager.num_blocks,
            preemptions=self.scheduler.num_preemptions,
            startup_s=self.startup_s,
            **{f"startup_{k}": v for k, v in self.model_runner.timings.items()},
        )
        return stats

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.inflight is None

    def to_output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
            token_ids=seq.completion_token_ids,
            finish_reason=seq.finish_reason,
        )
        return RequestOutput(str(seq.seq_id), prompt, seq.prompt_token_ids, [completion], seq.is_finished)

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; give one, or one per prompt")
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]  # all checked before any runs
        for seq in seqs:
            self.add_sequence(seq)
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            prefill_tps = decode_tps = 0.0
            while not all(seq.is_finished for seq in seqs):
                start = time.perf_counter()
                finished, num_tokens, is_prefill = self.step()
                elapsed = time.perf_counter() - start
                if num_tokens:
                    if is_prefill:
                        prefill_tps = num_tokens / elapsed
                    else:
                        decode_tps = num_tokens / elapsed
                    pbar.set_postfix(prefill=f"{prefill_tps:.0f} tok/s", decode=f"{decode_tps:.0f} tok/s")
                pbar.update(len(finished))
            self.drain()
        finally:
            pbar.close()
            for seq in seqs:
                if not seq.is_finished:
                    self.abort(seq)
        return [self.to_output(seq, p if isinstance(p, str) else None) for seq, p in zip(seqs, prompts)]
