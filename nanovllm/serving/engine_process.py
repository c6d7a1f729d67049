"""The engine process: an LLMEngine stepped in a process of its own, driven over a pipe.

The OpenAI server's event loop spends CPU on every streamed chunk; in one process it
would take the interpreter lock from the engine's Python work (scheduling, detokenizing)
for a large share of every step. So AsyncLLMEngine (async_engine.py) starts run_engine in
a spawned process, and the two exchange the records of messages.py over one duplex Pipe.

A step's StepOutputs carries, per request that changed, only what is new: the text,
token ids (and logprobs) since the last step, or a non-streamed request's whole output
once it finishes (OutputProcessor.new_outputs); plain streams (one completion, no
logprobs) go as columns (StreamColumns), the rest as a RequestOutputDelta each; those
without stop strings carry their tokens alone, and the API process decodes the text. A
thread of the engine process sends them (Outbox), so that a step never waits for the API
process to read: messages that pile up meanwhile go as one list. Another reads the API
process's commands (Inbox), so that a step never waits for the rest of a message the API
process is still writing (its sender thread can wait long for its interpreter lock while
a burst of requests arrives).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request import Request
from nanovllm.engine.structured import GrammarOverran
from nanovllm.serving.loop_stats import LoopIteration, LoopStats, trace_summary
from nanovllm.serving.messages import (
    AbortRequests,
    EngineFailed,
    EngineReady,
    EngineRequest,
    EngineTokenizer,
    RequestMetrics,
    RequestOutputDelta,
    ResetPrefixCache,
    StartupFailed,
    StepOutputs,
    StreamColumns,
    is_plain_stream,
)
from nanovllm.utils.log import configure_logging, process_age_s
from nanovllm.utils.pickling import freeze_startup_objects

logger = logging.getLogger(__name__)

# While idle the loop still sends (empty) StepOutputs this often: the API process's health
# check hears from it, and /metrics stays current.
HEARTBEAT_INTERVAL_S = 1.0
# How long the sender thread may take to send the last messages once the loop has ended.
FLUSH_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Tracked:
    """The engine process's record of one running request."""

    request: Request
    stream: bool
    metrics: RequestMetrics
    num_tokens: int = 0  # completion tokens seen so far, over all n completions
    plain_stream: bool = False  # a stream of one completion without logprobs: sent as StreamColumns
    delivered: bool = False  # a delta has gone out (the first carries the prompt logprobs)
    overrun_fails: bool = True  # EngineRequest's


def run_engine(model: str, engine_args: dict, conn: Connection, log_level: int,
               visible_devices: str | None = None) -> None:
    """The engine process's main function: build the engine, then serve conn until told to
    stop or until the API process goes away. visible_devices: the GPUs this engine may use
    (CUDA_VISIBLE_DEVICES, set before CUDA starts), for one of several replicas."""
    process_start_s = process_age_s()  # the spawn, the interpreter and the imports of this module
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    configure_logging(log_level)
    # Ctrl-C and a SIGTERM to the whole process group (systemd, container runtimes) reach
    # this process too; the API process decides when to stop, after draining its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # SIGUSR1 (the API process forwards its own) prints every thread's stack to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        engine = LLMEngine(model, tokenizer_source=lambda: _receive_tokenizer(conn), **engine_args)
    except Exception as exc:
        _startup_failed(conn, exc)
        return
    engine.process_start_s = process_start_s
    try:
        try:
            seconds = engine.warm_up_sampler()
        except Exception as exc:
            _startup_failed(conn, exc)
            return
        if seconds:
            logger.info("sampler's filtered paths compiled in %.1f s", seconds)
        freeze_startup_objects()
        try:
            conn.send(EngineReady(engine.num_kvcache_blocks, engine.stats() | _token_totals(0, 0)))
        except (BrokenPipeError, ConnectionResetError):  # the API process has gone during start-up
            return
        EngineLoop(engine, conn).run()
    finally:
        engine.shutdown()


def _startup_failed(conn: Connection, exc: Exception) -> None:
    try:
        conn.send(StartupFailed(_picklable(exc)))
    except (BrokenPipeError, ConnectionResetError):  # the API process has gone during start-up
        pass


def _receive_tokenizer(conn: Connection):
    """The API process's tokenizer (its first message, EngineTokenizer), or None where it
    did not pickle or does not unpickle here: then the engine loads its own."""
    message = conn.recv()
    if not isinstance(message, EngineTokenizer):
        raise RuntimeError(f"the API process's first message is a {type(message).__name__}, not its tokenizer")
    if message.pickled is None:
        return None
    try:
        return pickle.loads(message.pickled)
    except Exception as exc:
        logger.warning("the API process's tokenizer does not unpickle here (%s); loading it", exc)
        return None


def _picklable(exc: Exception) -> Exception:
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _token_totals(prompt_tokens: int, generation_tokens: int) -> dict[str, float]:
    return {"prompt_tokens_total": prompt_tokens, "generation_tokens_total": generation_tokens}


