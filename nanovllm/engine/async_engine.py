"""AsyncLLMEngine: the engine loop in a background thread, for asyncio servers.

One thread owns the LLMEngine. While there is work it applies the commands queued
since its last step (add requests, abort requests), runs one step(), and hands every
request's new output to its asyncio consumer with a single loop.call_soon_threadsafe
per step; with no work it sleeps on a condition variable. Many concurrent requests
thus share one continuously batched engine.

The asyncio side touches the engine only through make_request, which tokenizes and
checks a request (and raises ValueError for one that could never run) without
changing any engine state, so it runs on the event loop while the engine thread
steps. Everything else crosses the thread boundary as a command or as RequestDelta
records.

A consumer that stops listening (client disconnect, cancelled task) aborts its
requests: the abort is applied before the engine's next step, which frees their KV
blocks.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from nanovllm.engine.llm_engine import Prompt, Request
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or failed); no request can run."""


@dataclass(slots=True)
class RequestMetrics:
    """When a request arrived, got its first token and finished (time.monotonic()), and
    how many tokens it used."""

    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # over all n completions
    longest_completion: int = 0  # tokens of its longest completion

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two)."""
        if self.finished_time is None or self.first_token_time is None or self.longest_completion < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.longest_completion - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestDelta:
    """What one request of a generate() call produced since its consumer last looked.

    index: the request's position in generate()'s list. outputs: for a streamed request,
    the new text / tokens / logprobs of each completion that changed (its finish_reason
    set once it has finished); otherwise every completion in full, once all are done.
    """

    index: int
    outputs: list[CompletionOutput]
    finished: bool = False


class _Consumer:
    """The asyncio side of one generate() call: deltas delivered by the engine thread."""

    __slots__ = ("error", "event", "pending")

    def __init__(self) -> None:
        self.pending: list[RequestDelta] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None


@dataclass(slots=True)
class _Tracked:
    """The engine thread's record of one running request."""

    request: Request
    index: int
    consumer: _Consumer
    stream: bool
    metrics: RequestMetrics
    num_tokens: int = 0  # completion tokens seen so far, over all n completions
    reported: set[int] = field(default_factory=set)  # completions whose end the consumer has had


def _deliver(batch: list[tuple[_Consumer, RequestDelta | BaseException]]) -> None:
    """Runs on the event loop: hand each consumer what the engine thread produced."""
    for consumer, item in batch:
        if isinstance(item, BaseException):
            consumer.error = item
        else:
            consumer.pending.append(item)
        consumer.event.set()


