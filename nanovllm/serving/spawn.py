"""Starting an engine process, from a module that imports nothing heavy.

The engine process (engine_process.py) imports torch and transformers and builds the
engine; the API process imports them too, and FastAPI. `nanovllm serve` starts the engine
process before its own imports (spawn_engine, then AsyncLLMEngine(..., process=...)), so
the two processes' start-ups overlap instead of following one another.
"""
from __future__ import annotations

import logging
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess


@dataclass(slots=True)
class EngineProcess:
    """A started engine process and this side of its pipe."""

    process: BaseProcess
    conn: Connection

    def kill(self) -> None:
        """Stop it at once (it ignores SIGTERM; the server stops it by message), e.g. when
        the server fails to start before an AsyncLLMEngine took it over."""
        self.process.kill()
        self.process.join()
        self.conn.close()


def spawn_engine(model: str, engine_args: dict, visible_devices: str | None = None) -> EngineProcess:
    """Start the engine process for LLMEngine(model, **engine_args); it begins importing
    and building at once. visible_devices: the GPUs it may use (CUDA_VISIBLE_DEVICES)."""
    context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads and CUDA state
    conn, child_conn = context.Pipe()
    process = context.Process(target=_run_engine, name="nanovllm-engine",
                              args=(model, engine_args, child_conn, logging.getLogger().getEffectiveLevel(),
                                    visible_devices))
    process.start()
    child_conn.close()
    return EngineProcess(process, conn)


def _run_engine(*args) -> None:
    from nanovllm.serving.engine_process import run_engine  # torch and the rest: imported in the child only

    run_engine(*args)
