"""Step statistics: what the engine did, for users, benchmarks and (later) metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepStats:
    """Counters since the engine started (or since reset())."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0

    def record(self, is_prefill: bool, num_tokens: int, seconds: float) -> None:
        if is_prefill:
            self.prefill_steps += 1
            self.prefill_tokens += num_tokens
            self.prefill_time_s += seconds
        else:
            self.decode_steps += 1
            self.decode_tokens += num_tokens
            self.decode_time_s += seconds

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