class Outbox:
    """The engine process's messages to the API process, sent by a thread in order.

    A send blocks while the pipe is full, that is while the API process is busy; the
    engine loop only queues, so it goes on stepping. Whatever has queued up meanwhile
    goes as one list: fewer, larger reads for the API process when it lags.
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

    def put(self, message: StepOutputs | EngineFailed) -> None:
        self._queue.put(message)

    def close(self, timeout: float) -> None:
        """Send what is queued (waiting at most timeout seconds), then stop the thread."""
        self._queue.put(self._STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = self._STOP in batch
            batch = batch[: batch.index(self._STOP)] if stop else batch
            if batch:
                start = time.perf_counter()
                try:
                    self._conn.send(batch)
                except OSError:
                    self.gone.set()
                    return
                self.send_s += time.perf_counter() - start
                self.messages += 1
            if stop:
                return


class Inbox:
    """The API process's commands, read by a thread as they complete; None once it says
    stop or closes its end."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine-receiver", daemon=True)
        self._thread.start()

    def take(self, wait: float) -> list | None:
        """The commands that have arrived (waiting up to wait seconds for the first); None
        to stop. Raises what reading a command raised (a message that does not unpickle)."""
        commands = []
        try:
            commands.append(self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait())
            while True:
                commands.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        if commands and isinstance(commands[-1], Exception):
            raise commands[-1]
        return None if commands and commands[-1] is None else commands

    def _run(self) -> None:
        while True:
            try:
                command = self._conn.recv()
            except (EOFError, OSError):  # the API process closed its end
                command = None
            except Exception as exc:  # the loop raises it: the engine fails, it does not go deaf
                command = exc
            self._queue.put(command)
            if command is None or isinstance(command, Exception):
                return


