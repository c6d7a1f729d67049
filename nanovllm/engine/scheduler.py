"""Scheduler: continuous batching over a waiting and a running queue.

Each step spends a budget of max_num_batched_tokens tokens, as vLLM's scheduler does:
first every running sequence that is decoding gets its one token, then sequences
part-way through a chunked prefill get their next chunk, then waiting sequences are
admitted while the sequence cap (max_num_seqs) and the free KV blocks allow; a prompt
longer than what is left of the budget is computed in chunks over several steps. So a
long prompt never stalls the streams already decoding: they advance in the same step.
A step of decode tokens alone is a decode step (CUDA graphs run those); any other is a
prefill step, computed by the paged prefill path, which serves a decoding sequence as a
one-token chunk (one that verifies drafts and computes no prompt the decode graphs run
too, a row per token: executor/model_runner.py). When a decoding sequence finds no free
block, the newest running sequences (by priority: see below) are preempted (their blocks
freed, to be recomputed later, usually from the prefix cache), and no one new is
admitted that step.

Fairness: the other completions of an n > 1 request queue apart (`followers`), admitted
only when no request that has not started yet is waiting. A request with a large n thus
fills only the slots nobody else asks for, and a request that arrives after it waits at
most until one of its sequences finishes, never for all of them.

scheduling_policy "priority" (vLLM's): the queues are kept in order of each request's
priority (lower first), then arrival; a follower goes before a waiting request of a lower
priority; and preemption frees the running sequence of the lowest priority that arrived
last, wherever it is in the batch, not simply the newest.
"""
from __future__ import annotations

from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.request import check_fits
from nanovllm.engine.speculative import make_proposer
from nanovllm.sequence import Sequence, SequenceStatus
from nanovllm.utils.env import env_flag

# Decode attention runs a program per row and KV head, dispatched in the batch's row order,
# and a large batch's programs are whole rows (one split each over an FP8 cache). Rows
# longest first put the long programs early and end the launch on short ones, the
# longest-processing-time-first rule, where a batch in admission order can end on a long
# row that runs while the other SMs idle (faster alone and in the engine over an FP8 cache,
# neutral over bf16: RESULTS.md, sessions 46 and 51). NANOVLLM_DECODE_LONGEST_FIRST=0 keeps
# admission order (A/B runs).
DECODE_LONGEST_FIRST = env_flag("NANOVLLM_DECODE_LONGEST_FIRST", True)


