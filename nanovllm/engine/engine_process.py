"""The engine process: an LLM stepped in a process of its own, driven over a pipe.

The OpenAI server's event loop spends ~45 us of CPU per streamed chunk; in one process it
would take the interpreter lock from the engine's Python work (scheduling, detokenizing)
for a large share of every step. So AsyncLLMEngine (async_engine.py) starts run_engine in
a spawned process and the two talk over one duplex multiprocessing Pipe of small
pickled records:

    API -> engine   list[EngineRequest]    requests to add (tokenized and checked already)
                    AbortRequests          requests to end now (their KV blocks freed)
                    None                   shut down
    engine -> API   EngineReady            once, after the LLM is built (or StartupFailed)
                    StepOutputs            once per step: new output, refusals, stats
                    EngineFailed           the loop failed; the process exits

A step's StepOutputs carries, per request that changed, only what is new: the text,
token ids (and logprobs) since the last step, or a non-streamed request's whole output
once it finishes. A thread of the engine process sends them (_Outbox), so that a step
never waits for the API process to read: steps whose outputs pile up meanwhile go as
one message.
"""
from __future__ import annotations

import faulthandler
import itertools
import logging
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from nanovllm.engine.llm_engine import Request
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.pickling import freeze_startup_objects, pickle_as_arguments

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


@pickle_as_arguments
@dataclass(slots=True)
class RequestMetrics:
    """When a request arrived, got its first token and finished (time.monotonic(), one
    clock for all processes of the machine), and how many tokens it used."""

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


@pickle_as_arguments
@dataclass(slots=True)
class EngineRequest:
    """A checked request, as AsyncLLMEngine.make_request returns it and the engine takes it.
    stream: report new text after every step, rather than the whole output at the end."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    arrival_time: float = 0.0  # set by AsyncLLMEngine.generate


@dataclass(slots=True)
class AbortRequests:
    request_ids: list[str] | None  # None: every request


@dataclass(slots=True)
class EngineReady:
    """The LLM is built; what the API process needs to check requests without it."""

    num_kvcache_blocks: int
    stats: dict[str, float]  # StepOutputs.stats before the first step


@dataclass(slots=True)
class StartupFailed:
    error: BaseException  # what building the LLM raised (a RuntimeError with its text if it does not pickle)


@dataclass(slots=True)
class EngineFailed:
    message: str


@pickle_as_arguments
@dataclass(slots=True)
class RequestOutputDelta:
    """One request's output of a step: the new pieces of each completion that changed
    (stream), or every completion in full once all are done."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


@pickle_as_arguments
@dataclass(slots=True)
class StepOutputs:
    deltas: list[RequestOutputDelta]
    errors: list[tuple[str, ValueError]]  # requests the engine refused: (request id, why)
    finished: list[RequestMetrics]  # requests that ended this step
    stats: dict[str, float]  # what /metrics shows, after the step

    def followed_by(self, later: StepOutputs) -> StepOutputs:
        """This step's and a later step's outputs as one message (the later stats)."""
        return StepOutputs(self.deltas + later.deltas, self.errors + later.errors, self.finished + later.finished,
                           later.stats)


@dataclass(slots=True)
class _Tracked:
    """The engine process's record of one running request."""

    request: Request
    stream: bool
    metrics: RequestMetrics
    num_tokens: int = 0  # completion tokens seen so far, over all n completions
    reported: set[int] = field(default_factory=set)  # completions whose end has been sent


