"""Speculative decoding by n-gram prompt lookup (vLLM's speculative_config method "ngram").

A decoding sequence whose last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
occurred before, in its prompt or its output, drafts the tokens that followed them there, up
to num_speculative_tokens (NgramProposer, lookup). The scheduler appends the drafts
to the sequence (Sequence.add_drafts) and schedules them with its last token; the step
computes the logits at each of those 1 + k positions and samples each row as a decode step
at that position would: the same keyed draw (utils/keyed_noise.py), so row j's token is
the one decoding would have drawn had the drafts before it been drawn. Read back, the drafts
stand up to the first that differs from its row's token (accept_verified); the step outputs those
drafts and the token of the row after them (the one that differed, or one more after all
k): 1 to k + 1 tokens for one pass over the weights.

That is rejection sampling for a draft that puts all its probability on one token: a draft
is kept with the probability the model gives it, and otherwise the token comes from the
model's distribution without it. It also gives the very tokens that decoding without
speculation gives (greedy, and seeded sampling), which is what the tests check.

A sequence speculates only where each row's distribution depends on its position alone:
no penalties (their counts would miss the drafts before a row), no logits processors
(allowed_token_ids, logit_bias, bad words, a grammar, min_tokens still to reach). The others
decode one token at a time in the same steps.
"""
from __future__ import annotations

import weakref
from collections.abc import Collection

import numpy as np

from nanovllm.speculative_config import SpeculativeConfig
from nanovllm.sequence import Sequence


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_batch = config.disable_by_batch_size
        # Each sequence's tokens as an int64 array, extended by what is new at each look (a
        # known token never changes): not the whole list converted again every step.
        self.arrays: weakref.WeakKeyDictionary[Sequence, TokenArray] = weakref.WeakKeyDictionary()

    def drafts_for(self, running: Collection[Sequence]) -> bool:
        """Whether a step that starts with these sequences running may draft: fewer than
        disable_by_batch_size, and one that can speculate among them (the engine then reads
        the step in flight back first: drafts are looked up in known tokens)."""
        return (self.max_batch is None or len(running) < self.max_batch) and any(map(speculates, running))

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(k, limit) drafts for seq's next tokens (none where it cannot speculate,
        has tokens still on their way, or its last tokens occurred nowhere before)."""
        params = seq.params
        limit = min(limit, self.k, params.max_tokens - seq.num_completion_tokens - 1)
        if limit <= 0 or seq.num_pending_tokens or not speculates(seq):
            return []
        if (array := self.arrays.get(seq)) is None:
            array = self.arrays[seq] = TokenArray()
        return lookup(array.extended(seq.token_ids), limit, self.min_n, self.max_n)


class TokenArray:
    """A growing int64 copy of a list that only ever grows at its end."""

    def __init__(self):
        self.data = np.empty(256, dtype=np.int64)
        self.size = 0

    def extended(self, tokens: list[int]) -> np.ndarray:
        """The array of `tokens`, copying only those added since the last call."""
        assert len(tokens) >= self.size, "the list only grows"
        if len(tokens) > len(self.data):
            grown = np.empty(max(len(tokens), 2 * len(self.data)), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size : len(tokens)] = tokens[self.size :]
        self.size = len(tokens)
        return self.data[: self.size]


def speculates(seq: Sequence) -> bool:
    """Whether seq's rows may be sampled ahead of its tokens (see the module's docstring)."""
    p = seq.params
    return not (p.penalized or p.logit_bias or p.allowed_token_ids or seq.bad_words or seq.grammar is not None
                or seq.num_completion_tokens < p.min_tokens)


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The up-to-k tokens that followed an earlier occurrence of tokens' longest suffix of
    min_n..max_n tokens (the latest with k tokens after it, else the earliest); [] if none."""
    last = len(tokens) - 1
    starts = np.flatnonzero(tokens[:last] == tokens[last])  # where the matches end: 1-token matches first
    best = starts[:0]
    for n in range(1, min(max_n, last) + 1):
        if n > 1:  # the matches that extend one token further back
            starts = starts[starts >= n - 1]
            starts = starts[tokens[starts - (n - 1)] == tokens[last - (n - 1)]]
        if not len(starts):
            break
        if n >= min_n:
            best = starts
    if not len(best):
        return []
    whole = best[best + k <= last]
    end = int(whole[-1] if len(whole) else best[0])
    return tokens[end + 1 : end + 1 + k].tolist()


def accept_verified(seq: Sequence, tokens: list[int]) -> list[int]:
    """seq's verifying step is read, `tokens` its rows' tokens: accept its drafts up to the
    first that its row's token contradicts (Sequence.accept_drafts) and return the tokens the
    step outputs (those drafts, then the next row's token), for the caller to append one by one."""
    drafts = seq.drafts
    accepted = 0
    while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
        accepted += 1
    seq.accept_drafts(accepted)
    return tokens[: accepted + 1]
