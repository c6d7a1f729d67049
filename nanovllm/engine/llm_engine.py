"""LLMEngine: requests in, outputs out; one scheduler step at a time.

    request = engine.make_request(prompt, params)     # tokenized and checked (ValueError)
    engine.add_request(request)
    while not request.finished:
        engine.step()                                 # schedule, launch, read the last step back
    output = engine.output(request)

Each step: the Scheduler picks the sequences, the Executor launches them on the model,
and the step launched before is read back: the OutputProcessor records its tokens and
decides which sequences are done, and the Scheduler frees those.
"""
from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.model_files import (
    check_tokenizer_files,
    load_eos_token_ids,
    load_generation_defaults,
    load_tokenizer,
)
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.reasoning import ReasoningTags
from nanovllm.engine.request import Prompt, Request, RequestChecker, owned, seeded_key
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.stats import StepStats, StepTrace, engine_stats, token_counts
from nanovllm.engine.structured import GrammarCompiler
from nanovllm.executor.executor import Executor
from nanovllm.executor.step import ForwardedStep, LaunchedStep
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

logger = logging.getLogger(__name__)

# With nothing to run but grammars compiling, step() waits this long for one (new requests
# still come in between).
COMPILE_WAIT_S = 0.005


@dataclass(slots=True)
class StepResult:
    """What one step() did."""

    updated: list[Sequence]  # sequences whose tokens were read back: new output, maybe finished
    finished: list[Sequence]  # those of them that finished
    num_tokens: int  # tokens the launched step computes (0: nothing was launched)
    is_prefill: bool
    prompt_tokens: int = 0  # of them, prompt tokens (and what a preempted sequence computes again)
    output_tokens: int = 0  # tokens the steps read back output (several a sequence where drafts stood)


def _timed(fn: Callable, *args):
    """fn(*args) and the seconds it took."""
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


