"""Sequence: one completion's tokens and its place in the paged KV cache.

The record that the engine (scheduler, block manager, output processor) keeps and the
executor reads to build a step's inputs and sampling parameters.
"""
from __future__ import annotations

from enum import Enum, auto
from typing import Any

from nanovllm.sampling_params import SamplingParams


# Stands in token_ids for a sampled token that is still on the GPU: the engine launches
# decode step N+1 before it reads step N's tokens back (see LLMEngine.step).
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = auto()   # queued, holds no KV blocks (new or preempted)
    RUNNING = auto()   # holds KV blocks; prefilling or decoding
    FINISHED = auto()


class Sequence:
    """Token ids (prompt + generated) and the KV bookkeeping the scheduler needs.

    num_cached_tokens counts the leading tokens whose K/V is in the cache (prefix-cache
    hits plus everything computed so far); num_scheduled_tokens is how many of the
    following tokens the current step computes. A sequence with exactly one token left
    to compute is decoding; with more, it is (chunk-)prefilling. The last
    num_pending_tokens entries of token_ids are PENDING_TOKEN placeholders for tokens
    sampled by launched steps whose results have not been read yet. Under speculative
    decoding the num_draft_tokens before them are drafted tokens (engine/speculative.py):
    scheduled and computed like known ones, then kept or dropped once the step that
    verifies them is read (accept_drafts).
    """

    def __init__(self, seq_id: int, token_ids: list[int], params: SamplingParams, block_size: int,
                 index: int = 0, sampling_key: int = 0, bad_words: list[list[int]] | None = None,
                 wants_prompt_logprobs: bool = False, priority: int = 0):
        self.seq_id = seq_id
        self.priority = priority  # its request's (scheduling_policy "priority": lower runs first)
        self.index = index  # which of the request's n completions this is
        self.sampling_key = sampling_key  # every random draw of this sequence is keyed by it (from the seed, if any)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_pending_tokens = 0
        self.num_draft_tokens = 0
        self.num_preemptions = 0  # times its blocks were freed to be recomputed
        self.num_prefix_hit_tokens = 0  # prompt tokens its first allocation found in the prefix cache
        # The prefix cache's chained hashes of its leading full blocks of known tokens, computed
        # once each by the BlockManager (a known token never changes), however often it looks.
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # What it has output so far (text, logprobs, stream cursors): the OutputProcessor's
        # SequenceOutput (engine/output_processor.py), which this layer does not import.
        self.output: Any = None
        # Its structured-output grammar's matcher (xgrammar's GrammarMatcher), if it has one:
        # the engine advances it on every token, the sampler masks what it does not allow.
        self.grammar: Any = None
        # Its bad_words as token ids (RequestChecker.bad_words_token_ids), if it has any:
        # the sampler bans a word's last token where the ones before it were just generated;
        # with a word of several tokens, a step samples it only once the last token is read.
        self.bad_words = bad_words
        self.long_bad_words = bool(bad_words) and max(map(len, bad_words)) > 1
        # Whether its prefill steps compute its prompt tokens' logprobs (params.prompt_logprobs,
        # the first of a request's n sequences), until the OutputProcessor has them all.
        self.wants_prompt_logprobs = wants_prompt_logprobs

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def completion_tokens(self, start: int, end: int) -> list[int]:
        """Completion tokens start..end-1, without copying the whole completion first."""
        return self.token_ids[self.num_prompt_tokens + start : self.num_prompt_tokens + end]

    @property
    def num_known_completion_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Leading tokens whose ids are known on the host (all but the drafted and pending ones)."""
        return len(self.token_ids) - self.num_pending_tokens - self.num_draft_tokens

    @property
    def scheduled_token_ids(self) -> list[int]:
        """The tokens the current step computes (after the cached ones)."""
        return self.token_ids[self.num_cached_tokens : self.num_cached_tokens + self.num_scheduled_tokens]

    @property
    def prompt_logprob_rows(self) -> tuple[int, list[int]] | None:
        """For a step whose first scheduled tokens' logits give prompt logprobs: (how many
        alternatives, the prompt tokens those logits predict, one a scheduled token); else None."""
        if not self.wants_prompt_logprobs:
            return None
        start = self.num_cached_tokens
        end = min(start + self.num_scheduled_tokens, self.num_prompt_tokens - 1)
        return (self.params.prompt_logprobs, self.token_ids[start + 1 : end + 1]) if end > start else None

    @property
    def prompt_computed(self) -> bool:
        """Whether its prompt's K/V are all computed (cached)."""
        return self.num_cached_tokens >= self.num_prompt_tokens

    @property
    def step_samples(self) -> bool:
        """Whether the scheduled step samples its next token: the step computes every token
        it has (a prefill chunk that leaves tokens to compute samples nothing). Between
        the schedule and Scheduler.on_launch, which moves the scheduled tokens to cached."""
        return self.num_cached_tokens + self.num_scheduled_tokens == len(self.token_ids)

    @property
    def needs_known_tokens(self) -> bool:
        """Whether sampling it needs the step before's token ids on the host (a grammar, a
        bad word of several tokens: the logits processors that set reads_last_token), so
        the engine forwards its steps first and samples once the step before is read."""
        return self.grammar is not None or self.long_bad_words

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token's K/V."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i."""
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_pending_token(self) -> None:
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token_id: int) -> None:
        """The oldest pending token's id has arrived."""
        self.token_ids[self.num_known_tokens] = token_id
        self.num_pending_tokens -= 1

    def drop_pending_tokens(self) -> None:
        """Forget tokens sampled after the sequence finished (and drafts not yet verified)."""
        del self.token_ids[self.num_known_tokens:]
        self.num_pending_tokens = self.num_draft_tokens = 0

    def add_drafts(self, drafts: list[int]) -> None:
        """Drafted next tokens, computed with its last token by the next step (which must
        schedule 1 + len(drafts) tokens) and verified when that step is read. Only with
        every token known (the engine reads a step back before it schedules drafts)."""
        assert not self.num_pending_tokens and not self.num_draft_tokens
        self.token_ids += drafts
        self.num_draft_tokens = len(drafts)

    def drop_drafts(self) -> None:
        """Take back drafts not yet launched (the step has no room for them)."""
        del self.token_ids[len(self.token_ids) - self.num_draft_tokens:]
        self.num_draft_tokens = 0

    @property
    def drafts(self) -> list[int]:
        start = self.num_known_tokens
        return self.token_ids[start : start + self.num_draft_tokens]

    def accept_drafts(self, num_accepted: int) -> None:
        """The verifying step is read: its first num_accepted drafts stand (their K/V is
        computed), the others and the pending token go; the tokens it output (those drafts
        and one more) are then appended with append_token, one at a time. (Where one of them
        ends the sequence, the rest are not appended, and num_cached_tokens may count past
        its tokens: it is finished, and its blocks freed.)"""
        known = self.num_known_tokens
        del self.token_ids[known:]
        self.num_cached_tokens = known + num_accepted
        self.num_pending_tokens = self.num_draft_tokens = 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
