"""LLM: the offline entry point, `LLM(model, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import contextlib
import time
from typing import Any

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request import Request
from nanovllm.offline import OfflineAPI, make_each, named, own_copies, progress_bar
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(OfflineAPI, LLMEngine):
    """A vLLM-compatible offline engine. Use as a context manager, or call shutdown().
    With data_parallel_size=N > 1 it is N engine replicas (serving/data_parallel.py)."""

    def __new__(cls, model: str | None = None, *args: Any, data_parallel_size: int = 1, **engine_args: Any):
        if data_parallel_size != 1:
            from nanovllm.serving.data_parallel import DataParallelLLM

            return DataParallelLLM(model, data_parallel_size=data_parallel_size, **engine_args)
        return super().__new__(cls)

    def _generate(self, prompts, params, use_tqdm, label="prompt", priorities=None):
        own = own_copies(self.checker)

        def make(i: int, prompt: str | list[int], sp: SamplingParams) -> Request:
            return self.make_request(prompt, own(sp), priority=priorities[i] if priorities else 0, copy_params=False)

        requests = make_each(prompts, params, make, label)
        for i, (request, (_, text)) in enumerate(zip(requests, prompts)):
            request.prompt = text
            if request.grammar is not None:  # compiling since make_request
                with named(label, i, len(requests)):
                    self.compiled_grammar(request)  # one that cannot serve it: ValueError before any runs
        return self._run(requests, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm) -> list[RequestOutput]:
        """Add requests (all checked already, grammars compiled) and step until every one has
        finished."""
        pbar = progress_bar(use_tqdm, total=len(requests), desc="Generating", dynamic_ncols=True)  # (may raise)
        for request in requests:
            self.add_request(request)
        try:
            # As vLLM's bar: prompt tokens computed and tokens output so far, over the time so far.
            began, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
            num_done = 0
            while num_done < len(requests):
                result = self.step()
                prompt_tokens += result.prompt_tokens
                output_tokens += result.output_tokens
                if result.num_tokens:
                    elapsed = time.perf_counter() - began
                    # Shown at the bar's next (rate-limited) refresh: one per step would redraw it every step.
                    pbar.set_postfix_str(f"est. speed input: {prompt_tokens / elapsed:.0f} toks/s, output: "
                                         f"{output_tokens / elapsed:.0f} toks/s", refresh=False)
                if result.finished or not result.num_tokens:  # counting is per request: only when it can change
                    done = sum(request.finished for request in requests)
                    pbar.update(done - num_done)
                    num_done = done
            self.drain()
        finally:
            pbar.close()
            for request in requests:
                if not request.finished:
                    self.abort_request(request)
            if not self.is_finished():  # a step failed: read what it left in flight, so that the engine is idle
                with contextlib.suppress(Exception):
                    self.drain()
        return [self.output(request) for request in requests]

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
