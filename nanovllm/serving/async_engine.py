"""AsyncLLMEngine: an LLMEngine in its own process (engine_process.py), for asyncio servers.

The engine process owns the model and steps it while there is work; each step's new
output comes back as a StepOutputs message (messages.py), which a receiver thread reads
from the pipe and the event loop hands to each request's consumer. Many concurrent
requests thus share one continuously batched engine, and the event loop's Python work
no longer competes with the engine's for one interpreter lock.

make_request (frontend.py's RequestFrontend) tokenizes and checks a request in this process
(the tokenizer and the limits are loaded here too), so bad input costs no engine time and
gets its ValueError at once; check_structured_outputs does the same for a grammar.

A consumer that stops listening (client disconnect, cancelled task) aborts its requests:
the abort reaches the engine before its next step, which frees their KV blocks.
If the engine process dies, every running request fails with EngineDeadError.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.detokenizer import StreamText
from nanovllm.engine.model_files import load_tokenizer
from nanovllm.engine.reasoning import ReasoningTags
from nanovllm.outputs import CompletionOutput
from nanovllm.serving.messages import (
    AbortRequests,
    EngineFailed,
    EngineReady,
    EngineRequest,
    EngineTokenizer,
    RequestMetrics,
    ResetPrefixCache,
    StartupFailed,
    StepOutputs,
    StreamColumns,
    is_plain_stream,
)
from nanovllm.serving.deltas import RequestDelta, merge_deltas
from nanovllm.serving.frontend import RequestFrontend
from nanovllm.serving.spawn import EngineProcess, spawn_engine

logger = logging.getLogger(__name__)

# Seconds the engine process gets to finish its step and release the model after the
# shut-down message before it is killed.
ENGINE_EXIT_TIMEOUT_S = 30.0
# The engine loop sends a message at least every HEARTBEAT_INTERVAL_S (engine_process.py);
# after this long without one it counts as stuck, and /health says 503.
HEALTH_TIMEOUT_S = 10.0


def _pickled(tokenizer: PreTrainedTokenizerBase) -> bytes | None:
    try:
        return pickle.dumps(tokenizer)
    except Exception as exc:  # e.g. a remote-code tokenizer holding something unpicklable
        logger.info("the tokenizer does not pickle (%s): the engine process loads its own", exc)
        return None


def _fail_future(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class EngineDeadError(RuntimeError):
    """The engine has stopped (shut down, or failed); no request can run."""


class _Consumer:
    """The asyncio side of one generate() call: deltas delivered from the engine's messages."""

    __slots__ = ("error", "event", "pending")

    def __init__(self) -> None:
        self.pending: list[RequestDelta] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


