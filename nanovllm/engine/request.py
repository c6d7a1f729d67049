"""Requests: a prompt, its sampling parameters and its n sequences; and the checks that
refuse a request that could never run, before it costs the engine anything."""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.inputs import not_all_ints
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.utils import is_int

Prompt = str | list[int]

# Completion i of a request with seed s draws its random numbers from the key
# (s * SEED_MULTIPLIER + i) mod 2**62: distinct per completion, the same on every run.
SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, an odd constant that spreads seeds
SAMPLING_KEY_MASK = (1 << 62) - 1


def seeded_key(seed: int, index: int) -> int:
    """The draw key of completion `index` of a request seeded with `seed`."""
    return (seed * SEED_MULTIPLIER + index) & SAMPLING_KEY_MASK


@dataclass(slots=True)
class Request:
    """One prompt with its sampling parameters and its n sequences (completions)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    grammar: Future | None = None  # its structured-output grammar, compiling or compiled
    error: Exception | None = None  # why it ended before it ran (its grammar did not compile)
    owner: object = None  # the engine that made it, the only one that may run it
    added: bool = False  # add_request has taken it (once only)

    # Both read for every running request after every step of a server: one sequence (the
    # usual n=1) skips the generator.
    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].is_finished if len(seqs) == 1 else all(seq.is_finished for seq in seqs)

    @property
    def num_known_completion_tokens(self) -> int:
        """Completion tokens known on the host, over all n sequences."""
        seqs = self.seqs
        return seqs[0].num_known_completion_tokens if len(seqs) == 1 else sum(s.num_known_completion_tokens for s in seqs)


def owned(request: object, owner: object, call: str) -> Request:
    """request, if it is a Request that `owner` made; TypeError or ValueError for anything else."""
    if not isinstance(request, Request):
        raise TypeError(f"{call} takes a Request from make_request, got {type(request).__name__}")
    if request.owner is not owner:
        raise ValueError(f"request {request.request_id} was made by another LLM; {call} on that one")
    return request


def vocabulary_error(ids, vocab_size: int, what: str = "token ids") -> str | None:
    """The error for ids outside [0, vocab_size), naming the first few; None when all are in."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    return f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})" if bad else None


class PromptError(ValueError):
    """A prompt that cannot run as given (empty, not token ids of the vocabulary, or too long
    to leave room for output): the request's prompt is at fault, not one of its parameters."""


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int,
               truncated: bool = False) -> None:
    """Reject a request that could never run, instead of letting it wait forever.
    truncated: the prompt is what truncate_prompt_tokens kept."""
    if num_prompt_tokens == 0:
        raise PromptError("the prompt is empty: give at least one token")
    if num_prompt_tokens >= min(max_model_len, num_blocks * block_size):
        where = (f"max_model_len ({max_model_len})" if max_model_len <= num_blocks * block_size
                 else f"the whole KV cache ({num_blocks * block_size} tokens)")
        hint = ("lower truncate_prompt_tokens, or set it to -1" if truncated
                else "shorten it (or set truncate_prompt_tokens)")
        raise PromptError(f"prompt ({num_prompt_tokens} tokens) leaves no room for output within {where}; {hint}")
    # The prompt fits on its own: max_tokens is what to lower (the message starts with it,
    # which names the field a server's error points at).
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValueError(
            f"max_tokens ({max_tokens}) + the prompt's {num_prompt_tokens} tokens = {total} exceeds "
            f"max_model_len ({max_model_len}); lower max_tokens or shorten the prompt"
        )
    blocks = (total + block_size - 1) // block_size
    if blocks > num_blocks:
        raise ValueError(
            f"max_tokens ({max_tokens}) + the prompt's {num_prompt_tokens} tokens need {blocks} KV blocks, but "
            f"the whole cache has {num_blocks}; lower max_tokens or give the cache more memory"
        )


