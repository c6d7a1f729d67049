"""Speculative decoding (vLLM's speculative_config): a decoding sequence gets up to
num_speculative_tokens drafted next tokens, the model verifies them in one pass.

Drafts come from
- n-gram prompt lookup (method "ngram", NgramProposer): where the sequence's last n tokens
  (n from prompt_lookup_max down to prompt_lookup_min) occurred before, in its prompt or
  its output, the tokens that followed them there;
- a draft model (method "draft_model", DraftModelProposer): a smaller model's greedy
  tokens (executor/draft.py runs it).

The scheduler appends the drafts to the sequence (Sequence.add_drafts; a draft model's are
placeholders until the engine has it write them, DraftModelProposer.fill) and schedules
them with its last token; the step
computes the logits at each of those 1 + k positions and samples each row as a decode step
at that position would: the same keyed draw (utils/keyed_noise.py), so row j's token is
the one decoding would have drawn had the drafts before it been drawn. Read back, the drafts
stand up to the first that differs from its row's token (accept_verified); the step outputs those
drafts and the token of the row after them (the one that differed, or one more after all
k): 1 to k + 1 tokens for one pass over the weights.

That is rejection sampling for a draft that puts all its probability on one token: a draft
is kept with the probability the model gives it, and otherwise the token comes from the
model's distribution without it. It also gives the very tokens that decoding without
speculation gives (greedy, and seeded sampling), which is what the tests check. (Drafts
sampled at the request's temperature and kept by the ratio of the two models'
probabilities, as in the speculative-sampling papers, give the same distribution, more
drafts kept at high temperatures, other tokens.)

Each row's logits processors and penalties see the drafts before it: allowed_token_ids and
logit_bias apply to every row alike, min_tokens by the row's position, bad words after the
tokens before it, drafts included, penalties with those drafts counted as output
(sampler.DraftPenalties, which also counts only the kept rows' tokens); a structured
output's grammar gives row j what it allows after the first j drafts
(sampling/logits_processors.fill_after_drafts; n-gram drafts stop before one it refuses),
once it applies. A sequence whose grammar waits for the end of its reasoning (a reasoning
parser) decodes one token at a time in the same steps until then.
"""
from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from nanovllm.engine.block_manager import BlockManager
from nanovllm.executor.step import StepSeq
from nanovllm.speculative_config import SpeculativeConfig
from nanovllm.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.config import Config
    from nanovllm.executor.executor import Executor


# A draft model's draft before the draft model has run (never a model input: fill() writes them).
NOT_DRAFTED = -2


