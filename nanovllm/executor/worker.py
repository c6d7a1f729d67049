"""Tensor-parallel workers: ranks 1..N-1 of an engine, each in its own process.

Rank 0 is the main process (scheduler, sampler, tokenizer); its TPExecutor drives the
workers with one call per step. The call is a pickled (method, args) message written to a shared
memory segment, announced by releasing one semaphore per worker (a multiprocessing
Event would do the same, but its set() blocks forever once a waiting worker has been
killed). A worker wakes, reads the message and runs the same ModelRunner.forward as
rank 0 on its weight shard; the model's collectives then keep all ranks in step, so
rank 0 needs no acknowledgement: by the time its step is done, every worker has read
the message. Rank 0 launches a step before the previous one is done (on CUDA its
collectives are queued, not waited for), so messages alternate between two halves of the
segment: message N + 2 overwrites message N only after step N is done.

A step message carries, per sequence, only what the forward needs (`StepSeq`): the
token ids computed this step (one per decoding sequence), the number of cached tokens
and the block table; never whole token lists. Workers do not sample. As on one GPU, a
step is launched before the previous one's tokens reach the host: such a token travels
as a placeholder with its row in the previous step's output, and every rank takes it
from rank 0's sampled tokens, broadcast on the device at the start of the step.

Failure: before each step rank 0 checks that every worker is alive, and a worker that
dies during a step breaks the step's collective (gloo notices the closed socket at
once), so a dead worker raises a RuntimeError instead of a hang. A worker whose parent
dies exits on its own. Workers ignore SIGINT and SIGTERM: signals to the process group
are rank 0's to handle, and rank 0 stops the workers on shutdown, on any error inside a
step, at garbage collection and at interpreter exit.
"""
from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import pickle
import signal
import struct
import time
import uuid
import weakref
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.executor.model_runner import ModelRunner, rank_device
from nanovllm.executor.step import StepSeq
from nanovllm.utils.distributed import TPGroup, create_tp_group

logger = logging.getLogger(__name__)

# Shared-memory segments of ours are named with this prefix, the engine's pid and a uuid.
SHM_PREFIX = "nanovllm_tp_"
# Message layout: the message's number (-1 while it is written) and the pickle's length,
# then the pickle. Message N goes to half N % 2 of the segment.
_HEADER = struct.Struct("<qQ")
# Upper bound on the pickled size of one int in a message (pickle needs 2-5 bytes, plus
# list framing), used to size the segment for the largest possible step.
_BYTES_PER_INT = 16
# How often an idle worker checks that rank 0 is still alive.
PARENT_POLL_S = 1.0
# Workers import torch and build their model before they join the group; starting up
# longer than this is taken for a hang.
STARTUP_TIMEOUT_S = 600.0
# How long shutdown waits for a worker to exit on its own before terminating it.
EXIT_GRACE_S = 5.0


def message_capacity(config: Config) -> int:
    """Bytes of the largest step message: every batched token, as many prompt-logprob
    token ids (StepSeq.prompt_logprob_rows), and full block tables."""
    max_blocks = (config.max_model_len + config.kvcache_block_size - 1) // config.kvcache_block_size
    ints = 2 * config.max_num_batched_tokens + config.max_num_seqs * (max_blocks + 4)
    return _HEADER.size + _BYTES_PER_INT * ints + 4096


def write_message(shm: SharedMemory, message: tuple[str, tuple], number: int) -> None:
    """Message `number` (counted from 0) into its half of the segment. Rank 0 writes message
    N + 2 only after step N is done, so only when it stops the workers can it overwrite a
    message that a slow worker is about to read (read_message sees that)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    half = shm.size // 2
    start = number % 2 * half
    if _HEADER.size + len(data) > half:
        raise RuntimeError(f"a tensor-parallel message of {len(data)} bytes exceeds the {half}-byte buffer")
    _HEADER.pack_into(shm.buf, start, -1, 0)
    shm.buf[start + _HEADER.size : start + _HEADER.size + len(data)] = data
    _HEADER.pack_into(shm.buf, start, number, len(data))


def read_message(shm: SharedMemory, number: int) -> tuple[str, tuple]:
    """Message `number`, or the exit message where rank 0 wrote it over this one. The header's
    number before and after the read says whether the bytes changed under it (a seqlock)."""
    start = number % 2 * (shm.size // 2)
    deadline = time.monotonic() + EXIT_GRACE_S
    while time.monotonic() < deadline:
        found, size = _HEADER.unpack_from(shm.buf, start)
        if found == -1:  # being written
            time.sleep(0.001)
            continue
        try:
            message = pickle.loads(shm.buf[start + _HEADER.size : start + _HEADER.size + size])
        except Exception:  # torn by a write: the check below reads again
            message = None
        if _HEADER.unpack_from(shm.buf, start)[0] != found:
            continue
        if found == number or (found > number and message == ("exit", ())):
            return message
        break
    raise RuntimeError(f"tensor-parallel message {number} was overwritten (by message {found}) before it was read")


def _worker_main(config: Config, rank: int, port: int, shm_name: str, wakeup: Any) -> None:
    """Rank `rank`: join the group, build the ModelRunner on this rank's shard, then run
    rank 0's calls until told to exit or rank 0 goes away."""
    # Signals to the whole process group (Ctrl-C, a service manager's SIGTERM) are rank 0's
    # to handle. A SIGTERM from rank 0 means a worker is stuck somewhere: say where (rank 0
    # kills it after a grace period).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGTERM, chain=True)
    # SIGUSR1 prints every thread's stack and changes nothing else: what a stalled worker does.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(f"ready/{rank}", "1")
    group = create_tp_group(store, rank, size, rank_device(config, rank))
    runner = ModelRunner(config, group)
    shm = SharedMemory(name=shm_name)
    parent = mp.parent_process()
    received = 0
    try:
        while True:
            while not wakeup.acquire(timeout=PARENT_POLL_S):
                if parent is not None and not parent.is_alive():
                    return
            method, args = read_message(shm, received)
            received += 1
            if method == "exit":
                return
            if method == "execute":
                is_prefill, records, num_prev = args
                runner.forward([StepSeq(*r) for r in records], is_prefill, runner.share_sampled(num_prev))
            elif method == "propose":  # the draft model's (speculative decoding)
                records, counts = args
                runner.drafter.propose([StepSeq(*r) for r in records], counts)
            else:
                raise RuntimeError(f"unknown tensor-parallel call {method!r}")
    finally:
        shm.close()
        runner.shutdown()  # its graphs hold the communicator
        group.shutdown()