class AsyncLLMEngine(RequestFrontend):
    """An LLMEngine run by an engine process, for asyncio code.

        engine = AsyncLLMEngine(model, engine_args)      # builds the engine there; its errors raise here
        engine.start()                                   # inside the running event loop
        request = engine.make_request(prompt, params, stream=True)   # ValueError if invalid
        async for deltas in engine.generate([request], stream=True):
            ...
        engine.shutdown()
    """

    def __init__(self, model: str, engine_args: dict, on_finished: Callable[[RequestMetrics], None] | None = None,
                 visible_devices: str | None = None, process: EngineProcess | None = None):
        """process: the engine process for (model, engine_args), if already started
        (spawn.py; `nanovllm serve` starts it before its own imports)."""
        self.on_finished = on_finished  # called on the event loop with each finished request's metrics
        self.on_stopped: Callable[[str], None] | None = None  # called on the event loop if the engine dies
        process = process or spawn_engine(model, engine_args, visible_devices)
        self._process, self._conn = process.process, process.conn
        # The pipe is read and written by two threads, with blocking calls: a send that
        # waits on a full pipe (the engine busy stepping) must not stop the engine's
        # outputs from being read, or each side would wait for the other. Not through the
        # event loop (add_reader): uvloop makes a watched descriptor non-blocking, and a
        # Connection's send then fails on a full pipe instead of waiting.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="nanovllm-engine-sender", daemon=True)
        self._sender.start()
        self._receiver: threading.Thread | None = None  # started by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        # request_id -> its consumer, its index there, and its text decoder where this process
        # decodes it (a plain stream without stop strings: the engine sends tokens alone)
        self._consumers: dict[str, tuple[_Consumer, int, StreamText | None]] = {}
        self._resets: deque[asyncio.Future] = deque()  # reset_prefix_cache calls awaiting their answer
        self.decode_streams = True  # plain streams' text decoded here (_stream_decoder)
        self._stopping = False
        self.error: str | None = None  # why the engine stopped, if it failed
        ready = None
        try:
            # The tokenizer first, sent to the engine process, which builds the model meanwhile
            # and so need not import AutoTokenizer itself (messages.EngineTokenizer).
            config = Config.from_kwargs(model, **engine_args)
            tokenizer = load_tokenizer(config)
            if config.reasoning_parser:  # one the tokenizer lacks: refused without waiting for the engine
                ReasoningTags.load(config.reasoning_parser, tokenizer)
            self._outbox.put(EngineTokenizer(_pickled(tokenizer)))
            ready = self._wait_ready()
            RequestFrontend.__init__(self, config, ready.num_kvcache_blocks, tokenizer)
        except BaseException:
            if ready is None:  # still building, and reads nothing until it has: nothing to drain
                self._process.kill()
            self.shutdown()
            raise
        self.latest_stats: dict[str, float] = ready.stats
        self.last_heard = time.monotonic()  # when the engine loop's last message arrived
        stats = self.latest_stats
        logger.info("engine process %d ready: %.1f s to start and import, %.1f s to build the engine, %.1f s to "
                    "compile the sampler's filtered paths", self._process.pid, stats.get("startup_process_s", 0.0),
                    stats.get("startup_s", 0.0), stats.get("startup_sampler_warm_up_s", 0.0))

    def _wait_ready(self) -> EngineReady:
        """The engine process's first message; what building the LLM raised, raised here."""
        try:
            ready = self._conn.recv()
        except EOFError:
            self._process.join(ENGINE_EXIT_TIMEOUT_S)
            raise RuntimeError(f"the engine process exited with status {self._process.exitcode} while starting") from None
        if isinstance(ready, StartupFailed):
            raise ready.error
        assert isinstance(ready, EngineReady), ready
        return ready

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.latest_stats.get("prompt_tokens_total", 0))

    @property
    def num_generation_tokens(self) -> int:
        return int(self.latest_stats.get("generation_tokens_total", 0))

    # -- lifetime -----------------------------------------------------------------------

    def start(self) -> None:
        """Deliver the engine's messages on the running event loop."""
        if self._loop is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._receiver = threading.Thread(target=self._receive_loop, name="nanovllm-engine-receiver", daemon=True)
        self._receiver.start()

    def shutdown(self) -> None:
        """Stop the engine process (its requests end) and fail whatever still waits. Safe to call twice."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put(None)
        self._wait_exit()
        self._fail_all("the engine stopped (shutting down)")

    def abort_all(self) -> None:
        """End every running request before the next step (finish_reason "abort"): each
        consumer still gets what was generated, and a proper end. For shutting down."""
        self._send(AbortRequests(None))

    async def reset_prefix_cache(self) -> bool:
        """LLMEngine.reset_prefix_cache in the engine process, before its next step: False
        while requests run there. Raises EngineDeadError if the engine stops first."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.error or 'shut down'}")
        answer = self._loop.create_future()
        self._resets.append(answer)
        self._send(ResetPrefixCache())
        return await answer

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._stopping and self.error is None and self._process.is_alive()

    @property
    def is_healthy(self) -> bool:
        """Running, and its loop was heard from lately (a stopped or stuck process is not)."""
        return self.is_running and time.monotonic() - self.last_heard < HEALTH_TIMEOUT_S

    def _wait_exit(self) -> None:
        self._process.join(ENGINE_EXIT_TIMEOUT_S)
        if self._process.exitcode is None:
            logger.warning("the engine process did not exit in %g s; killing it", ENGINE_EXIT_TIMEOUT_S)
            self._process.kill()
            self._process.join()
        self._sender.join()  # it ends with its None, or at once on the closed pipe
        if self._receiver is not None:
            self._receiver.join(ENGINE_EXIT_TIMEOUT_S)  # it ends at the pipe's end, now that the engine has exited
        self._conn.close()

    def _fail_all(self, message: str) -> None:
        consumers = {id(consumer): consumer for consumer, _, _ in self._consumers.values()}
        self._consumers.clear()
        for consumer in consumers.values():
            consumer.fail(EngineDeadError(message))
        while self._resets:  # shutdown() may run on another thread than the futures' loop
            answer = self._resets.popleft()
            try:
                answer.get_loop().call_soon_threadsafe(_fail_future, answer, EngineDeadError(message))
            except RuntimeError:  # that loop is closed: nobody awaits the answer
                pass

    def _send(self, message: list[EngineRequest] | AbortRequests | ResetPrefixCache) -> None:
        self._outbox.put(message)

    def _send_loop(self) -> None:
        """The sender thread: messages to the engine in order, then None (shut down)."""
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except OSError:  # the engine process is gone; the receiver sees the pipe's end
                return
            if message is None:
                return

    def _receive_loop(self) -> None:
        """The receiver thread: the engine's messages (lists of them), handed to the event
        loop in order, until the engine fails or its end of the pipe closes ([None] then)."""
        while True:
            try:
                messages = self._conn.recv()
                self.last_heard = time.monotonic()
            except (EOFError, OSError):  # the engine process has exited
                messages = [None]
            try:
                self._loop.call_soon_threadsafe(self._on_messages, messages)
            except RuntimeError:  # the event loop is closed: nobody listens any more
                return
            if not isinstance(messages[-1], StepOutputs):
                return

    # -- requests -----------------------------------------------------------------------

    async def generate(self, requests: list[EngineRequest], stream: bool = False) -> AsyncIterator[list[RequestDelta]]:
        """Run requests (made by make_request, with unique request ids) and yield their
        progress: lists of RequestDelta, at most one per request, until all have finished.
        stream=True yields new text after every step (the requests must have been made with
        stream=True, and the others with stream=False); otherwise each request's whole
        output once it finishes. Leaving the loop early (break, cancellation, a disconnected
        client) aborts what is unfinished."""
        if any(request.stream != stream for request in requests):
            raise ValueError(f"generate(stream={stream}) needs requests made with make_request(..., stream={stream})")
        if not self.is_running:
            raise EngineDeadError("the engine is not running" + (f": it failed with {self.error}" if self.error else ""))
        for request in requests:
            if request.request_id in self._consumers:
                raise ValueError(f"request id {request.request_id!r} is already running")
        consumer = _Consumer()
        now = time.monotonic()
        decoders = [self._stream_decoder(request, stream) for request in requests]
        for i, (request, decoder) in enumerate(zip(requests, decoders)):
            request.arrival_time = now
            request.engine_decodes = decoder is None
            self._consumers[request.request_id] = (consumer, i, decoder)
        self._send(requests)
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
                ours = [r.request_id for r in requests if self._consumers.get(r.request_id, (None,))[0] is consumer]
                for request_id in ours:
                    del self._consumers[request_id]
                if ours and not self._stopping:
                    self._send(AbortRequests(ours))

    def _stream_decoder(self, request: EngineRequest, stream: bool) -> StreamText | None:
        """A decoder here for a plain stream without stop strings (the engine process then
        sends its tokens alone); None where the engine decodes: stop strings need the text
        where the stop is decided, and with decode_streams off (several replicas, whose
        engine processes share the work better than this one event loop)."""
        params = request.params
        if not (self.decode_streams and is_plain_stream(params, stream) and not params.stop):
            return None
        return StreamText(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                          params.include_stop_str_in_output)

    # -- the engine's messages (event loop) -------------------------------------------------

    def _on_messages(self, messages: list[StepOutputs | EngineFailed | None]) -> None:
        """On the event loop: steps' outputs, then maybe the engine's failure or (None) its exit."""
        for message in messages:
            if isinstance(message, StepOutputs):
                self._deliver(message)
            else:
                self._on_stop(message)

    def _on_stop(self, message: EngineFailed | None) -> None:
        if self._stopping:  # shutdown() is ending it and fails what still waits
            return
        if isinstance(message, EngineFailed):
            self.error = message.message
        else:
            self._process.join(ENGINE_EXIT_TIMEOUT_S)  # it has closed its end: it is exiting
            self.error = f"the engine process exited unexpectedly (status {self._process.exitcode})"
        logger.error("the engine stopped: %s", self.error)
        self._fail_all(f"the engine stopped: {self.error}")
        if self.on_stopped is not None:
            self.on_stopped(f"the engine stopped: {self.error}")

    def _deliver_streams(self, streams: StreamColumns) -> None:
        """Plain streams' new output: one CompletionOutput each, built here rather than in
        the engine process (which only sends the columns), and the text decoded here where
        the engine sent none."""
        consumers = self._consumers
        for request_id, text, token_ids, finish_reason, stop_reason in zip(
                streams.request_ids, streams.texts, streams.token_ids, streams.finish_reasons, streams.stop_reasons):
            entry = consumers.get(request_id)
            if entry is None:  # aborted since
                continue
            consumer, index, decoder = entry
            if text is None:
                try:
                    text = decoder.add(token_ids, finish_reason, stop_reason)
                except Exception as exc:  # this request fails; the others' outputs still go out
                    logger.exception("request %s: decoding its tokens failed", request_id)
                    del consumers[request_id]
                    consumer.fail(RuntimeError(f"decoding the output failed: {exc!r}"))
                    if finish_reason is None:
                        self._send(AbortRequests([request_id]))
                    continue
            finished = finish_reason is not None
            output = CompletionOutput(0, text, token_ids, finish_reason, stop_reason)
            consumer.pending.append(RequestDelta(index, [output], finished,
                                                 num_cached_tokens=streams.cached_tokens.get(request_id)))
            consumer.event.set()
            if finished:
                del consumers[request_id]

    def _deliver(self, step: StepOutputs) -> None:
        if step.streams is not None:
            self._deliver_streams(step.streams)
        for delta in step.deltas:
            entry = self._consumers.get(delta.request_id)
            if entry is None:  # aborted since
                continue
            consumer, index, _ = entry
            consumer.pending.append(RequestDelta(index, delta.outputs, delta.finished, delta.prompt_logprobs,
                                                 delta.num_cached_tokens))
            consumer.event.set()
            if delta.finished:
                del self._consumers[delta.request_id]
        for request_id, error in step.errors:
            entry = self._consumers.pop(request_id, None)
            if entry is not None:
                entry[0].fail(error)
        for reset in step.prefix_cache_resets or ():
            if not self._resets:  # shutdown() has failed them already
                break
            answer = self._resets.popleft()
            if not answer.done():  # not cancelled
                answer.set_result(reset)
        self.latest_stats = step.stats
        if self.on_finished is not None:
            for metrics in step.finished:
                self.on_finished(metrics)