class Proposer:
    """What both methods share: how many drafts, and when."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.max_batch = config.disable_by_batch_size

    def drafts_for(self, running: Collection[Sequence]) -> bool:
        """Whether a step that starts with these sequences running may draft: fewer than
        disable_by_batch_size, and one that can speculate among them (the engine then reads
        the step in flight back first: drafts follow known tokens)."""
        return (self.max_batch is None or len(running) < self.max_batch) and any(map(speculates, running))

    def limit(self, seq: Sequence, limit: int) -> int:
        """How many drafts seq may take: at most `limit` (the step's budget left), k, and
        what its max_tokens leaves; none where it cannot speculate or has tokens on their way."""
        if seq.num_pending_tokens or not speculates(seq):
            return 0
        return max(0, min(limit, self.k, seq.params.max_tokens - seq.num_completion_tokens - 1))

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Drafts for seq's next tokens, at most self.limit(seq, limit) of them."""
        raise NotImplementedError

    def fill(self, seqs: list[Sequence], executor: Executor) -> None:
        """Complete the drafts of a scheduled step (a draft model writes them now)."""


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        # Each sequence's tokens as an int64 array, extended by what is new at each look (a
        # known token never changes): not the whole list converted again every step.
        self.arrays: weakref.WeakKeyDictionary[Sequence, TokenArray] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """The tokens after the latest earlier occurrence of seq's last n tokens (lookup)."""
        if (limit := self.limit(seq, limit)) <= 0:
            return []
        if (array := self.arrays.get(seq)) is None:
            array = self.arrays[seq] = TokenArray()
        drafts = lookup(array.extended(seq.token_ids), limit, self.min_n, self.max_n)
        if drafts and seq.grammar is not None:  # none past one its grammar refuses (never kept)
            del drafts[seq.grammar.allowed_prefix(drafts):]
        return drafts


class DraftComputed(NamedTuple):
    """What a sequence's draft K/V holds since its last proposal."""
    end: int  # the sequence's positions it computed (those before the drafts)
    fed: list[int]  # the drafts fed after them (their K/V stands where they match the tokens now)
    preemptions: int  # the sequence's preemptions then (one since frees the blocks, K/V and all)


class DraftPart(NamedTuple):
    """What one draft call does for a sequence."""
    record: StepSeq  # the tokens it computes, from where
    count: int  # the drafts to make after them
    seq: Sequence


class DraftModelProposer(Proposer):
    """Drafts by a draft model. The schedule gives a sequence as many placeholder drafts as
    its budget and blocks allow; then fill() has the model run the draft (Executor.propose)
    over what it has not computed of each sequence, and write its greedy tokens in. A
    prompt's chunks it computes in the steps that compute them (no drafts asked), so that
    the long catch-up of a whole prompt never lands on one decode step.

    What the draft's K/V holds: per sequence, the positions it computed up to its last
    proposal and the drafts it fed then (standing where they match the tokens the sequence
    has now); per block, the chained hash (BlockManager.block_hash) of the full block of
    tokens whose K/V it holds, so that a sequence starts after the blocks of its prefix
    that any sequence's draft computed (a prefix-cache hit, an n > 1 sibling)."""

    def __init__(self, config: SpeculativeConfig, max_tokens: int, max_len: int, block_size: int,
                 vocab_size: int | None = None):
        super().__init__(config)
        self.vocab_size = vocab_size  # the draft's: the model's tokens past it go in as its last
        self.max_tokens = max_tokens  # the most tokens one call computes (the draft's input buffers)
        self.max_len = max_len  # the draft's context: no draft at a position past it
        self.block_size = block_size
        self.computed: weakref.WeakKeyDictionary[Sequence, DraftComputed] = weakref.WeakKeyDictionary()
        self.block_contents: dict[int, int] = {}  # block id -> hash of the full block its draft K/V is of

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return [NOT_DRAFTED] * self._num_drafts(seq, limit)

    def _num_drafts(self, seq: Sequence, limit: int) -> int:
        """self.limit's, and none at a position past the draft's context."""
        return max(0, min(self.limit(seq, limit), self.max_len - len(seq)))

    def _start(self, seq: Sequence, known: int) -> int:
        """Where seq's draft K/V stops holding its tokens (its newest token is always new)."""
        done, fed, preemptions = self.computed.get(seq, DraftComputed(0, [], -1))
        if preemptions == seq.num_preemptions:  # (a preemption frees the blocks, K/V and all)
            while fed and done < known and seq.token_ids[done] == fed[0]:
                done, fed = done + 1, fed[1:]
        else:
            done = 0
            while (done + self.block_size < known and self.block_contents.get(
                    seq.block_table[done // self.block_size]) == BlockManager.block_hash(seq, done // self.block_size)):
                done += self.block_size
        return min(done, known - 1)

    def fill(self, seqs: list[Sequence], executor: Executor) -> None:
        """Write the drafts of the sequences that have placeholders, and have the draft
        compute the prompt chunks the step computes of sequences that will draft, so that
        their first proposal finds it one token behind."""
        for call in self._calls(seqs):
            drafts = executor.propose([part.record for part in call], [part.count for part in call])
            if drafts is None:  # the draft failed: the step goes without the drafts not written
                for seq in seqs:  # (the scheduler frees their blocks)
                    if seq.num_draft_tokens and seq.token_ids[-1] == NOT_DRAFTED:
                        seq.num_scheduled_tokens -= seq.num_draft_tokens
                        seq.drop_drafts()
                return
            for (record, count, seq), tokens in zip(call, drafts):
                assert len(tokens) == count, "a draft for each placeholder"
                if count:
                    seq.token_ids[len(seq) - count :] = tokens
                self._computed(seq, record, tokens[:-1])

    def _calls(self, seqs: list[Sequence]) -> list[list[DraftPart]]:
        """The draft's calls for a step, each a list of parts: the tokens the draft has not
        computed, up to the last known one (drafting) or to the end of the step's prompt
        chunk. A call computes at most max_tokens tokens: a longer catch-up (a prompt's that
        the draft did not see chunk by chunk) goes in parts, the first ones in calls of their own."""
        calls: list[list[DraftPart]] = []
        call, room = [], self.max_tokens
        for seq in seqs:
            if seq.num_draft_tokens:
                end = seq.num_known_tokens
            elif self._drafts_later(seq):
                end = seq.num_cached_tokens + seq.num_scheduled_tokens
            else:
                continue
            if (start := self._start(seq, seq.num_known_tokens)) >= end:
                continue
            while end - start > room:
                if room:
                    call.append(DraftPart(StepSeq(self._inputs(seq.token_ids[start : start + room]), start,
                                                  seq.block_table), 0, seq))
                    start += room
                calls.append(call)
                call, room = [], self.max_tokens
            call.append(DraftPart(StepSeq(self._inputs(seq.token_ids[start:end]), start, seq.block_table),
                                  seq.num_draft_tokens, seq))
            room -= end - start
        calls.append(call)
        return [call for call in calls if call]

    def _drafts_later(self, seq: Sequence) -> bool:
        """Whether seq computes a chunk of its prompt this step (no output yet) and will draft
        once it decodes (within the draft's context, a draft left under max_tokens)."""
        return seq.num_scheduled_tokens > 0 and seq.num_completion_tokens == 0 and self._num_drafts(seq, self.k) > 0

    def _inputs(self, tokens: list[int]) -> list[int]:
        """Tokens as the draft takes them: one past its vocabulary (a padding id of the
        model's larger one, never a real token) as its last."""
        if self.vocab_size is not None and max(tokens) >= self.vocab_size:
            return [min(token, self.vocab_size - 1) for token in tokens]
        return tokens

    def _computed(self, seq: Sequence, record: StepSeq, fed: list[int]) -> None:
        """Note what a call's record of seq had the draft compute: its tokens, and the drafts
        fed (all but the last), in the blocks after the record's start."""
        end = len(record)
        self.computed[seq] = DraftComputed(end, fed, seq.num_preemptions)
        size = self.block_size
        for i in range(record.num_cached_tokens // size, (end + len(fed) - 1) // size + 1):
            block_id = seq.block_table[i]
            if (i + 1) * size <= end:  # full of the sequence's tokens
                self.block_contents[block_id] = BlockManager.block_hash(seq, i)
            else:
                self.block_contents.pop(block_id, None)


def make_proposer(config: Config) -> Proposer | None:
    """The speculative method's proposer (None: no speculation)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "draft_model":
        return DraftModelProposer(spec, config.max_num_batched_tokens, config.draft.max_model_len,
                                  config.kvcache_block_size, config.draft.hf_config.vocab_size)
    return NgramProposer(spec)


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
    grammar = seq.grammar
    return grammar is None or (grammar.applies and grammar.may_open is None)


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