def _merge_outputs(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    """Two consecutive stream deltas of one completion as one."""
    logprobs = None if old.logprobs is None and new.logprobs is None else (old.logprobs or []) + (new.logprobs or [])
    return CompletionOutput(old.index, old.text + new.text, old.token_ids + new.token_ids, new.finish_reason,
                            new.stop_reason, logprobs, new.cumulative_logprob)


def merge_deltas(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """Fold the deltas that piled up while the consumer was busy: one per request, each
    completion's pieces joined in order. Fewer, larger chunks when a client lags."""
    merged: dict[int, RequestDelta] = {}
    for delta in deltas:
        into = merged.get(delta.index)
        if into is None:
            merged[delta.index] = RequestDelta(delta.index, list(delta.outputs), delta.finished)
            continue
        by_index = {out.index: i for i, out in enumerate(into.outputs)}
        for out in delta.outputs:
            if out.index in by_index:
                into.outputs[by_index[out.index]] = _merge_outputs(into.outputs[by_index[out.index]], out)
            else:
                into.outputs.append(out)
        into.finished = into.finished or delta.finished
    return list(merged.values())


class AsyncLLMEngine:
    """An LLM driven by a background thread, for asyncio code.

        engine = AsyncLLMEngine(LLM(model, **engine_args))
        engine.start()                                   # inside the running event loop
        request = engine.make_request(prompt, params, stream=True)   # ValueError if invalid
        async for deltas in engine.generate([request], stream=True):
            ...
        engine.shutdown()
    """

    def __init__(self, llm: LLM, on_finished: Callable[[RequestMetrics], None] | None = None):
        self.llm = llm
        self.on_finished = on_finished  # called on the engine thread with each finished request's metrics
        self._cond = threading.Condition()
        self._to_add: list[_Tracked] = []
        self._to_abort: list[Request] = []
        self._abort_all = False
        self._stopping = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active: dict[str, _Tracked] = {}  # request_id -> record; engine thread only
        self._by_seq: dict[int, _Tracked] = {}  # seq_id -> record of its request; engine thread only
        self.error: BaseException | None = None  # what stopped the loop, if it failed
        # Written by the engine thread after every step, read by anyone (e.g. /metrics).
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.latest_stats: dict[str, float] = self._stats()

    # -- lifetime -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; outputs go to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Abort every request, stop the engine thread and release the model. Safe to call twice."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.llm.shutdown()

    def abort_all(self) -> None:
        """End every running request before the next step (finish_reason "abort"): each
        consumer still gets what was generated, and a proper end. For shutting down."""
        with self._cond:
            self._abort_all = True
            self._cond.notify()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- requests (event loop side) -------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, stream: bool = False,
                     request_id: str | None = None) -> Request:
        """LLMEngine.make_request: tokenize and check, raising ValueError for a request that
        could never run. Safe on the event loop while the engine thread steps: it reads only
        fixed settings (max_model_len, the cache size) and touches no state the steps use."""
        return self.llm.make_request(prompt, params, stream=stream, request_id=request_id)

    async def generate(self, requests: list[Request], stream: bool = False) -> AsyncIterator[list[RequestDelta]]:
        """Run requests (made by make_request, with unique request ids) and yield their
        progress: lists of RequestDelta, at most one per request, until all have finished.
        stream=True yields new text after every step (the requests must have been made with
        stream=True); otherwise each request's whole output once it finishes. Leaving the
        loop early (break, cancellation, a disconnected client) aborts what is unfinished."""
        if stream and any(seq.detokenizer is None for request in requests for seq in request.seqs):
            raise ValueError("generate(stream=True) needs requests made with make_request(..., stream=True)")
        consumer = _Consumer()
        now = time.monotonic()
        tracked = [_Tracked(request, i, consumer, stream, RequestMetrics(now, len(request.prompt_token_ids)))
                   for i, request in enumerate(requests)]
        self._submit(add=tracked)
        unfinished = len(requests)
        try:
            while unfinished:
                await consumer.event.wait()
                consumer.event.clear()
                if consumer.error is not None:
                    raise consumer.error
                deltas, consumer.pending = merge_deltas(consumer.pending), []
                unfinished -= sum(delta.finished for delta in deltas)
                yield deltas
        finally:
            if unfinished:
                self._submit(abort=[t.request for t in tracked], check=False)

    def _submit(self, add: list[_Tracked] = (), abort: list[Request] = (), check: bool = True) -> None:
        with self._cond:
            if check and (self._stopped or self._stopping or self._thread is None):
                raise EngineDeadError("the engine is not running" + (f": it failed with {self.error!r}" if self.error else ""))
            self._to_add += add
            self._to_abort += abort
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.llm
        try:
            while True:
                with self._cond:
                    while not (self._to_add or self._to_abort or self._abort_all or self._stopping) \
                            and engine.is_finished():
                        self._cond.wait()
                    if self._stopping:
                        break
                    to_add, self._to_add = self._to_add, []
                    to_abort, self._to_abort = self._to_abort, []
                    abort_all, self._abort_all = self._abort_all, False
                batch = self._apply(to_add, to_abort, abort_all)
                finished = engine.step()[0] if not engine.is_finished() else []
                # Only running sequences and those that just ended can have new output.
                changed = self._active.values() if abort_all else {
                    id(t): t for seq in itertools.chain(engine.scheduler.running, finished)
                    if (t := self._by_seq.get(seq.seq_id)) is not None}.values()
                batch += self._collect(list(changed))
                self.latest_stats = self._stats()
                if batch:
                    self._call_soon(batch)
        except Exception as exc:  # a bug or a device error: fail every request, keep the process up
            logger.exception("the engine loop failed; no further requests will run")
            self.error = exc
        finally:
            with self._cond:
                self._stopped = True
                leftover = self._to_add + list(self._active.values())
                self._to_add, self._to_abort = [], []
            error = EngineDeadError("the engine stopped" + (f": {self.error!r}" if self.error else " (shutting down)"))
            for tracked in self._active.values():
                engine.abort_request(tracked.request)
            self._active.clear()
            self._by_seq.clear()
            if leftover:
                self._call_soon([(t.consumer, error) for t in leftover])
            if self.error is None:  # after a failure the step in flight may be broken too
                engine.drain()
                self.latest_stats = self._stats()

    def _call_soon(self, batch: list) -> None:
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _apply(self, to_add: list[_Tracked], to_abort: list[Request], abort_all: bool) -> list:
        """Queue new requests in the engine and abort cancelled ones (adds first: a request
        can be added and aborted between two steps); with abort_all, end every request, to
        be reported by _collect. Returns errors for consumers."""
        errors = []
        for tracked in to_add:
            request_id = tracked.request.request_id
            if request_id in self._active:
                errors.append((tracked.consumer, ValueError(f"request id {request_id!r} is already running")))
                continue
            try:
                self.llm.add_request(tracked.request)
            except ValueError as exc:
                errors.append((tracked.consumer, exc))
                continue
            self._active[request_id] = tracked
            self._by_seq.update((seq.seq_id, tracked) for seq in tracked.request.seqs)
        for request in to_abort:
            tracked = self._active.get(request.request_id)
            if tracked is not None and tracked.request is request:
                del self._active[request.request_id]
                for seq in request.seqs:
                    del self._by_seq[seq.seq_id]
                self.llm.abort_request(request)
        if abort_all:
            for tracked in self._active.values():
                self.llm.abort_request(tracked.request)
        return errors

    def _collect(self, changed: list[_Tracked]) -> list[tuple[_Consumer, RequestDelta]]:
        """After a step: the new output (stream) or final output of each request that may
        have changed, with its timing."""
        engine = self.llm
        now = time.monotonic()
        batch = []
        done = []
        for tracked in changed:
            request = tracked.request
            request_id = request.request_id
            num_tokens = sum(seq.num_known_completion_tokens for seq in request.seqs)
            finished = request.finished
            if num_tokens == tracked.num_tokens and not finished:
                continue
            metrics = tracked.metrics
            if metrics.first_token_time is None and num_tokens:
                metrics.first_token_time = now
                self.num_prompt_tokens += metrics.num_prompt_tokens
            self.num_generation_tokens += num_tokens - tracked.num_tokens
            tracked.num_tokens = num_tokens
            if tracked.stream:
                outputs = []
                for seq in request.seqs:
                    if seq.index in tracked.reported:
                        continue
                    delta = engine.stream_delta(seq)
                    if delta.finish_reason is not None:
                        tracked.reported.add(seq.index)
                    if delta.text or delta.token_ids or delta.finish_reason is not None:
                        outputs.append(delta)
            elif finished:
                outputs = [engine.completion(seq) for seq in request.seqs]
            else:
                continue
            if finished:
                metrics.finished_time = now
                metrics.num_generation_tokens = num_tokens
                metrics.longest_completion = max(seq.num_completion_tokens for seq in request.seqs)
                done.append(request_id)
            if outputs or finished:
                batch.append((tracked.consumer, RequestDelta(tracked.index, outputs, finished)))
        for request_id in done:
            tracked = self._active.pop(request_id)
            for seq in tracked.request.seqs:
                del self._by_seq[seq.seq_id]
            if self.on_finished is not None:
                self.on_finished(tracked.metrics)
        return batch

    def _stats(self) -> dict[str, float]:
        """What /metrics shows: the engine's stats plus queue lengths and token counters."""
        stats = self.llm.stats()
        scheduler = self.llm.scheduler
        stats.update(
            num_requests_running=len(scheduler.running),
            num_requests_waiting=len(scheduler.waiting),
            kv_cache_usage=stats["kv_blocks_used"] / max(stats["kv_blocks_total"], 1),
            prompt_tokens_total=self.num_prompt_tokens,
            generation_tokens_total=self.num_generation_tokens,
        )
        return stats
