"""LLM: the offline entry point, `LLM(model, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.inputs import PromptType, parse_prompts
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """A vLLM-compatible offline engine. Use as a context manager, or call shutdown()."""

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (any of vLLM's prompt forms, see nanovllm/inputs.py);
        results come back in input order."""
        prompts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError(f"sampling_params must be SamplingParams or a list of them (one per prompt); "
                            f"got {type(sampling_params).__name__}")
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; give one, or one per prompt")
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]  # all checked before any runs
        for request in requests:
            self.add_request(request)
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            prefill_tps = decode_tps = 0.0
            num_done = 0
            while num_done < len(requests):
                start = time.perf_counter()
                result = self.step()
                elapsed = time.perf_counter() - start
                if result.num_tokens:
                    if result.is_prefill:
                        prefill_tps = result.num_tokens / elapsed
                    else:
                        decode_tps = result.num_tokens / elapsed
                    # Shown at the bar's next (rate-limited) refresh: one per step would redraw it every step.
                    pbar.set_postfix(prefill=f"{prefill_tps:.0f} tok/s", decode=f"{decode_tps:.0f} tok/s", refresh=False)
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
        return [self.output(request) for request in requests]

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