class LLMEngine:
    def __init__(self, model: str, tokenizer_source: Callable[[], PreTrainedTokenizerBase | None] | None = None,
                 **engine_args):
        """tokenizer_source: called once the model is built, for the tokenizer (returning
        None: load it); a server's engine process is sent the API process's this way while
        it builds the model. Without one the tokenizer loads first, so that its errors
        come before the model's minutes."""
        start = time.perf_counter()
        self.config = Config.from_kwargs(model, **engine_args)
        if self.config.data_parallel_size != 1:
            raise ValueError("an LLMEngine is one replica: LLM(model, data_parallel_size=N) runs N of them")
        check_tokenizer_files(self.config)
        # The checkpoint's recommended sampling parameters (generation_config.json).
        self.generation_defaults = load_generation_defaults(self.config)
        config_s = time.perf_counter() - start
        tokenizer, tokenizer_s = _timed(load_tokenizer, self.config) if tokenizer_source is None else (None, 0.0)
        reasoning = None  # where outputs' reasoning starts and ends (structured outputs apply after it)
        if tokenizer is not None and self.config.reasoning_parser:  # one the tokenizer lacks: before the model
            reasoning = ReasoningTags.load(self.config.reasoning_parser, tokenizer)
        self.executor = Executor.create(self.config)
        try:
            if tokenizer is None:  # sent while the model was built, or loaded now
                tokenizer, tokenizer_s = _timed(lambda: tokenizer_source() or load_tokenizer(self.config))
            self.tokenizer = tokenizer
            self._own_timings = dict(config_s=config_s, tokenizer_s=tokenizer_s)
            self.eos_token_ids = load_eos_token_ids(self.config, self.tokenizer)
            self.executor.set_eos_token_ids(frozenset(self.eos_token_ids))
            self.scheduler = Scheduler(self.config, self.executor.num_kvcache_blocks)
            self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
            self.checker = RequestChecker.from_config(self.config, self.tokenizer, self.executor.num_kvcache_blocks,
                                                      self.eos_token_ids)
            if reasoning is None and self.config.reasoning_parser:
                reasoning = ReasoningTags.load(self.config.reasoning_parser, self.tokenizer)
            self.reasoning = reasoning
            self.trace = StepTrace.from_env(self.executor)
        except BaseException:
            self.executor.shutdown()
            raise
        self.vocab_size = self.config.hf_config.vocab_size
        self._seq_ids = itertools.count()
        self._rng = random.Random(self.config.seed)  # sampling keys of unseeded requests: the engine seed repeats runs
        self.step_stats = StepStats()
        # The launched step whose tokens are not read yet, with on_launch's samples.
        self.inflight: tuple[LaunchedStep, list[bool]] | None = None
        # A step whose model is queued but which samples only after `inflight` is read
        # (structured outputs: the grammars need those tokens), with on_launch's samples.
        self.forwarded: tuple[ForwardedStep, list[bool]] | None = None
        self.drain_first = False  # after a failed step: read what is in flight before the next launch
        self.grammars: GrammarCompiler | None = None  # made for the first structured request
        self.compiling: list[Request] = []  # added, waiting for their grammar
        self.failed: list[Request] = []  # ended because their grammar did not compile (take_failed)
        self.startup_s = time.perf_counter() - start
        self.sampler_warm_up_s = 0.0  # warm_up_sampler's, once a server has run it
        # A server's engine process: its start and imports before the engine was built.
        self.process_start_s = 0.0
        if self.config.speculative is not None:
            logger.info("speculative decoding: %s", self.config.speculative.describe())
        logger.info("engine ready in %.1f s (%s)", self.startup_s,
                    ", ".join(f"{k} {v:.1f}" for k, v in self.startup_timings.items()))

    @property
    def num_kvcache_blocks(self) -> int:
        self._check_open()
        return self.executor.num_kvcache_blocks

    @property
    def startup_timings(self) -> dict[str, float]:
        """Seconds each start-up phase took: the engine's own, then the executor's."""
        return {**self._own_timings, **self.executor.timings}

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's recommended values (its generation_config.json,
        unless generation_config="vllm"), what a request without parameters samples with."""
        return SamplingParams(**self.generation_defaults)

    # -- requests -----------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, stream: bool = False,
                     request_id: str | None = None, engine_decodes: bool = True, priority: int = 0,
                     copy_params: bool = True) -> Request:
        """Tokenize and check a request (raises ValueError if it could never run) and make
        its params.n sequences. With stream=True, its text is detokenized as it grows, for
        stream_delta, unless engine_decodes=False (the server's API process decodes it, and
        OutputProcessor.next_piece hands out its tokens); stop strings need it anyway.
        priority: vLLM's (lower first), for scheduling_policy "priority". The request runs
        on a checked copy of params (as vLLM's), so that changing them later changes
        nothing; copy_params=False: params already the request's own, checked
        (RequestChecker.own), which no one changes."""
        self._check_open()
        token_ids, params, priority = self.checker.check_request(prompt, params, priority, True, copy_params)
        bad_words = self.checker.bad_words_token_ids(params)
        seqs = []
        for index in range(params.n):
            key = self._rng.getrandbits(62) if params.seed is None else seeded_key(params.seed, index)
            # The n completions share a prompt: the first computes its logprobs.
            prompt_logprobs = index == 0 and params.prompt_logprobs is not None and len(token_ids) > 1
            seq = Sequence(next(self._seq_ids), token_ids, params, self.config.kvcache_block_size, index, key,
                           bad_words, prompt_logprobs, priority)
            self.output_processor.attach(seq, stream, engine_decodes)
            seqs.append(seq)
        request_id = str(seqs[0].seq_id) if request_id is None else request_id
        request = Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, seqs, owner=self)
        if params.structured_outputs is not None:
            if self.grammars is None:
                self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            request.grammar = self.grammars.compile(params.structured_outputs)
            if request.grammar.done():
                self.compiled_grammar(request)  # a grammar known not to serve it: ValueError now
        return request

    def compiled_grammar(self, request: Request) -> Any:
        """request's compiled grammar, once compiled (this waits for it); ValueError if it does
        not compile, or if the request's own token constraints forbid every token it allows first."""
        compiled = request.grammar.result()
        self.grammars.check_first_token(compiled, request.params, request.seqs[0].bad_words, self.eos_token_ids)
        return compiled

    def add_request(self, request: Request) -> None:
        """Queue the request (once; not one that was aborted); one whose grammar is still
        compiling waits outside the scheduler until it is ready (step() admits it)."""
        self._check_open()
        if owned(request, self, "add_request").added or request.finished:
            raise ValueError(f"request {request.request_id} was added or aborted already; make a new one")
        request.added = True
        if request.grammar is not None and not request.grammar.done():
            self.compiling.append(request)
        else:
            self._admit(request)

    def _admit(self, request: Request) -> None:
        if request.grammar is not None:
            compiled = self.compiled_grammar(request)
            for seq in request.seqs:
                seq.grammar = self.grammars.sequence_grammar(compiled, self.reasoning, request.prompt_token_ids)
        self.scheduler.add(request.seqs[0], request.seqs[1:])

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready; end those whose grammar failed, with
        the error on the request: a ValueError where the spec does not compile, any other
        error (a compiler shut down, a matcher that would not build) as it came, and only
        that request's."""
        compiling, self.compiling = self.compiling, []
        for request in compiling:
            if not request.grammar.done():
                self.compiling.append(request)
                continue
            try:
                self._admit(request)
            except Exception as exc:
                request.error = exc
                self.abort_request(request)
                self.failed.append(request)

    def take_failed(self) -> list[Request]:
        """The requests ended since the last call because their grammar did not compile
        (request.error says why); LLM checks grammars before adding, a server reports these."""
        failed, self.failed = self.failed, []
        return failed

    def abort_request(self, request: Request) -> None:
        """Stop the request's sequences now and free their KV blocks (nothing once shut down)."""
        if owned(request, self, "abort_request") in self.compiling:
            self.compiling.remove(request)
        if self.scheduler is None:  # shut down: nothing runs
            return
        for seq in request.seqs:
            self.scheduler.abort(seq)

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule and launch one step, then read back the previous step's tokens while
        this one runs on the GPU.

        Keeping one step in flight hides the host's work (reading tokens, scheduling,
        building inputs) behind the GPU's. When the next schedule might preempt, which
        needs every token id on the host, the engine drains first.

        A step with structured outputs or bad words of several tokens cannot sample before
        the step in flight is read (grammars' bitmasks and bad words' bans need those
        tokens), so it goes in two halves: its model is
        queued in one call (`forwarded`), and the next call reads the step before it,
        schedules the step after it, samples it and queues the step after's model at once,
        so that the GPU waits for the host only while the bitmask is filled.
        """
        self._check_open()
        if self.compiling:
            self._admit_compiled()
        start, outputs_before = time.perf_counter(), self.output_processor.num_output_tokens
        updated, finished = self._read_before_schedule()
        seqs, is_prefill = self.scheduler.schedule()
        if self.forwarded is not None:  # the step before it is read: sample it now
            self._sample_forwarded()
        if not seqs:
            more, done = self.drain()
            if self.compiling and not (updated or more):  # only grammars to wait for: wait, not spin
                wait([request.grammar for request in self.compiling], COMPILE_WAIT_S, FIRST_COMPLETED)
            return StepResult(updated + more, finished + done, 0, is_prefill,
                              output_tokens=self.output_processor.num_output_tokens - outputs_before)
        # Counted before on_launch moves the sequences' tokens on
        prompt_tokens, decode_tokens, context_tokens = token_counts(seqs, is_prefill, self.trace is not None)
        more, done = self._launch_and_read(seqs, is_prefill)
        self.step_stats.record(is_prefill, prompt_tokens, decode_tokens, time.perf_counter() - start)
        if self.trace is not None:
            self.trace.add(is_prefill, prompt_tokens, decode_tokens, len(self.scheduler.running),
                           self.scheduler.num_waiting, context_tokens)
        return StepResult(updated + more, finished + done, prompt_tokens + decode_tokens, is_prefill, prompt_tokens,
                          self.output_processor.num_output_tokens - outputs_before)

    def _read_before_schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """Read back what must be known before scheduling: the step before a forwarded one
        (whose sampling waits for its tokens), and everything in flight where the next
        schedule might preempt or draft tokens. Returns (the sequences read, those that finished); a
        forwarded step left in `forwarded` is still to sample."""
        updated: list[Sequence] = []
        finished: list[Sequence] = []
        if self.forwarded is not None:
            updated, finished = self._read_inflight()
        unread = self.inflight is not None or self.forwarded is not None
        # Drafts follow the sequences' tokens (speculative decoding): all must be known, as after a
        # step that verified some, whose tokens per sequence the next step cannot know.
        verified = self.inflight is not None and self.inflight[0].seq_rows is not None
        known = verified or self.scheduler.drafts() or not self.scheduler.can_schedule_without_results()
        if unread and (self.drain_first or known):
            more, done = self.drain()
            return updated + more, finished + done
        return updated, finished

    def _launch_and_read(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[Sequence], list[Sequence]]:
        """Queue the scheduled step on the GPU and read back the step in flight: (the
        sequences read, those that finished). A step whose sampling needs the step in
        flight's tokens (needs_known_tokens) queues its model alone, as `forwarded`, and
        the step in flight stays to be read by the next call."""
        prev = self.inflight[0] if self.inflight else None
        with self._ending_on_error(seqs):
            if self.scheduler.proposer is not None:  # a draft model's drafts are written now
                self.scheduler.proposer.fill(seqs, self.executor)
            if prev is not None and any(seq.needs_known_tokens for seq in seqs):
                self.forwarded = (self.executor.forward(seqs, is_prefill, prev), self.scheduler.on_launch(seqs))
                return [], []
            launched = self.executor.launch(seqs, is_prefill, prev)
            samples = self.scheduler.on_launch(seqs)
        # In flight before the step before is read: were that read to fail, this one still is.
        previous, self.inflight = self.inflight, (launched, samples)
        return self._record(previous)

    def drain(self) -> tuple[list[Sequence], list[Sequence]]:
        """Finish what is in flight and record its tokens: (the sequences, those that
        finished). Leaves the engine idle between calls."""
        updated, finished = self._read_inflight()
        if self.forwarded is not None:
            self._sample_forwarded()
            more, done = self._read_inflight()
            updated, finished = updated + more, finished + done
        self.drain_first = False
        return updated, finished

    def _sample_forwarded(self) -> None:
        """Sample the forwarded step (its model already queued), making it the step in flight
        (read first: its sampling needed the tokens of the one before)."""
        (forwarded, samples), self.forwarded = self.forwarded, None
        with self._ending_on_error(forwarded.seqs):
            self.inflight = self.executor.sample(forwarded), samples

    def _read_inflight(self) -> tuple[list[Sequence], list[Sequence]]:
        step, self.inflight = self.inflight, None  # _record's, for the step in flight
        return self._record(step)

    def _record(self, step: tuple[LaunchedStep, list[bool]] | None) -> tuple[list[Sequence], list[Sequence]]:
        """Wait for a launched step's tokens and record them: (its sequences, those that finished)."""
        if step is None:
            return [], []
        launched, samples = step
        with self._ending_on_error(launched.seqs):
            finished = self.output_processor.process(launched.seqs, launched.token_ids(), samples,
                                                     launched.logprobs(), launched.prompt_logprobs, launched.seq_rows)
            self.scheduler.update(launched.seqs, finished)
        return launched.seqs, [seq for seq, _, _ in finished]

    @contextmanager
    def _ending_on_error(self, seqs: list[Sequence]):
        """Abort seqs where the block raises, then re-raise: a step that failed halfway leaves
        them tokens that no step will sample, so they end, and the engine serves the other
        sequences on. A failed launch may have taken the next set of the double buffers, so
        the next step reads what is in flight before it launches (drain_first)."""
        try:
            yield
        except BaseException:
            for seq in seqs:
                self.scheduler.abort(seq)
            self.drain_first = True
            raise

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, as vLLM's LLM.reset_prefix_cache does: so that a
        benchmark's next run computes its prompts again, or after the weights changed. False
        (with a warning), and nothing done, while requests run."""
        self._check_open()
        if not self.is_finished() or not self.scheduler.block_manager.reset_prefix_cache():
            logger.warning("the prefix cache was not reset: requests are still running")
            return False
        return True

    def is_finished(self) -> bool:
        """Whether nothing is left to run (always, once shut down)."""
        return self.scheduler is None or (self.scheduler.is_finished() and self.inflight is None
                                          and self.forwarded is None and not self.compiling)

    # -- outputs (the OutputProcessor's) ------------------------------------------------

    def stream_delta(self, seq: Sequence) -> CompletionOutput:
        """What seq (of a request made with stream=True) has produced since the last call."""
        return self.output_processor.stream_delta(seq)

    def output(self, request: Request) -> RequestOutput:
        return self.output_processor.request_output(owned(request, self, "output"))

    def new_outputs(self, request: Request, stream: bool) -> list[CompletionOutput]:
        """What is new in a request since the last call (see OutputProcessor.new_outputs)."""
        return self.output_processor.new_outputs(request, stream)

    def next_piece(self, seq: Sequence) -> tuple[str | None, int, int] | None:
        """A streamed seq's new text and token range (see OutputProcessor.next_piece)."""
        return self.output_processor.next_piece(seq)

    def prompt_logprobs(self, request: Request) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs (see OutputProcessor.prompt_logprobs)."""
        return self.output_processor.prompt_logprobs(request)

    # -- statistics and lifetime --------------------------------------------------------

    def reset_stats(self) -> None:
        """Start the step, CUDA-graph, preemption and prefix-cache statistics afresh (e.g.
        after a warm-up); start-up times stay."""
        self._check_open()
        self.step_stats = StepStats()
        self.executor.reset_graph_stats()
        self.scheduler.reset_stats()
        self.output_processor.reset_stats()

    def stats(self) -> dict[str, float | str]:
        """What the engine has done so far (engine/stats.py's engine_stats)."""
        self._check_open()
        return engine_stats(self)

    def warm_up_sampler(self) -> float:
        """Compile the sampler's filtered paths now (a server does, before it reports
        ready); returns the seconds it took (also in stats() as startup_sampler_warm_up_s)."""
        self._check_open()
        self.sampler_warm_up_s = self.executor.warm_up_sampler()
        return self.sampler_warm_up_s

    def _check_open(self) -> None:
        if self.executor is None:
            raise RuntimeError("this LLM is shut down; create a new one")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and release the model and KV cache; the engine
        is unusable afterwards. Safe to call twice."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()
        if getattr(self, "trace", None) is not None:
            trace, self.trace = self.trace, None
            trace.write()
        if getattr(self, "grammars", None) is not None:  # its thread, and the compiled grammars it caches
            self.grammars.shutdown()
            self.grammars = None
        self.executor = self.scheduler = self.inflight = self.forwarded = None
        self.compiling = []
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