class EngineLoop:
    """Apply the commands that arrived since the last step, step, queue what changed."""

    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine = engine
        self.outbox = Outbox(conn)
        self.inbox = Inbox(conn)
        self.active: dict[str, _Tracked] = {}  # request_id -> record
        self.by_seq: dict[int, _Tracked] = {}  # seq_id -> record of its request
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.loop_stats = LoopStats()  # where the loop's time goes, logged at its end

    def run(self) -> None:
        try:
            while not self.outbox.gone.is_set() and self._iterate():
                pass
        except (BrokenPipeError, ConnectionResetError):  # the API process is gone
            pass
        except Exception as exc:  # a bug or a device error: the API process fails every request
            logger.exception("the engine loop failed; no further requests will run")
            self.outbox.put(EngineFailed(repr(exc)))
            self.outbox.close(FLUSH_TIMEOUT_S)
            return
        self._close()

    def _iterate(self) -> bool:
        """Apply the commands that arrived, step once if anything is to run, queue what
        changed. False once the API process says stop."""
        engine = self.engine
        received = time.perf_counter()
        commands, waited = self._receive(wait=engine.is_finished())
        if commands is None:
            return False
        errors, abort_all, resets, left = self._apply(commands)
        start = time.perf_counter()
        result = None if engine.is_finished() else engine.step()
        for request in engine.take_failed():
            errors.append((request.request_id, _picklable(request.error)))
            self._forget(request.request_id)
        for seq in result.finished if result is not None else ():  # ended by a grammar past its fill budget
            if (seq.finish_reason == "abort" and seq.grammar is not None and seq.grammar.overran
                    and (tracked := self.by_seq.get(seq.seq_id)) and tracked.overrun_fails):
                engine.abort_request(tracked.request)  # (its other completions)
                errors.append((tracked.request.request_id, GrammarOverran(seq.grammar.overran_message())))
                self._forget(tracked.request.request_id)
        stepped = time.perf_counter()
        if abort_all:
            changed = list(self.active.values())
        else:  # only sequences whose tokens the step read back can have new output
            updated = result.updated if result is not None else []
            changed = list({id(t): t for seq in updated if (t := self.by_seq.get(seq.seq_id)) is not None}.values())
        deltas, streams, done = self._collect(changed)
        self.outbox.put(StepOutputs(deltas, errors, left + done, self.stats(), streams, resets or None))
        num_tokens, is_prefill = (result.num_tokens, result.is_prefill) if result is not None else (0, False)
        self.loop_stats.record(LoopIteration(start - received - waited, stepped - start, time.perf_counter() - stepped,
                                             num_tokens, is_prefill), took_step=result is not None)
        return True

    def _close(self) -> None:
        """Send what is queued, log where the loop's time went, end what still runs."""
        self.outbox.close(FLUSH_TIMEOUT_S)
        logger.info("engine loop: %s; %d messages to the API process, %.2f s sending them", self.loop_stats.totals(),
                    self.outbox.messages, self.outbox.send_s)
        if self.loop_stats.trace:
            logger.info("engine loop, %s", trace_summary(self.loop_stats.trace))
        for tracked in self.active.values():
            self.engine.abort_request(tracked.request)
        self.engine.drain()

    def _receive(self, wait: bool) -> tuple[list | None, float]:
        """The commands that have arrived (if wait, waiting up to a heartbeat interval for
        one; None to stop), and the seconds spent waiting (not intake)."""
        if not wait:
            return self.inbox.take(0), 0.0
        start = time.perf_counter()
        commands = self.inbox.take(HEARTBEAT_INTERVAL_S)
        waited = time.perf_counter() - start
        self.loop_stats.waited(waited)
        return commands, waited

    def _apply(self, commands: list) -> tuple[list[tuple[str, ValueError]], bool, list[bool], list[RequestMetrics]]:
        """Queue new requests, abort ended ones and reset the prefix cache, in the order they
        came. Returns the refused requests, whether every request was aborted (to be
        reported by _collect), the resets' results, and the metrics of the requests whose
        clients left (aborted and forgotten)."""
        errors = []
        abort_all = False
        resets = []
        left = []
        for command in commands:
            if isinstance(command, ResetPrefixCache):
                resets.append(self.engine.reset_prefix_cache())
                continue
            if isinstance(command, AbortRequests):
                abort_all = abort_all or command.request_ids is None
                left += self._abort(self.active.keys() if command.request_ids is None else command.request_ids,
                                    forget=command.request_ids is not None)
                continue
            for new in command:
                try:
                    self._add(new)
                except ValueError as exc:
                    errors.append((new.request_id, exc))
        return errors, abort_all, resets, left

    def _add(self, new: EngineRequest) -> None:
        if new.request_id in self.active:
            raise ValueError(f"request id {new.request_id!r} is already running")
        plain = is_plain_stream(new.params, new.stream)
        request = self.engine.make_request(new.prompt_token_ids, new.params, stream=new.stream,
                                           request_id=new.request_id, engine_decodes=new.engine_decodes or not plain,
                                           priority=new.priority, copy_params=False)  # (unpickled: its own)
        self.engine.add_request(request)
        tracked = _Tracked(request, new.stream, RequestMetrics(new.arrival_time, len(new.prompt_token_ids)),
                           plain_stream=plain, overrun_fails=new.overrun_fails)
        self.active[new.request_id] = tracked
        self.by_seq.update((seq.seq_id, tracked) for seq in request.seqs)

    def _abort(self, request_ids, forget: bool) -> list[RequestMetrics]:
        """End requests now, freeing their KV blocks (finish_reason "abort"). forget: nobody
        listens any more, so drop them and return their metrics (the server counts them);
        otherwise _collect reports their end."""
        ended = []
        for request_id in list(request_ids):
            tracked = self.active.get(request_id)
            if tracked is None:
                continue
            self.engine.abort_request(tracked.request)
            if forget:
                ended.append(self._ended(self._forget(request_id), time.monotonic()))
        return ended

    @staticmethod
    def _ended(tracked: _Tracked, now: float) -> RequestMetrics:
        """A finished request's metrics, completed at `now`."""
        request, metrics = tracked.request, tracked.metrics
        metrics.finished_time = now
        metrics.finish_reasons = [seq.finish_reason for seq in request.seqs]
        metrics.num_generation_tokens = request.num_known_completion_tokens
        metrics.longest_completion = max(seq.num_completion_tokens for seq in request.seqs)
        return metrics

    def _forget(self, request_id: str) -> _Tracked:
        tracked = self.active.pop(request_id)
        for seq in tracked.request.seqs:
            del self.by_seq[seq.seq_id]
        return tracked

    def _collect(self, changed: list[_Tracked]
                 ) -> tuple[list[RequestOutputDelta], StreamColumns | None, list[RequestMetrics]]:
        """After a step: the new output (stream) or final output of each request that may
        have changed, plain streams' as columns, and the metrics of those that finished."""
        now = time.monotonic()
        deltas = []
        streams = StreamColumns()
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
            if tracked.plain_stream:
                self._add_stream(streams, tracked)
            else:
                outputs = self.engine.new_outputs(request, tracked.stream)
                if outputs or finished:
                    delta = RequestOutputDelta(request.request_id, outputs, finished)
                    if not tracked.delivered:
                        delta.prompt_logprobs = self.engine.prompt_logprobs(request)
                        delta.num_cached_tokens = request.seqs[0].num_prefix_hit_tokens
                        tracked.delivered = True
                    deltas.append(delta)
            if finished:
                done.append(self._ended(self._forget(request.request_id), now))
        return deltas, streams if streams.request_ids else None, done

    def _add_stream(self, streams: StreamColumns, tracked: _Tracked) -> None:
        """A plain stream's new text and tokens, as new_outputs would give them; no text
        (None) where the API process decodes it."""
        request = tracked.request
        seq = request.seqs[0]
        piece = self.engine.next_piece(seq)
        if piece is not None:
            text, start, end = piece
            streams.add(request.request_id, text, seq.completion_tokens(start, end), seq.finish_reason,
                        seq.stop_reason)
            if not tracked.delivered:
                streams.cached_tokens[request.request_id] = seq.num_prefix_hit_tokens
                tracked.delivered = True

    def stats(self) -> dict[str, float]:
        """What /metrics shows: the engine's stats plus the token counters."""
        return self.engine.stats() | _token_totals(self.num_prompt_tokens, self.num_generation_tokens)
