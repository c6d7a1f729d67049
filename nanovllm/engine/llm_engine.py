"""LLMEngine: requests in, finished sequences out; one scheduler step at a time."""
from __future__ import annotations

import itertools
import json
import logging
import os
import random
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.model_runner import LaunchedStep, ModelRunner
from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop
from nanovllm.engine.scheduler import Scheduler, check_fits
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import StepStats
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]

# Completion i of a request with seed s draws its random numbers from the key
# (s * SEED_MULTIPLIER + i) mod 2**62: distinct per completion, the same on every run.
SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, an odd constant that spreads seeds
SAMPLING_KEY_MASK = (1 << 62) - 1


@dataclass(slots=True)
class Request:
    """One prompt with its sampling parameters and its n sequences (completions)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    # Both read for every running request after every step of a server: one sequence (the
    # usual n=1) skips the generator.
    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].is_finished if len(seqs) == 1 else all(seq.is_finished for seq in seqs)

    @property
    def num_known_completion_tokens(self) -> int:
        """Completion tokens known on the host, over all n sequences."""
        seqs = self.seqs
        return seqs[0].num_known_completion_tokens if len(seqs) == 1 else sum(s.num_known_completion_tokens for s in seqs)


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


class RequestChecker:
    """Tokenizes a prompt and rejects a request that could never run: what make_request
    checks, needing no model (the server's API process checks with one too)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        # Checked with C-level passes (type, min, max) first: the engine process checks
        # every prompt again, and a generator over 1,024 ids costs ~0.5 ms per request.
        if not isinstance(prompt, list) or not (set(map(type, prompt)) <= {int} or all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise ValueError(f"a prompt must be a string or a list of token ids (ints); got {type(prompt).__name__}")
        if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def check(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids; ValueError for a request that could never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        check_fits(len(token_ids), params.max_tokens, self.max_model_len, self.block_size, self.num_blocks)
        bad = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return token_ids


class LLMEngine:
    def __init__(self, model: str, **engine_args):
        start = time.perf_counter()
        self.config = Config.from_kwargs(model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.eos_token_ids = load_eos_token_ids(model, self.tokenizer, self.config.hf_config)
        self.model_runner = ModelRunner(self.config, eos_token_ids=frozenset(self.eos_token_ids))
        self.scheduler = Scheduler(self.config, self.model_runner.num_kvcache_blocks, self.eos_token_ids)
        self._seq_ids = itertools.count()
        self._rng = random.Random(self.config.seed)  # sampling keys of unseeded requests: the engine seed repeats runs
        self.step_stats = StepStats()
        # The launched step whose tokens are not read yet, with on_launch's samples.
        self.inflight: tuple[LaunchedStep, list[bool]] | None = None
        self.vocab_size = self.config.hf_config.vocab_size
        self.checker = RequestChecker(self.tokenizer, self.vocab_size, self.config.max_model_len,
                                      self.config.kvcache_block_size, self.model_runner.num_kvcache_blocks)
        self.startup_s = time.perf_counter() - start
        logger.info("engine ready in %.1f s (%s)", self.startup_s,
                    ", ".join(f"{k} {v:.1f}" for k, v in self.model_runner.timings.items()))

    # -- requests -----------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, stream: bool = False,
                     request_id: str | None = None) -> Request:
        """Tokenize and check a request (raises ValueError if it could never run) and make
        its params.n sequences. With stream=True, its text is detokenized as it grows, for
        stream_delta."""
        token_ids = self.checker.check(prompt, params)
        seqs = []
        for index in range(params.n):
            if params.seed is None:
                key = self._rng.getrandbits(62)
            else:  # completion i of a seeded request draws its own stream, the same every time
                key = (params.seed * SEED_MULTIPLIER + index) & SAMPLING_KEY_MASK
            seq = Sequence(next(self._seq_ids), token_ids, params, self.config.kvcache_block_size, index, key)
            if stream or params.stops_on_text:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            seqs.append(seq)
        request_id = str(seqs[0].seq_id) if request_id is None else request_id
        return Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, seqs)

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request.seqs[0], request.seqs[1:])

    def abort_request(self, request: Request) -> None:
        """Stop the request's sequences now and free their KV blocks."""
        for seq in request.seqs:
            self.scheduler.abort(seq)

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> tuple[list[Sequence], int, bool]:
        """Schedule and launch one step, then read back the previous step's tokens while
        this one runs on the GPU. Returns (finished sequences, tokens launched, was it prefill).

        Keeping one step in flight hides the host's work (reading tokens, scheduling,
        building inputs) behind the GPU's. When the next schedule might preempt, which
        needs every token id on the host, the step in flight is drained first.
        """
        start = time.perf_counter()
        finished: list[Sequence] = []
        if self.inflight is not None and not self.scheduler.can_schedule_without_results():
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
        finished = self.scheduler.postprocess(launched.seqs, launched.token_ids(), samples, launched.logprobs())
        for seq in launched.seqs:
            if seq.detokenizer is not None and self._detokenize(seq) and seq not in finished:
                finished.append(seq)
        return finished

    def _detokenize(self, seq: Sequence) -> bool:
        """Extend seq's text with its new tokens and look for its stop strings; returns
        whether a stop string ended it. A token that ended it by being a stop token (or
        end-of-sequence) adds no text unless include_stop_str_in_output."""
        params, detok = seq.params, seq.detokenizer
        if detok.closed:
            return False
        end = len(self._text_token_ids(seq)) if seq.is_finished else seq.num_known_completion_tokens
        start = detok.num_tokens
        if end <= start and not seq.is_finished:
            return False
        new_text = detok.add(seq.completion_tokens(start, end), final=seq.is_finished)
        detok.closed = seq.is_finished
        if not params.stop or not new_text or end <= params.min_tokens or seq.finish_reason == "abort":
            return False
        found = find_stop(detok.text, len(new_text), params.stop)
        if found is None:
            return False
        position, stop = found
        detok.text = detok.text[: position + (len(stop) if params.include_stop_str_in_output else 0)]
        detok.closed = True
        if seq.is_finished:  # already ended by length: the stop string takes precedence, as in vLLM
            seq.finish_reason, seq.stop_reason = "stop", stop
            return False
        self.scheduler.finish(seq, "stop", stop)
        return True

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

    # -- outputs ------------------------------------------------------------------------

    def _text_token_ids(self, seq: Sequence) -> list[int]:
        """The completion tokens whose text is part of the output: all but a stop token
        (or end-of-sequence) that ended it, unless include_stop_str_in_output."""
        ids = seq.completion_token_ids
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) and not seq.params.include_stop_str_in_output:
            return ids[:-1]
        return ids

    def completion(self, seq: Sequence) -> CompletionOutput:
        """Everything seq has generated so far (all of it once finished)."""
        if seq.detokenizer is not None:
            text = seq.detokenizer.text
        else:
            text = self.tokenizer.decode(self._text_token_ids(seq), skip_special_tokens=seq.params.skip_special_tokens)
        return self._output(seq, text, 0, seq.num_known_completion_tokens)

    def stream_delta(self, seq: Sequence) -> CompletionOutput:
        """What seq (of a request made with stream=True) has produced since the last call:
        new text, token ids and logprobs, and finish_reason once it has finished. While it
        runs, text that could still turn out to start a stop string is held back."""
        detok = seq.detokenizer
        if detok is None:
            raise ValueError("stream_delta needs a request made with stream=True")
        end_chars = len(detok.text)
        if not seq.is_finished and seq.params.stop and not seq.params.include_stop_str_in_output:
            end_chars = max(seq.num_emitted_chars, end_chars - max(map(len, seq.params.stop)) + 1)
        end_tokens = seq.num_known_completion_tokens
        delta = self._output(seq, detok.text[seq.num_emitted_chars : end_chars], seq.num_emitted_tokens, end_tokens)
        seq.num_emitted_chars, seq.num_emitted_tokens = end_chars, end_tokens
        return delta

    def _output(self, seq: Sequence, text: str, start: int, end: int) -> CompletionOutput:
        """seq's CompletionOutput with `text` and completion tokens start..end-1 (and their
        logprobs, each Logprob's token text filled in)."""
        logprobs = None
        if seq.logprobs is not None:
            logprobs = seq.logprobs[start:end]
            for entry in logprobs:
                for token_id, lp in entry.items():
                    if lp.decoded_token is None:
                        lp.decoded_token = self.tokenizer.decode([token_id])
        return CompletionOutput(seq.index, text, seq.completion_tokens(start, end), seq.finish_reason,
                                seq.stop_reason, logprobs, seq.cumulative_logprob if logprobs is not None else None)

    def output(self, request: Request) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [self.completion(seq) for seq in request.seqs], request.finished)

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
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]  # all checked before any runs
        for request in requests:
            self.add_request(request)
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            prefill_tps = decode_tps = 0.0
            num_done = 0
            while num_done < len(requests):
                start = time.perf_counter()
                finished, num_tokens, is_prefill = self.step()
                elapsed = time.perf_counter() - start
                if num_tokens:
                    if is_prefill:
                        prefill_tps = num_tokens / elapsed
                    else:
                        decode_tps = num_tokens / elapsed
                    # Shown at the bar's next (rate-limited) refresh: one per step would redraw it every step.
                    pbar.set_postfix(prefill=f"{prefill_tps:.0f} tok/s", decode=f"{decode_tps:.0f} tok/s", refresh=False)
                if finished or not num_tokens:  # counting costs ~150 us per 256 requests: only when it can change
                    done = sum(request.finished for request in requests)
                    pbar.update(done - num_done)
                    num_done = done
            self.drain()
        finally:
            pbar.close()
            for request in requests:
                if not request.finished:
                    self.abort_request(request)
        return [self.output(request) for request in requests]