def _stop_workers(processes: list, wakeups: list, shm: SharedMemory, group: TPGroup | None, polite: bool,
                  sent: list[int]) -> None:
    """Stop the workers (asking first when `polite`), then free the segment and the group.
    Rank 0 releases its group while the workers release theirs, as a collective teardown
    wants. Holds no reference to the TPWorkers object, so it can run as its finalizer
    (`sent`: the TPWorkers' count of messages sent, shared)."""
    if polite and any(p.is_alive() for p in processes):
        try:
            write_message(shm, ("exit", ()), sent[0])
            for wakeup in wakeups:
                wakeup.release()
        except (ValueError, OSError):  # the segment is already gone
            pass
        if group is not None:
            group.shutdown()
            group = None
        deadline = time.monotonic() + EXIT_GRACE_S
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(EXIT_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
    if group is not None:
        group.shutdown(abort=not polite)
    try:
        shm.close()
        shm.unlink()
    except FileNotFoundError:
        pass


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: start, one call per step, liveness, stop."""

    def __init__(self, config: Config, device: torch.device):
        size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self.shm = SharedMemory(name=f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}", create=True,
                                size=2 * message_capacity(config))  # two halves, used in turn
        self.sent = [0]  # messages sent (a list: the finalizer shares it)
        self.wakeups = [ctx.Semaphore(0) for _ in range(1, size)]
        self.processes: list = []
        self.group: TPGroup | None = None
        self.closed = False
        # Port 0: the store binds a free port, which the workers are told. Held for this
        # object's life: the store's server lives as long as this handle.
        self.store = store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                              wait_for_workers=False)
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.wakeups, self.shm, None, False,
                                          self.sent)
        try:
            for rank, wakeup in enumerate(self.wakeups, start=1):
                process = ctx.Process(target=_worker_main, args=(config, rank, store.port, self.shm.name, wakeup),
                                      name=f"nanovllm-tp{rank}", daemon=True)
                process.start()
                self.processes.append(process)
            self._wait_started(store)
            self.group = create_tp_group(store, 0, size, device)
        except BaseException:
            self.shutdown(polite=False)
            raise
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.wakeups, self.shm, self.group, True,
                                          self.sent)

    def _wait_started(self, store: dist.Store) -> None:
        keys = [f"ready/{rank}" for rank in range(1, len(self.processes) + 1)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def _describe_dead(self) -> str:
        return ", ".join(f"rank {rank} (pid {p.pid}, exit code {p.exitcode})"
                         for rank, p in enumerate(self.processes, start=1) if not p.is_alive())

    def check_alive(self) -> None:
        """Raise RuntimeError if the workers are shut down or any of them has exited."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers are shut down; create a new LLM")
        dead = self._describe_dead()
        if dead:
            raise _died(dead)

    def call(self, method: str, args: tuple) -> None:
        """Have every worker run "execute" (a step: ModelRunner.forward on the StepSeq
        records, with num_prev tokens of the step before shared from rank 0; args
        (is_prefill, records, num_prev)) or "propose" (the draft model's DraftRunner.propose;
        args (records, counts)); returns at once (the collectives are what wait for the workers)."""
        self.check_alive()
        write_message(self.shm, (method, args), self.sent[0])
        self.sent[0] += 1
        for wakeup in self.wakeups:
            wakeup.release()

    def fail(self, error: BaseException) -> None:
        """Stop the workers after `error` broke a step or the start-up (the ranks are out
        of step now). Raises a RuntimeError naming the worker that died, if one did."""
        if isinstance(error, Exception):  # not Ctrl-C: a dead worker is the likely cause
            deadline = time.monotonic() + 1.0  # it closes its sockets just before it is reapable
            while time.monotonic() < deadline and all(p.is_alive() for p in self.processes):
                time.sleep(0.02)
        dead = self._describe_dead()
        self.shutdown(polite=False)
        if dead:
            raise _died(dead) from error

    def shutdown(self, polite: bool = True) -> None:
        """Stop every worker and free the shared memory and the process group; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        _stop_workers(self.processes, self.wakeups, self.shm, self.group, polite, self.sent)


def _died(worker: str) -> RuntimeError:
    """The error of a step or check that found workers dead (as _describe_dead names them)."""
    return RuntimeError(f"tensor-parallel worker {worker} died; the engine is unusable, create a new LLM")
