"""vLLM's speculative_config, checked (Config.speculative); the speculation itself is
engine/speculative.py's."""
from __future__ import annotations

from dataclasses import dataclass, fields

from nanovllm.utils import is_int


# vLLM's lookup length where a config gives neither bound (one given sets the other).
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for n-gram (prompt lookup) speculation: each decode step
    drafts up to num_speculative_tokens tokens that followed an earlier occurrence of the
    sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min; as vLLM,
    both 5 where neither is given, and one given sets the other), and the model verifies them
    in one pass (engine/speculative.py). With disable_by_batch_size, steps that start with at
    least that many running sequences draft nothing (and keep the engine's overlap of host
    and GPU work)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            value = {f.name: getattr(value, f.name) for f in fields(cls)}
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {value!r}")
        value = dict(value)
        if value.get("method") != "ngram":
            raise ValueError(f"speculative_config: method must be 'ngram' (n-gram prompt lookup; draft models are "
                             f"not supported), got {value.get('method')!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (how many tokens a step drafts)")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        value["prompt_lookup_min"] = low if low is not None else high
        value["prompt_lookup_max"] = high if high is not None else low
        config = cls(**{k: v for k, v in value.items() if v is not None})
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            number = getattr(config, name)
            if number is None and name == "disable_by_batch_size":
                continue
            if not is_int(number) or number <= 0:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {number!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config


def json_object(text: str) -> dict:
    """A command-line JSON object (vLLM's --speculative-config)."""
    import json

    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object is expected, got {text!r}")
    return value