def run_engine(model: str, engine_args: dict, conn: Connection, log_level: int) -> None:
    """The engine process's main function: build the LLM, then serve conn until told to
    stop or until the API process goes away."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    # Ctrl-C reaches the whole process group; the API process decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGUSR1 (the API process forwards its own) prints every thread's stack to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        llm = LLM(model, **engine_args)
    except Exception as exc:
        conn.send(StartupFailed(_picklable(exc)))
        return
    try:
        try:
            seconds = llm.model_runner.warm_up_sampler()
        except Exception as exc:
            conn.send(StartupFailed(_picklable(exc)))
            return
        if seconds:
            logger.info("sampler's filtered paths compiled in %.1f s", seconds)
        freeze_startup_objects()
        loop = EngineLoop(llm, conn)
        loop.outbox.put(EngineReady(llm.scheduler.block_manager.num_blocks, loop.stats()))
        loop.run()
    finally:
        llm.shutdown()


def _picklable(exc: Exception) -> Exception:
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Outbox:
    """The engine process's messages to the API process, sent by a thread in order.

    A send blocks while the pipe is full, that is while the API process is busy; the
    engine loop only queues, so it goes on stepping. Consecutive StepOutputs waiting in
    the queue go as one message: fewer, larger reads for the API process when it lags.
    """

    _STOP = object()

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.gone = threading.Event()  # set when a send fails: the API process has exited
        self.messages = 0
        self.send_s = 0.0  # time spent in send, most of it waiting for the API process to read
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine-sender", daemon=True)
        self._thread.start()

    def put(self, message: object) -> None:
        self._queue.put(message)

    def close(self, timeout: float) -> None:
        """Send what is queued (waiting at most timeout seconds), then stop the thread."""
        self._queue.put(self._STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        backlog: list = []
        while True:
            backlog.append(self._queue.get())
            while True:
                try:
                    backlog.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            while backlog:
                message = backlog.pop(0)
                if message is self._STOP:
                    return
                while isinstance(message, StepOutputs) and backlog and isinstance(backlog[0], StepOutputs):
                    message = message.followed_by(backlog.pop(0))
                start = time.perf_counter()
                try:
                    self._conn.send(message)
                except OSError:
                    self.gone.set()
                    return
                self.send_s += time.perf_counter() - start
                self.messages += 1


# How long the sender thread may take to send the last messages once the loop has ended.
_FLUSH_TIMEOUT_S = 10.0


class EngineLoop:
    """Apply the commands that arrived since the last step, step, queue what changed."""

    def __init__(self, llm: LLM, conn: Connection):
        self.llm = llm
        self.conn = conn
        self.outbox = _Outbox(conn)
        self.active: dict[str, _Tracked] = {}  # request_id -> record
        self.by_seq: dict[int, _Tracked] = {}  # seq_id -> record of its request
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.step_s = 0.0  # in engine.step()
        self.collect_s = 0.0  # building the steps' outputs
        self.intake_s = 0.0  # reading and adding requests
        self.idle_s = 0.0  # waiting for requests with nothing to do, since the first step

    def run(self) -> None:
        engine = self.llm
        try:
            while not self.outbox.gone.is_set():
                received, idle = time.perf_counter(), self.idle_s
                if (commands := self._receive(wait=engine.is_finished())) is None:
                    break
                errors, abort_all = self._apply(commands)
                start = time.perf_counter()
                self.intake_s += start - received - (self.idle_s - idle)
                finished = []
                if not engine.is_finished():
                    finished = engine.step()[0]
                    self.num_steps += 1
                stepped = time.perf_counter()
                # Only running sequences and those that just ended can have new output.
                changed = self.active.values() if abort_all else {
                    id(t): t for seq in itertools.chain(engine.scheduler.running, finished)
                    if (t := self.by_seq.get(seq.seq_id)) is not None}.values()
                deltas, done = self._collect(list(changed))
                self.outbox.put(StepOutputs(deltas, errors, done, self.stats()))
                self.step_s += stepped - start
                self.collect_s += time.perf_counter() - stepped
        except (BrokenPipeError, ConnectionResetError):  # the API process is gone
            pass
        except Exception as exc:  # a bug or a device error: the API process fails every request
            logger.exception("the engine loop failed; no further requests will run")
            self.outbox.put(EngineFailed(repr(exc)))
            self.outbox.close(_FLUSH_TIMEOUT_S)
            return
        self.outbox.close(_FLUSH_TIMEOUT_S)
        logger.info("engine loop: %d steps, %.2f s in them, %.2f s building their outputs, %.2f s taking requests, "
                    "%.2f s idle; %d messages to the API process, %.2f s sending them", self.num_steps, self.step_s,
                    self.collect_s, self.intake_s, self.idle_s, self.outbox.messages, self.outbox.send_s)
        for tracked in self.active.values():
            engine.abort_request(tracked.request)
        engine.drain()

    def _receive(self, wait: bool) -> list | None:
        """The commands waiting on the pipe (waiting for one if wait); None to stop."""
        commands = []
        try:
            if wait:
                start = time.perf_counter()
                self.conn.poll(None)
                if self.num_steps:  # since the first step: the waits between bursts of work
                    self.idle_s += time.perf_counter() - start
            while self.conn.poll():
                command = self.conn.recv()
                if command is None:
                    return None
                commands.append(command)
        except EOFError:  # the API process closed its end
            return None
        return commands

    def _apply(self, commands: list) -> tuple[list[tuple[str, ValueError]], bool]:
        """Queue new requests and abort ended ones, in the order they came. Returns the
        refused requests and whether every request was aborted (to be reported by _collect)."""
        errors = []
        abort_all = False
        for command in commands:
            if isinstance(command, AbortRequests):
                abort_all = abort_all or command.request_ids is None
                self._abort(self.active.keys() if command.request_ids is None else command.request_ids,
                            forget=command.request_ids is not None)
                continue
            for new in command:
                try:
                    self._add(new)
                except ValueError as exc:
                    errors.append((new.request_id, exc))
        return errors, abort_all

    def _add(self, new: EngineRequest) -> None:
        if new.request_id in self.active:
            raise ValueError(f"request id {new.request_id!r} is already running")
        request = self.llm.make_request(new.prompt_token_ids, new.params, stream=new.stream,
                                        request_id=new.request_id)
        self.llm.add_request(request)
        tracked = _Tracked(request, new.stream, RequestMetrics(new.arrival_time, len(new.prompt_token_ids)))
        self.active[new.request_id] = tracked
        self.by_seq.update((seq.seq_id, tracked) for seq in request.seqs)

    def _abort(self, request_ids, forget: bool) -> None:
        """End requests now, freeing their KV blocks. forget: nobody listens any more, so
        drop them; otherwise _collect reports their end (finish_reason "abort")."""
        for request_id in list(request_ids):
            tracked = self.active.get(request_id)
            if tracked is None:
                continue
            self.llm.abort_request(tracked.request)
            if forget:
                self._forget(request_id)

    def _forget(self, request_id: str) -> _Tracked:
        tracked = self.active.pop(request_id)
        for seq in tracked.request.seqs:
            del self.by_seq[seq.seq_id]
        return tracked

    def _collect(self, changed: list[_Tracked]) -> tuple[list[RequestOutputDelta], list[RequestMetrics]]:
        """After a step: the new output (stream) or final output of each request that may
        have changed, and the metrics of those that finished."""
        engine = self.llm
        now = time.monotonic()
        deltas = []
        done = []
        for tracked in changed:
            request = tracked.request
            num_tokens = request.num_known_completion_tokens
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
                done.append(self._forget(request.request_id).metrics)
            if outputs or finished:
                deltas.append(RequestOutputDelta(request.request_id, outputs, finished))
        return deltas, done

    def stats(self) -> dict[str, float]:
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
