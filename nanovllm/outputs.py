"""Results handed back to the user, shaped like vLLM's RequestOutput."""
from dataclasses import dataclass, field

from nanovllm.utils.pickling import pickle_as_arguments


@pickle_as_arguments
@dataclass(slots=True)
class Logprob:
    """A token's log-probability under the model's raw logits, its rank (1 = most
    likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@pickle_as_arguments
@dataclass(slots=True)
class CompletionOutput:
    """One generated continuation of a prompt (or, from LLMEngine.stream_delta, what was
    added to it since the last call)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" (max_tokens), "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string; None for end-of-sequence
    logprobs: list[dict[int, Logprob]] | None = None  # per token, when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A prompt and what was generated for it (n completions)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing
    # predicts it), then its logprob and the top alternatives' at its position.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (its first completion's)
