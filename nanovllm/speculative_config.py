"""vLLM's speculative_config, checked (Config.speculative; a draft model's own Config is
Config.draft); the speculation itself is engine/speculative.py's."""
from __future__ import annotations

from dataclasses import dataclass, fields

from nanovllm.utils import is_int


# vLLM's lookup length where a config gives neither bound (one given sets the other).
DEFAULT_PROMPT_LOOKUP = 5


METHODS = ("ngram", "draft_model")
LOOKUP_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
DRAFT_KEYS = ("model", "draft_tensor_parallel_size", "quantization", "max_model_len")
# vLLM's keys that change nothing here at these values: its verification is rejection sampling too.
NO_EFFECT = {"acceptance_method": "rejection_sampler", "draft_token_acceptance_method": "rejection_sampler"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config. Each decode step drafts up to num_speculative_tokens
    tokens and the model verifies them in one pass (engine/speculative.py), with method
    - "ngram": the tokens that followed an earlier occurrence of the sequence's last n
      tokens (n from prompt_lookup_max down to prompt_lookup_min; as vLLM, both 5 where
      neither is given, and one given sets the other);
    - "draft_model" (what a "model" alone means): a smaller model's greedy tokens, from the
      checkpoint folder `model` (same vocabulary; split over the model's ranks, or whole on
      the first with draft_tensor_parallel_size 1; `quantization` is the draft's own; past
      `max_model_len`, at most its own context and the model's max_model_len, sequences
      draft nothing).
    With disable_by_batch_size, steps that start with at least that many running sequences
    draft nothing (and keep the engine's overlap of host and GPU work)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    quantization: str | None = None
    max_model_len: int | None = None  # the draft's: no draft past it (its own context at most)

    @classmethod
    def parse(cls, value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            value = {f.name: getattr(value, f.name) for f in fields(cls)
                     if not (value.method == "draft_model" and f.name in LOOKUP_KEYS)}
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {value!r}")
        value = {k: v for k, v in value.items() if v is not None}
        for name, fine in NO_EFFECT.items():
            if value.get(name, fine) != fine:
                raise ValueError(f"speculative_config: {name} {value[name]!r} is not supported: nanovllm verifies "
                                 f"drafts by rejection sampling ({fine!r})")
            value.pop(name, None)
        if "speculative_model" in value:
            raise ValueError("speculative_config: give the draft's folder as 'model' (vLLM's current name for "
                             "'speculative_model')")
        method = _method(value)
        known = {f.name for f in fields(cls)} - set(DRAFT_KEYS if method == "ngram" else LOOKUP_KEYS)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: {unknown[0]!r} is not supported with method {method!r} "
                             f"(supported: {', '.join(sorted(known))})")
        if value.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs num_speculative_tokens (how many tokens a step drafts)")
        for name in ("num_speculative_tokens", *LOOKUP_KEYS, "disable_by_batch_size", "draft_tensor_parallel_size",
                     "max_model_len"):
            number = value.get(name)
            if number is not None and (not is_int(number) or number <= 0):
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {number!r}")
        if method == "ngram":
            low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
            value["prompt_lookup_min"] = low if low is not None else high
            value["prompt_lookup_max"] = high if high is not None else low
        elif not isinstance(value.get("model"), str):
            raise ValueError("speculative_config: method 'draft_model' needs the draft's checkpoint folder as 'model'")
        config = cls(**{k: v for k, v in value.items() if v is not None})
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config

    def describe(self) -> str:
        """In words, for the start-up log."""
        below = f", below {self.disable_by_batch_size} running sequences" if self.disable_by_batch_size else ""
        drafts = f"up to {self.num_speculative_tokens} drafts a step{below}"
        if self.method == "draft_model":
            return f"draft model {self.model}, {drafts}"
        return f"n-gram lookup of {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens, {drafts}"


def _method(value: dict) -> str:
    """The method a speculative_config names (vLLM's older spellings included), checked;
    value's "method" is set to it."""
    method, model = value.get("method"), value.get("model")
    if method is None and model in ("ngram", "[ngram]"):  # vLLM's older "model": "[ngram]"
        method = value.pop("model")
    elif method is None and model is not None:  # as vLLM: a model alone is a draft model
        method = "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method is None:
        raise ValueError("speculative_config needs a method: 'ngram' (n-gram prompt lookup), e.g. "
                         "{'method': 'ngram', 'num_speculative_tokens': 4}, or a draft model's folder as 'model'")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not supported: 'ngram' (n-gram prompt lookup) "
                         f"or 'draft_model' (a smaller model's folder as 'model')")
    value["method"] = method
    return method


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
