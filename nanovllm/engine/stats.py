"""Step statistics: what the engine did, for users, benchmarks and (later) metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepStats:
    """Counters since the engine started (or since reset()). A prefill step computes
    prompt chunks, often with decode tokens riding along (counted apart, in
    prefill_step_decode_tokens); a decode step (the CUDA-graph path) one token per
    sequence, each counted in decode_tokens."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed in prefill steps
    decode_tokens: int = 0  # tokens of decode steps
    prefill_step_decode_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0

    def record(self, is_prefill: bool, prompt_tokens: int, decode_tokens: int, seconds: float) -> None:
        if is_prefill:
            self.prefill_steps += 1
            self.prefill_tokens += prompt_tokens
            self.prefill_step_decode_tokens += decode_tokens
            self.prefill_time_s += seconds
        else:
            self.decode_steps += 1
            self.decode_tokens += prompt_tokens + decode_tokens
            self.decode_time_s += seconds

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
