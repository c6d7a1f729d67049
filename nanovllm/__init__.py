"""nanovllm: a compact, fast LLM inference engine with vLLM's interface."""
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"