class Scheduler:
    def __init__(self, config: Config, num_kvcache_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.kvcache_block_size
        self.block_manager = BlockManager(num_kvcache_blocks, self.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()  # first sequences of requests, and preempted ones
        self.followers: deque[Sequence] = deque()  # the other completions of n > 1 requests
        self.running: deque[Sequence] = deque()
        self.held: dict[int, list[Sequence]] = {}  # seq_id -> followers waiting for its prompt
        self.num_preemptions = 0
        self.by_priority = config.scheduling_policy == "priority"
        # Speculative decoding: decoding sequences draft tokens for the step to verify.
        self.proposer = make_proposer(config)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.followers) + sum(map(len, self.held.values()))

    def is_finished(self) -> bool:
        return not self.waiting and not self.followers and not self.running and not self.held

    def add(self, seq: Sequence, followers: list[Sequence] = ()) -> None:
        """Queue seq. followers (the other completions of an n > 1 request, same prompt)
        wait until seq's prompt is computed, then hit its blocks in the prefix cache, so
        the prompt is computed once."""
        check_fits(seq.num_prompt_tokens, seq.params.max_tokens, self.max_model_len, self.block_size,
                   self.block_manager.num_blocks)
        self._queue(self.waiting, seq)
        if followers:
            if self.block_manager.enable_prefix_caching:
                self.held[seq.seq_id] = list(followers)
            else:
                self._queue(self.followers, *followers)

    def _release_followers(self, seq: Sequence) -> None:
        self._queue(self.followers, *self.held.pop(seq.seq_id, []))

    def _queue(self, queue: deque[Sequence], *seqs: Sequence) -> None:
        """Append seqs; by priority, each after those of its priority or a lower value that
        arrived before it (seq ids count arrivals), so a preempted one keeps its place."""
        for seq in seqs:
            if not self.by_priority:
                queue.append(seq)
                continue
            at = len(queue)
            while at and _rank(queue[at - 1]) > _rank(seq):
                at -= 1
            queue.insert(at, seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence wherever it is, with the reason the output processor decided (or
        "abort"), and free its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.followers:
            self.followers.remove(seq)
        else:
            for followers in self.held.values():
                if seq in followers:
                    followers.remove(seq)
        self._release_followers(seq)
        seq.drop_pending_tokens()  # a step in flight may still sample for it: ignored
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def abort(self, seq: Sequence) -> None:
        """Drop a request's sequence wherever it is and free its blocks."""
        self.finish(seq, "abort")

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the sequences of the next step and their tokens (num_scheduled_tokens);
        returns (seqs, is_prefill), is_prefill False for decode tokens alone (one each: a
        step with drafts to verify is computed as a prefill step)."""
        budget = self.max_num_batched_tokens
        decoding, budget, preempted = self._schedule_decodes(budget)
        if DECODE_LONGEST_FIRST:  # the step's rows only: running keeps admission order (fcfs preempts the newest)
            decoding.sort(key=len, reverse=True)  # free to reorder: everything downstream is keyed by sequence
        prefilling, budget = self._schedule_chunks(budget)
        if not preempted:
            prefilling += self._admit(budget)
        drafted = self.proposer is not None and any(seq.num_draft_tokens for seq in decoding)
        return decoding + prefilling, bool(prefilling) or drafted

    def _schedule_decodes(self, budget: int) -> tuple[list[Sequence], int, bool]:
        """One token for each running sequence with one token left to compute (its newest
        token, or a chunked prompt's last, which then runs and counts as a decode token),
        preempting the newest running ones (by priority: the last of the lowest priority)
        while blocks run out; then, under speculative decoding, drafts from what budget and
        free blocks are left (never a preemption for them). Returns (seqs, budget left,
        whether any sequence was preempted). `running` changes only where a sequence is
        preempted, so an interrupt (Ctrl-C) mid-loop loses no sequence or block, unless it
        lands inside a preemption's few statements."""
        scheduled: list[Sequence] = []
        preempted = False
        drafts = self.drafts()
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            i += 1
            if seq.num_uncomputed_tokens != 1 or seq.num_completion_tokens >= seq.params.max_tokens:
                continue  # a prefill under way (next), or a last token still pending that will finish it
            while not self.block_manager.can_append_slot(seq):
                preempted = True
                victim = self.running[-1] if not self.by_priority else max(self.running, key=_rank)
                if self.running.index(victim) < i:  # at or before seq: the loop's place moves back one
                    i -= 1
                self.running.remove(victim)
                if victim in scheduled:  # its slot of this step goes with its blocks
                    scheduled.remove(victim)
                    victim.num_scheduled_tokens = 0
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        budget -= len(scheduled)
        if drafts:
            budget = self._add_drafts(scheduled, budget)
        return scheduled, budget, preempted

    def drafts(self) -> bool:
        """Whether the next schedule may give sequences drafts (speculative decoding): then
        every token must be known when it runs (the engine reads the step in flight first)."""
        return self.proposer is not None and self.proposer.drafts_for(self.running)

    def _add_drafts(self, seqs: list[Sequence], budget: int) -> int:
        """Give the decoding sequences drafts to verify (engine/speculative.py), each as many as the
        budget left and a free block for them allow; returns the budget left."""
        for seq in seqs:
            if budget <= 0:
                break
            if not (drafts := self.proposer.propose(seq, budget)):
                continue
            seq.add_drafts(drafts)
            if not self.block_manager.can_append_slot(seq):
                seq.drop_drafts()
                continue
            self.block_manager.append_slot(seq)
            seq.num_scheduled_tokens += len(drafts)
            budget -= len(drafts)
        return budget

    def _schedule_chunks(self, budget: int) -> tuple[list[Sequence], int]:
        """The next chunk of each prefill under way (their blocks are held already)."""
        scheduled: list[Sequence] = []
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1 and not seq.num_draft_tokens:  # (not one decoding with drafts)
                seq.num_scheduled_tokens = min(seq.num_uncomputed_tokens, budget)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        return scheduled, budget

    def _admit(self, budget: int) -> list[Sequence]:
        """Waiting sequences (requests not yet started first; by priority, the first of
        the lower value) while budget, max_num_seqs and the free blocks allow; each gets
        its prompt, or the first chunk of it."""
        scheduled: list[Sequence] = []
        while budget > 0 and len(self.running) < self.max_num_seqs:
            queue = self.waiting or self.followers
            if self.by_priority and self.waiting and self.followers and (
                    self.followers[0].priority < self.waiting[0].priority):
                queue = self.followers
            if not queue or not self.block_manager.can_allocate(queue[0]):
                break
            seq = queue.popleft()
            self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = min(seq.num_uncomputed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def reset_stats(self) -> None:
        """Count preemptions and prefix-cache hits afresh."""
        self.num_preemptions = 0
        self.block_manager.reset_stats()

    def can_schedule_without_results(self) -> bool:
        """Whether the next schedule() is safe while a launched step's tokens are still
        pending: it must not preempt (a preempted sequence is recomputed from its token
        ids, which must all be known). Each decoding sequence needs at most one new block."""
        return self.block_manager.num_free_blocks >= len(self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first in line (by priority, in its place); it is
        recomputed when resumed."""
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        if self.by_priority:
            self._queue(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_launch(self, seqs: list[Sequence]) -> list[bool]:
        """The step computing seqs' scheduled tokens is launched: count them as cached, and
        give each sequence whose tokens are now all computed a pending sampled token.
        Returns, per sequence, whether this step samples a token for it (a prefill chunk
        that leaves tokens to compute does not)."""
        samples = []
        for seq in seqs:
            samples.append(seq.step_samples)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if samples[-1]:
                seq.append_pending_token()
        return samples

    def update(self, seqs: list[Sequence], finished: list[tuple[Sequence, str, int | str | None]]) -> None:
        """After a launched step's tokens are recorded (OutputProcessor.process): register
        the blocks it computed for prefix caching, let n > 1 followers in once their
        prompt is cached, and end the sequences the step finished."""
        for seq in seqs:
            if seq.is_finished:  # aborted while the step ran
                continue
            if self.proposer is not None:  # the blocks its rejected drafts took
                self.block_manager.trim(seq)
            self.block_manager.register_computed_blocks(seq)
            if seq.seq_id in self.held and seq.prompt_computed:
                self._release_followers(seq)
        for seq, reason, stop_reason in finished:
            self.finish(seq, reason, stop_reason)


def _rank(seq: Sequence) -> tuple[int, int]:
    """Order under scheduling_policy "priority": lower priority values first, then arrival."""
    return seq.priority, seq.seq_id
