"""LLM: the offline entry point, `LLM(model, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request import Request
from nanovllm.inputs import PromptType, parse_prompts, render_chat
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
        results come back in input order. Without sampling_params, the checkpoint's
        recommended ones (get_default_sampling_params)."""
        prompts = parse_prompts(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        return self._run([self.make_request(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to each of a
        list of them, rendered with the tokenizer's chat template (or chat_template); the
        same outputs as generate, each with the rendered text as its prompt. tools: OpenAI
        function definitions for the template to show the model (as vLLM's LLM.chat)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params = self._params_per_prompt(sampling_params, len(conversations))
        requests = []
        for conversation, sp in zip(conversations, params):
            text, token_ids = render_chat(self.tokenizer, conversation, chat_template, add_generation_prompt,
                                          **(chat_template_kwargs or {}), **({"tools": tools} if tools else {}))
            request = self.make_request(token_ids, sp)
            request.prompt = text
            requests.append(request)
        return self._run(requests, use_tqdm)

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError(f"sampling_params must be SamplingParams or a list of them (one per prompt); "
                            f"got {type(sampling_params).__name__}")
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts; give one, or one per prompt")
        return list(sampling_params)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Add requests (all checked already) and step until every one has finished."""
        for request in requests:
            if request.grammar is not None:
                request.grammar.result()  # a grammar that does not compile: ValueError before any runs
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
