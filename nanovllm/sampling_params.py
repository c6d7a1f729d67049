"""SamplingParams: how each request picks its next tokens (vLLM's names)."""
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """How one request samples, with vLLM's names and meanings.

    temperature 0 means greedy (argmax). top_k keeps the k most likely tokens (0 or -1:
    all), top_p the smallest set whose probability reaches p (1: all), min_p the tokens
    at least min_p times as likely as the most likely one (0: all); they combine.
    max_tokens counts generated tokens; ignore_eos keeps generating past
    end-of-sequence tokens (benchmarks).
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 for no limit; got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p restricts the tokens sampled from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
