"""Requests: a prompt, its sampling parameters and its n sequences; and the checks that
refuse a request that could never run, before it costs the engine anything."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.scheduler import check_fits
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

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
    error: ValueError | None = None  # why it ended before it ran (a grammar that did not compile)

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


class RequestChecker:
    """Tokenizes a prompt and rejects a request that could never run; needs no model, so
    the server's API process checks with one too, and a bad request gets its error there."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int, max_logprobs: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_logprobs = max_logprobs

    @classmethod
    def from_config(cls, config: Config, tokenizer: PreTrainedTokenizerBase, num_kvcache_blocks: int) -> RequestChecker:
        return cls(tokenizer, config.hf_config.vocab_size, config.max_model_len, config.kvcache_block_size,
                   num_kvcache_blocks, config.max_logprobs)

    @property
    def most_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold: what check() lets through
        (check_fits: max_model_len, and the whole cache's blocks)."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        # Checked with C-level passes (type, min, max) first: the engine process checks
        # every prompt again, and a Python generator over every id is slow for long prompts.
        if not isinstance(prompt, list) or not (set(map(type, prompt)) <= {int} or all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise ValueError(f"a prompt must be a string or a list of token ids (ints); got {type(prompt).__name__}")
        if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def check(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids; ValueError for a request that could never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        check_fits(len(token_ids), params.max_tokens, self.max_model_len, self.block_size, self.num_blocks)
        bad = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs ({params.logprobs}) exceeds max_logprobs ({self.max_logprobs}), the most "
                             f"alternatives this engine returns per token")
        return token_ids
