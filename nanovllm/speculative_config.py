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
        # vLLM's older spellings of the method: "[ngram]", and "model": "[ngram]" or "ngram".
        if value.get("method") is None and value.get("model") in ("ngram", "[ngram]"):
            value["method"] = value.pop("model")
        if value.get("method") == "[ngram]":
            value["method"] = "ngram"
        if value.get("method") is None and value.get("model") is not None:
            raise ValueError(f"speculative_config: draft models ('model': {value['model']!r}) are not supported; "
                             f"nanovllm speculates by n-gram prompt lookup: {{'method': 'ngram', ...}}")
        if value.get("method") is None:
            raise ValueError("speculative_config needs a method: 'ngram' (n-gram prompt lookup), e.g. "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        if value["method"] != "ngram":
            raise ValueError(f"speculative_config: method {value['method']!r} is not supported: nanovllm speculates "
                             f"by 'ngram' (n-gram prompt lookup) only, no draft models yet")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if value.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs num_speculative_tokens (how many tokens a step drafts)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            number = value.get(name)
            if number is not None and (not is_int(number) or number <= 0):
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {number!r}")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        value["prompt_lookup_min"] = low if low is not None else high
        value["prompt_lookup_max"] = high if high is not None else low
        config = cls(**{k: v for k, v in value.items() if v is not None})
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config

    def describe(self) -> str:
        """In words, for the start-up log."""
        below = f", below {self.disable_by_batch_size} running sequences" if self.disable_by_batch_size else ""
        return (f"n-gram lookup of {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens, up to "
                f"{self.num_speculative_tokens} drafts a step{below}")


def json_object(text: str) -> dict:
    """A command-line JSON object (vLLM's --speculative-config)."""
    import argparse
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); give a JSON object such as "
                                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is expected, got {text!r}")
    return value
