"""SamplingParams: how each request picks its next tokens (vLLM's names and meanings), and
StructuredOutputsParams: what shape its output must take."""
from __future__ import annotations

import copy
import json as json_module
import logging
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

from nanovllm.utils import is_int

logger = logging.getLogger(__name__)

# The penalties apply in float32: a repetition_penalty outside its normal range becomes 0 or inf there.
FLOAT32_TINY, FLOAT32_MAX = 1.1754944e-38, 3.4028235e38
# A temperature above 0 but below this one samples as this one (vLLM's floor): logits divided
# by less would overflow.
MIN_TEMPERATURE = 0.01


def _plain(value: Any) -> Any:
    """Another library's scalar number (numpy's int64, float32, ...) as Python's int or float."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def is_number(value: object) -> bool:
    """A finite int or float: NaN and infinities are never a meaningful setting."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a completion, as vLLM's: exactly one of
    json: a JSON schema (a dict, its JSON text, or a pydantic model's model_json_schema());
    regex: a regular expression the whole output matches;
    choice: a list of strings, the output being one of them;
    grammar: an EBNF grammar (xgrammar's / GBNF syntax, start rule `root`);
    json_object: True, for any JSON object.
    disable_any_whitespace: JSON in one fixed layout (", " and ": " between items, no
    newlines) rather than with any whitespace (runs of at most 16 characters)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check the fields (ValueError), as construction does; again after changing them."""
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar and json_object; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                json_module.loads(self.json)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be True or False, got {value!r}")

    def key(self) -> tuple[str, str]:
        """(kind, its text): what a compiled grammar is cached by, and compiled from. The
        schema's key order stays: it is the order in which the output writes properties.
        JSON's kinds end in "_compact" under disable_any_whitespace."""
        compact = "_compact" if self.disable_any_whitespace else ""
        if self.json is not None:
            try:
                text = self.json if isinstance(self.json, str) else json_module.dumps(self.json)
            except (RecursionError, TypeError, ValueError) as exc:  # (nested past Python's depth; not JSON)
                raise ValueError(f"structured_outputs.json cannot be written as JSON: {exc}") from None
            return "json" + compact, text
        if self.choice is not None:
            return "choice", json_module.dumps(self.choice)
        if self.json_object:
            return "json_object" + compact, ""
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclass(slots=True)
class SamplingParams:
    """How one request samples, with vLLM's names and meanings.

    n: completions per prompt (with prefix caching, the prompt's KV blocks are computed
    once and shared).
    Numbers may be numpy's (or any library's) scalars too.

    temperature: 0 means greedy (argmax); above 0, at least MIN_TEMPERATURE. top_k keeps
    the k most likely tokens (0 or -1: all), top_p then the smallest set whose
    (renormalized) probability reaches p (1: all), min_p the tokens at least min_p times as
    likely as the most likely one (0: all).
    presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]) subtract from the logit of
    every token already generated, once / once per occurrence; repetition_penalty (> 0,
    1 = off; transformers' and vLLM's) divides positive and multiplies negative logits of
    tokens in the prompt or the output.
    seed: the same seed and prompt give the same tokens whatever else is in the batch
    (-1, as None: no seed).
    stop: strings that end the completion when they appear in its text (cut off unless
    include_stop_str_in_output); stop_token_ids: tokens that end it (like end-of-sequence).
    max_tokens counts generated tokens (None: up to the context's end; offline, a prompt
    whose max_tokens would pass max_model_len stops there, with finish_reason "length");
    min_tokens forbids end-of-sequence and stop tokens before that many; ignore_eos keeps
    generating past end-of-sequence (benchmarks).
    logit_bias: {token id: bias} added to those logits; allowed_token_ids: only these may be
    drawn; bad_words: words that may not be generated (a word's tokens, written with and
    without a leading space, may not all follow each other).
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: as many as leave room
    for max_tokens within max_model_len and the KV cache).
    logprobs: return, per generated token, its log-probability and those of the top
    `logprobs` alternatives (0: only the chosen one; -1: the whole vocabulary), from the
    raw logits; at most the engine's max_logprobs.
    skip_special_tokens: leave special tokens out of the text; detokenize=False: no text at
    all (token ids only, "" for text and None for the logprobs' decoded tokens).
    structured_outputs: a StructuredOutputsParams the output must satisfy (a JSON schema,
    a regex, a choice, a grammar); it ends, with finish_reason "stop", where it is complete.
    extra_args: kept for code that reads it back (vLLM's); the engine does not.
    prompt_logprobs: return, for every prompt token after the first, its log-probability
    and those of the top `prompt_logprobs` alternatives at its position (0: its own only;
    -1: the whole vocabulary), from the raw logits (RequestOutput.prompt_logprobs); at most the engine's max_logprobs.
    The request's prompt is then computed in full, without prefix-cache hits.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check the fields (ValueError) and bring them to their plain forms, as construction
        does. The engine calls it again for each request, so that fields changed after
        construction are checked too."""
        for field in fields(self):
            setattr(self, field.name, _plain(getattr(self, field.name)))
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:  # (inf in float32)
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy) within float32's range (at most "
                             f"3.4e38), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g, which it samples at instead (0 = greedy)", self.temperature,
                           MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 for no limit; got {self.top_k!r}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not is_number(self.repetition_penalty) or not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off) within float32's normal range "
                             f"(1.2e-38 to 3.4e38), got {self.repetition_penalty!r}")
        if self.seed == -1 and is_int(self.seed):  # vLLM's: no seed
            self.seed = None
        if self.seed is not None and (not is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            raise ValueError(f"seed must be None or a 64-bit signed integer, got {self.seed!r}")
        # A lone string is a list of one, and None an empty list (as vLLM's are, after init).
        self.stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are found in the text: they need detokenize=True")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None (up to the context's end), "
                             f"got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise ValueError(f"{name} must be None, an integer >= 0, or -1 (the whole vocabulary), got {value!r}")
        self._check_token_fields()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.verify()

    def _check_token_fields(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens (token ids are
        checked against the vocabulary when a request is made)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(t) and t >= 0 and is_number(b) for t, b in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids (ints >= 0) to finite numbers, "
                                 f"got {self.logit_bias!r}")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, list)
                                                   or not self.allowed_token_ids
                                                   or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (ints >= 0), "
                             f"got {self.allowed_token_ids!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of words (non-blank strings), got {self.bad_words!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for as many as leave room "
                             f"for max_tokens, got {k!r}")

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's: the arguments given as None take their defaults, but max_tokens=None (up to
        the context's end)."""
        return cls(**{name: value for name, value in kwargs.items() if value is not None or name == "max_tokens"})

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy, to change without touching this one."""
        return copy.deepcopy(self)

    def snapshot(self) -> SamplingParams:
        """The copy a request runs on (RequestChecker.own): changing this object later does
        not reach it. The lists and dicts the engine reads are copied, and structured_outputs
        but not the schema in it (read once, as the request is made); extra_args is shared
        (the engine does not read it). Never deep, so a schema nested past Python's depth
        copies too."""
        copied = copy.copy(self)
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(value := getattr(copied, name), list):
                setattr(copied, name, list(value))
        if isinstance(copied.logit_bias, dict):
            copied.logit_bias = dict(copied.logit_bias)
        if copied.structured_outputs is not None:
            copied.structured_outputs = copy.copy(copied.structured_outputs)
        return copied

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p restricts the tokens sampled from."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
