"""nanovllm: a compact, fast LLM inference engine with vLLM's interface.

`from nanovllm import LLM, SamplingParams`. LLM loads torch and transformers on first use,
so importing the package (and `nanovllm --help`) is quick.
"""
from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt",
           "BeamSearchParams", "BeamSearchOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"LLM"})  # LLM too, for tab completion
