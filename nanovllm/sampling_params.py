"""SamplingParams: how each request picks its next tokens (vLLM's names)."""
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); max_tokens counts generated tokens;
    ignore_eos keeps generating past end-of-sequence tokens (benchmarks)."""

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
