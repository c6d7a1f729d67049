"""LLM: the offline entry point, `LLM(model, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import gc

import torch

from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """A vLLM-compatible offline engine. Use as a context manager, or call shutdown()."""

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and release the model and KV cache; the object
        is unusable afterwards. Safe to call twice."""
        if hasattr(self, "model_runner"):
            self.model_runner.shutdown()
        for name in ("model_runner", "scheduler"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