class RequestChecker:
    """Tokenizes a prompt and rejects a request that could never run; needs no model, so
    the server's API process checks with one too, and a bad request gets its error there."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int, max_logprobs: int, eos_token_ids: Iterable[int] = (),
                 scheduling_policy: str = "fcfs"):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_logprobs = max_logprobs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.scheduling_policy = scheduling_policy

    @classmethod
    def from_config(cls, config: Config, tokenizer: PreTrainedTokenizerBase, num_kvcache_blocks: int,
                    eos_token_ids: Iterable[int] = ()) -> RequestChecker:
        return cls(tokenizer, config.hf_config.vocab_size, config.max_model_len, config.kvcache_block_size,
                   num_kvcache_blocks, config.max_logprobs, eos_token_ids, config.scheduling_policy)

    @property
    def most_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold: what check() lets through
        (check_fits: max_model_len, and the whole cache's blocks)."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt)
            except TypeError:  # the tokenizers library's, for text that is not valid Unicode
                try:
                    prompt.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise PromptError(f"the prompt is not valid text: {exc.reason} at character {exc.start}") from None
                raise
        # Checked with C-level passes (type, min, max) first: the engine process checks
        # every prompt again, and a Python generator over every id is slow for long prompts.
        if not isinstance(prompt, list):
            raise PromptError(f"a prompt must be a string or a list of token ids (ints); got {type(prompt).__name__}")
        if not (set(map(type, prompt)) <= {int} or all(map(is_int, prompt))):
            raise PromptError(not_all_ints(prompt))
        if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            raise PromptError(vocabulary_error(prompt, self.vocab_size))
        return list(prompt)

    def check(self, prompt: Prompt, params: SamplingParams, fit: bool = False) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids (its last truncate_prompt_tokens, if set) and the params
        to run it with; ValueError for a request that could never run. max_tokens=None
        becomes what the context leaves after the prompt, and so does a larger max_tokens
        with fit=True (vLLM's offline calls: the output stops at the context's end), where
        fit=False refuses it (its server's)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None and keep > self.max_model_len:  # as vLLM, refused rather than ignored
            raise ValueError(f"truncate_prompt_tokens ({keep}) exceeds max_model_len ({self.max_model_len}); give at "
                             f"most that, or -1 (as many as leave room for max_tokens)")
        if keep == -1:  # as many as leave room for max_tokens (or for one token)
            keep = max(1, self.most_tokens - min(params.max_tokens or 1, self.most_tokens - 1))
        if keep is not None:
            token_ids = token_ids[-keep:]
        check_fits(len(token_ids), 1, self.max_model_len, self.block_size, self.num_blocks,  # a prompt that fits
                   truncated=keep is not None)
        room = self.most_tokens - len(token_ids)
        if params.max_tokens is None or (fit and params.max_tokens > room):
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        check_fits(len(token_ids), params.max_tokens, self.max_model_len, self.block_size, self.num_blocks)
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            if error := vocabulary_error(getattr(params, name) or (), self.vocab_size, name):
                raise ValueError(error)
        for name in ("logprobs", "prompt_logprobs"):
            asked = value = getattr(params, name)
            if asked == -1:  # vLLM's: the whole vocabulary
                params = dataclasses.replace(params, **{name: self.vocab_size})
                value = self.vocab_size
            if value is not None and value > self.max_logprobs:
                whole = f"-1, the whole vocabulary of {value}" if asked == -1 else value
                raise ValueError(f"{name} ({whole}) exceeds max_logprobs ({self.max_logprobs}), the most "
                                 f"alternatives this engine returns per token (its max_logprobs / --max-logprobs "
                                 f"sets it; -1: the whole vocabulary)")
        if params.allowed_token_ids is not None:
            self._check_allowed(params)
        return token_ids, params

    def check_request(self, prompt: Prompt, params: SamplingParams, priority: int, fit: bool,
                      copy_params: bool = True) -> tuple[list[int], SamplingParams, int]:
        """A request's (token_ids, params, priority), each checked (check_priority, check): params
        as the request's own copy (own), or as given where copy_params is False (already
        its own, checked, which no one changes)."""
        priority = self.check_priority(priority)
        token_ids, params = self.check(prompt, self.own(params) if copy_params else params, fit)
        return token_ids, params, priority

    @staticmethod
    def own(params: SamplingParams) -> SamplingParams:
        """A request's own copy of params (SamplingParams.snapshot), checked again: fields
        changed since construction are checked too (ValueError), and changing the
        caller's object later changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params = params.snapshot()
        params.verify()
        return params

    def check_priority(self, priority: int) -> int:
        """A request's priority (vLLM's: lower runs first), which only scheduling_policy
        "priority" reads; another policy takes 0 alone, as vLLM's does."""
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):  # numpy's integers too
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.scheduling_policy != "priority":
            raise ValueError(f"priority ({priority}) needs scheduling_policy='priority' (--scheduling-policy "
                             f"priority); this engine's is {self.scheduling_policy!r}")
        return int(priority)

    def _check_allowed(self, params: SamplingParams) -> None:
        """Refuse allowed_token_ids that leave the first token nothing to be: each is a
        one-token bad word, or (under min_tokens) an end-of-sequence or stop token."""
        allowed = set(params.allowed_token_ids) - {ids[0] for ids in self.bad_words_token_ids(params) or ()
                                                   if len(ids) == 1}
        if not allowed:
            raise ValueError("allowed_token_ids allow only tokens that bad_words forbid: nothing could be generated")
        stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_token_ids)
        if params.min_tokens and allowed <= stops:
            raise ValueError(f"allowed_token_ids allow only end-of-sequence or stop tokens, which min_tokens "
                             f"({params.min_tokens}) forbids before its count: nothing could be generated")

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """params.bad_words as token ids: each word as written and with one leading space
        (how it reads after another word), each distinct form once."""
        if not params.bad_words:
            return None
        forms: dict[tuple[int, ...], None] = {}
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced[1:] if spaced[1:] == plain else spaced):  # not a lone space before plain
                if ids and max(ids) < self.vocab_size:  # a token the model cannot draw is never generated
                    forms.setdefault(tuple(ids), None)
        return [list(ids) for ids in forms] or None
