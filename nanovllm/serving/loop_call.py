"""Coroutines run on an event loop in another thread, for a thread that waits for them
(DataParallelLLM's replicas, run-batch's app) and may be interrupted there (Ctrl-C) at any
point: the coroutine is then cancelled, so that what it started (engine requests) is
aborted, even when the interrupt lands before the loop has started it."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

# Seconds an interrupted wait gives the cancelled coroutine to end (its aborts to be sent).
CANCEL_WAIT_S = 10.0


class LoopCall:
    """A coroutine run on another thread's event loop for a thread that waits for it and
    may be interrupted (Ctrl-C) at any point, even before the loop has started it: cancel
    then stops it, and `settled` is set once it has ended either way."""

    def __init__(self, coroutine):
        self.coroutine = coroutine
        self.task: asyncio.Task | None = None
        self.cancelled = False
        self.result: concurrent.futures.Future = concurrent.futures.Future()
        self.settled = threading.Event()

    def start(self) -> None:
        """On the loop: start the coroutine, unless cancelled first."""
        if not self.cancelled:
            self.task = asyncio.ensure_future(self.coroutine)
            self.task.add_done_callback(self._ended)

    def cancel(self) -> None:
        """On the loop: cancel the coroutine's task (its finally blocks abort what it started)."""
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()
        else:  # never started
            self.coroutine.close()
            self.settled.set()

    def _ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self.result.cancel()
        elif task.exception() is not None:
            self.result.set_exception(task.exception())
        else:
            self.result.set_result(task.result())
        self.settled.set()


def call_in_loop(loop: asyncio.AbstractEventLoop, coroutine) -> Any:
    """Run coroutine on loop (running in another thread) and wait for its result. Interrupted
    here, the coroutine is cancelled and given CANCEL_WAIT_S to end."""
    call = LoopCall(coroutine)
    try:
        loop.call_soon_threadsafe(call.start)
        return call.result.result()
    except BaseException:
        loop.call_soon_threadsafe(call.cancel)
        call.settled.wait(CANCEL_WAIT_S)
        raise
