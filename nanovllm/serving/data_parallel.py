"""Data parallelism on one host: `LLM(model, data_parallel_size=N)` runs N engine replicas.

Each replica is an engine process (engine_process.py, driven through AsyncLLMEngine) on
its own tensor_parallel_size GPUs: replica r gets the r-th group of the visible GPUs (on
CPU, processes side by side). generate tokenizes and checks every request here once, then
hands them out largest first, each to the replica with the least work so far (prompt
tokens + max_tokens x n), and returns the outputs in input order. A request's draws
depend on its own seed, not on the engine that runs it, so greedy and seeded outputs
equal one engine's.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

from nanovllm.config import Config
from nanovllm.offline import OfflineAPI, make_each, own_copies, progress_bar
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.serving.async_engine import AsyncLLMEngine
from nanovllm.serving.deltas import RequestDelta
from nanovllm.serving.loop_call import call_in_loop
from nanovllm.serving.messages import EngineRequest
from nanovllm.serving.replicas import build_replicas
from nanovllm.serving.router import PER_POS
from nanovllm.utils import is_int, sum_lists


def spread(costs: list[int], replicas: int) -> list[list[int]]:
    """Indices of the requests each replica runs: largest first, each to the least loaded
    (ties to the lower replica), each replica's in input order."""
    loads = [0] * replicas
    assigned: list[list[int]] = [[] for _ in range(replicas)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        r = loads.index(min(loads))
        loads[r] += costs[i]
        assigned[r].append(i)
    return [sorted(indices) for indices in assigned]


class DataParallelLLM(OfflineAPI):
    """N replicas behind vLLM's offline calls: generate, chat, get_tokenizer,
    get_default_sampling_params, shutdown (also as a context manager)."""

    def __init__(self, model: str | None, data_parallel_size: int, **engine_args: Any):
        if not is_int(data_parallel_size) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        if model is None:
            raise TypeError("LLM() needs a model folder")
        engine_args.pop("data_parallel_size", None)
        self.config = Config.from_kwargs(model, **dict(engine_args))  # bad arguments raise here, once
        self.replicas: list[AsyncLLMEngine] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nanovllm-replicas", daemon=True)
        self._thread.start()
        # shutdown(), or at the latest garbage collection or interpreter exit: before
        # multiprocessing's exit handler, which would wait for the replicas forever.
        self._finalizer = weakref.finalize(self, _stop, self.replicas, self._loop, self._thread)
        self._calls = 0
        try:
            self.replicas += build_replicas(model, engine_args, data_parallel_size, self.config)
            for replica in self.replicas:
                self._call(self._start(replica))
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = self.replicas[0].tokenizer
        self.eos_token_ids, self.checker = self.replicas[0].eos_token_ids, self.replicas[0].checker

    @staticmethod
    async def _start(replica: AsyncLLMEngine) -> None:
        replica.start()

    def _call(self, coroutine) -> Any:
        """Run a coroutine on the replicas' event loop and wait for its result. Interrupted
        here (Ctrl-C), the coroutine is cancelled, which aborts the requests it started,
        and given a moment to do so."""
        if not self.replicas:  # shutdown() took them: the coroutine never runs, and _first says why
            coroutine.close()
            self._first()
        return call_in_loop(self._loop, coroutine)

    def _first(self) -> AsyncLLMEngine:
        """The first replica; RuntimeError once shut down."""
        if not self.replicas:
            raise RuntimeError("this LLM is shut down; create a new one")
        return self.replicas[0]

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def vocab_size(self) -> int:
        return self.config.hf_config.vocab_size

    def reset_stats(self) -> None:
        """Count the replicas' token totals from here (stats() reports what comes after)."""
        self._stats_base = [dict(replica.latest_stats) for replica in self.replicas]

    def stats(self) -> dict[str, float]:
        """Generated and prompt tokens (and speculative decoding's counts) of every replica since
        reset_stats, and each replica's share."""
        base = getattr(self, "_stats_base", None) or [{} for _ in self.replicas]
        totals: dict[str, float] = {}
        for i, (replica, before) in enumerate(zip(self.replicas, base)):
            for key in ("prompt_tokens_total", "generation_tokens_total", "spec_decode_num_drafts",
                        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
                value = replica.latest_stats.get(key, 0) - before.get(key, 0)
                totals[key] = totals.get(key, 0) + value
                totals[f"replica{i}_{key}"] = value
            since = sum_lists([replica.latest_stats.get(PER_POS, []), [-n for n in before.get(PER_POS, [])]])
            totals[PER_POS] = sum_lists([totals.get(PER_POS, []), since])
            totals[f"replica{i}_{PER_POS}"] = since
        return totals

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """LLM.reset_prefix_cache on every replica: whether all of them could (False if any
        runs requests; the idle ones are reset all the same)."""
        async def reset_all() -> list[bool]:
            return await asyncio.gather(*(replica.reset_prefix_cache() for replica in self.replicas))

        return all(self._call(reset_all()))

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self._first().generation_defaults)

    def _generate(self, prompts: list[tuple[str | list[int], str | None]], params: list[SamplingParams],
                  use_tqdm: bool, label: str = "prompt", priorities: list[int] | None = None) -> list[RequestOutput]:
        first = self._first()
        self._calls += 1
        own = own_copies(first.checker)

        def make(i: int, prompt: str | list[int], sp: SamplingParams) -> EngineRequest:
            sp = own(sp)
            if sp.structured_outputs is not None:  # a grammar that does not compile: ValueError before anything runs
                first.check_structured_outputs(sp.structured_outputs)
            request = first.make_request(prompt, sp, request_id=f"{self._calls}-{i}", fit=True,
                                         priority=priorities[i] if priorities else 0, copy_params=False)
            request.overrun_fails = False  # a grammar past its budget ends its completion, as on one engine
            return request

        requests = make_each(prompts, params, make, label)
        costs = [r.cost() for r in requests]
        outputs: list[RequestDelta | None] = [None] * len(requests)
        with progress_bar(use_tqdm, total=len(requests), desc="Generating", dynamic_ncols=True) as progress:

            async def run(replica: AsyncLLMEngine, indices: list[int]) -> None:
                async for deltas in replica.generate([requests[i] for i in indices]):
                    for delta in deltas:
                        if delta.finished:  # not streamed: its only delta
                            outputs[indices[delta.index]] = delta
                            progress.update()

            async def run_all() -> None:
                tasks = [asyncio.ensure_future(run(replica, indices)) for replica, indices
                         in zip(self.replicas, spread(costs, len(self.replicas))) if indices]
                try:
                    await asyncio.gather(*tasks)
                finally:  # one failed, or this was cancelled: the others stop too, aborting their requests
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)

            self._call(run_all())
        return [RequestOutput(request.request_id, text, request.prompt_token_ids, out.outputs, True,
                              out.prompt_logprobs, out.num_cached_tokens)
                for request, (_, text), out in zip(requests, prompts, outputs)]

    def shutdown(self) -> None:
        """Stop every replica's engine process. Safe to call twice."""
        self._finalizer()

    def __enter__(self) -> DataParallelLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _stop(replicas: list[AsyncLLMEngine], loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Stop the replicas' engine processes and their event loop (DataParallelLLM.shutdown)."""
    while replicas:
        replicas.pop().shutdown()
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
