"""Results handed back to the user, shaped like vLLM's RequestOutput."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS), "length" (max_tokens / max_model_len), None while running


@dataclass(slots=True)
class RequestOutput:
    """A prompt and what was generated for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
