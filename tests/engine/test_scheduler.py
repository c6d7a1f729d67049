"""Scheduler: budgets, chunked prefill, preemption and request rejection, driven
without a model (each step "samples" a fixed token; the output processor records it and
decides what finishes, as in the engine)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.config import Config
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine import scheduler as scheduler_module
from nanovllm.engine.scheduler import Scheduler
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence, SequenceStatus

TOKEN = 7
# Token 0 is end-of-sequence; no test here needs text, so there is no tokenizer.
PROCESSOR = OutputProcessor(tokenizer=None, eos_token_ids={0})


def make_scheduler(ckpt, num_blocks: int, **kwargs) -> Scheduler:
    args = dict(kvcache_block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128)
    args.update(kwargs)
    return Scheduler(Config(str(ckpt), **args), num_blocks)


def make_seq(seq_id: int, token_ids: list[int], params: SamplingParams, priority: int = 0) -> Sequence:
    seq = Sequence(seq_id, token_ids, params, 4, priority=priority)
    PROCESSOR.attach(seq, stream=False)
    return seq


def postprocess(scheduler: Scheduler, batch: list[Sequence], tokens: list[int], samples: list[bool]) -> list[Sequence]:
    """What the engine does with a step's tokens; returns the sequences that finished."""
    finished = PROCESSOR.process(batch, tokens, samples, None)
    scheduler.update(batch, finished)
    return [seq for seq, _, _ in finished]


def run_to_completion(scheduler: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> int:
    for seq in seqs:
        scheduler.add(seq)
    steps, decodes, schedule_decodes = 0, [], scheduler._schedule_decodes

    def recorded(budget: int):  # each step's decode rows, as chosen (before any reordering)
        result = schedule_decodes(budget)
        decodes.append(list(result[0]))
        return result

    scheduler._schedule_decodes = recorded
    while not scheduler.is_finished():
        batch, is_prefill = scheduler.schedule()
        assert batch, "the scheduler stalled with work left"
        assert len(batch) <= scheduler.max_num_seqs
        assert sum(s.num_scheduled_tokens for s in batch) <= scheduler.max_num_batched_tokens
        for s in batch:
            # The scheduled tokens' slots exist, and nothing beyond the sequence is scheduled.
            assert s.num_cached_tokens + s.num_scheduled_tokens <= len(s) <= len(s.block_table) * scheduler.block_size
            if not is_prefill:
                assert s.num_scheduled_tokens == 1 and s.num_uncomputed_tokens == 1
        if scheduler_module.DECODE_LONGEST_FIRST:  # the decode rows, a mixed step's first ones, by length
            rows = batch[:len(decodes[-1])]
            assert sorted(map(id, rows)) == sorted(map(id, decodes[-1]))
            assert [len(s) for s in rows] == sorted(map(len, rows), reverse=True)
        samples = scheduler.on_launch(batch)
        postprocess(scheduler, batch, [TOKEN] * len(batch), samples)
        steps += 1
        assert steps < max_steps
    return steps


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=12),
    num_blocks=st.integers(17, 40),  # the longest request (8 + 40 + 20 tokens) needs 17 blocks of 4
    budget=st.integers(4, 48),
)
@pytest.mark.parametrize(("longest_first", "policy"), [(False, "fcfs"), (True, "fcfs"), (True, "priority")])
def test_random_request_mixes_finish_without_leaks(qwen3_ckpt, requests, num_blocks, budget, longest_first, policy):
    """Longest first: DECODE_LONGEST_FIRST (the default), each decode step's rows by length;
    without it, admission order (NANOVLLM_DECODE_LONGEST_FIRST=0). By priority, each
    request's is its prefix's (0-2)."""
    scheduler = make_scheduler(qwen3_ckpt, num_blocks, max_num_batched_tokens=budget, scheduling_policy=policy)
    seqs = [
        make_seq(i, [prefix + 1] * 8 + list(range(10, 10 + length)),
                 SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=prefix)
        for i, (prefix, length, max_tokens) in enumerate(requests)
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler_module, "DECODE_LONGEST_FIRST", longest_first)
        run_to_completion(scheduler, seqs)
    for seq, (_, _, max_tokens) in zip(seqs, requests):
        assert seq.completion_token_ids == [TOKEN] * max_tokens
        assert seq.finish_reason == "length"
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(b.ref_count == 0 for b in manager.blocks)


def test_long_prompt_is_prefilled_in_chunks(qwen3_ckpt):
    scheduler = make_scheduler(qwen3_ckpt, 64, max_num_batched_tokens=8)
    seq = make_seq(0, list(range(1, 21)), SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add(seq)
    chunks = []
    while seq.num_completion_tokens == 0:
        batch, is_prefill = scheduler.schedule()
        assert is_prefill
        chunks.append(seq.num_scheduled_tokens)
        samples = scheduler.on_launch(batch)
        postprocess(scheduler, batch, [TOKEN], samples)
    assert chunks == [8, 8, 4]


def test_preemption_recomputes_and_finishes(qwen3_ckpt):
    # 6 blocks of 4 tokens; two sequences that each grow to 14 tokens (4 blocks) cannot both fit.
    scheduler = make_scheduler(qwen3_ckpt, 6)
    seqs = [make_seq(i, [i + 1] * 4, SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(2)]
    run_to_completion(scheduler, seqs)
    assert scheduler.num_preemptions > 0
    assert all(s.num_completion_tokens == 10 for s in seqs)
    # The prefix-cache statistics count prompts, not a recompute finding its own blocks.
    manager = scheduler.block_manager
    assert (manager.num_prompt_tokens_queried, manager.num_prompt_tokens_hit) == (8, 0)


def test_eos_finishes_with_stop(qwen3_ckpt):
    scheduler = make_scheduler(qwen3_ckpt, 16)
    seq = make_seq(0, [1, 2, 3], SamplingParams(max_tokens=8))
    scheduler.add(seq)
    batch, _ = scheduler.schedule()
    samples = scheduler.on_launch(batch)
    postprocess(scheduler, batch, [0], samples)
    assert seq.finish_reason == "stop" and seq.completion_token_ids == [0]
    assert scheduler.is_finished()


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "message"),
    [(0, 4, "empty"), (70, 60, "max_model_len"), (60, 60, "KV blocks"), (80, 1, "no room")],
)
def test_requests_that_can_never_run_are_rejected(qwen3_ckpt, prompt_len, max_tokens, message):
    scheduler = make_scheduler(qwen3_ckpt, 20)  # 80 tokens of KV, max_model_len 128
    seq = make_seq(0, [1] * prompt_len, SamplingParams(max_tokens=max_tokens))
    with pytest.raises(ValueError, match=message):
        scheduler.add(seq)
    assert scheduler.is_finished()


@pytest.mark.parametrize("max_model_len,num_blocks", [(128, 20), (64, 20)], ids=["cache_binds", "max_model_len_binds"])
def test_most_tokens_is_what_the_check_lets_through(max_model_len, num_blocks):
    """RequestChecker.most_tokens (what `nanovllm chat` fits its replies into): a request of
    that many tokens passes, one more is refused."""
    from nanovllm.engine.request import RequestChecker

    checker = RequestChecker(None, 100, max_model_len, 4, num_blocks, max_logprobs=5)
    assert checker.most_tokens == min(max_model_len, 4 * num_blocks)
    checker.check([1] * 10, SamplingParams(max_tokens=checker.most_tokens - 10))
    with pytest.raises(ValueError):
        checker.check([1] * 10, SamplingParams(max_tokens=checker.most_tokens - 9))


def test_ids_outside_the_vocabulary_are_named():
    """A prompt's and the params' token ids outside [0, vocab_size) are refused with the
    field and the first few of them."""
    from nanovllm.engine.request import RequestChecker, vocabulary_error

    checker = RequestChecker(None, 100, 64, 4, 20, max_logprobs=5)
    with pytest.raises(ValueError, match=r"token ids \[100, -1\] are outside the vocabulary \[0, 100\)"):
        checker.check([1, 100, -1], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"stop_token_ids \[100\] are outside the vocabulary"):
        checker.check([1], SamplingParams(max_tokens=4, stop_token_ids=[5, 100]))
    assert vocabulary_error([-3, 0, 99, 100], 100, "ids") == "ids [-3, 100] are outside the vocabulary [0, 100)"
    assert vocabulary_error(range(100), 100) is None


def test_max_num_seqs_caps_the_batch(qwen3_ckpt):
    scheduler = make_scheduler(qwen3_ckpt, 64, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        scheduler.add(make_seq(i, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and len(batch) == 2 and len(scheduler.waiting) == 3


def test_pipelined_steps_resolve_in_order_and_drop_tokens_after_eos(qwen3_ckpt):
    """The engine launches step N+1 before it reads step N's tokens."""
    scheduler = make_scheduler(qwen3_ckpt, 16)
    a = make_seq(0, [1, 2, 3], SamplingParams(max_tokens=8))
    b = make_seq(1, [4, 5], SamplingParams(max_tokens=8))
    scheduler.add(a)
    scheduler.add(b)
    batch1, is_prefill = scheduler.schedule()
    samples1 = scheduler.on_launch(batch1)
    assert is_prefill and a.num_pending_tokens == b.num_pending_tokens == 1
    batch2, is_prefill = scheduler.schedule()  # decode with both last tokens still pending
    assert not is_prefill and batch2 == [a, b]
    samples2 = scheduler.on_launch(batch2)
    assert postprocess(scheduler, batch1, [0, 9], samples1) == [a]  # a hit end-of-sequence
    assert a.completion_token_ids == [0] and a.finish_reason == "stop"
    assert b.token_ids == [4, 5, 9, -1]
    assert postprocess(scheduler, batch2, [7, 8], samples2) == []
    assert b.completion_token_ids == [9, 8] and b.num_pending_tokens == 0
    assert scheduler.block_manager.num_used_blocks == len(b.block_table)


def test_abort_mid_flight_frees_blocks_and_ignores_the_late_token(qwen3_ckpt):
    scheduler = make_scheduler(qwen3_ckpt, 16)
    seq = make_seq(0, [1, 2, 3], SamplingParams(max_tokens=8))
    scheduler.add(seq)
    batch, _ = scheduler.schedule()
    samples = scheduler.on_launch(batch)
    scheduler.abort(seq)  # while the step that samples its first token is in flight
    assert postprocess(scheduler, batch, [9], samples) == []
    assert seq.token_ids == [1, 2, 3] and seq.finish_reason == "abort"
    assert scheduler.is_finished() and scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(("num_blocks", "running", "waiting"), [(4, [0, 1], [2]), (3, [0], [1, 2])])
def test_decodes_short_of_blocks_preempt_the_newest(qwen3_ckpt, num_blocks, running, waiting):
    """Three one-block prompts, then a decode step where each needs a second block: the
    newest running sequences give theirs up, in admission order kept, until the older ones
    fit; with none left after it, a sequence preempts itself. Preempted ones wait first in
    line, oldest first."""
    scheduler = make_scheduler(qwen3_ckpt, num_blocks)
    seqs = [make_seq(i, [i + 1] * 4, SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch, _ = scheduler.schedule()
    postprocess(scheduler, batch, [TOKEN] * len(batch), scheduler.on_launch(batch))
    batch, is_prefill = scheduler.schedule()
    assert not is_prefill and batch == [seqs[i] for i in running]
    assert list(scheduler.running) == [seqs[i] for i in running]
    assert list(scheduler.waiting) == [seqs[i] for i in waiting]
    assert scheduler.num_preemptions == len(waiting)


def test_an_interrupt_while_scheduling_decodes_loses_no_sequence(qwen3_ckpt):
    """Ctrl-C in the middle of choosing a step's decode rows (here at the second row's new
    slot) leaves every sequence in `running`, its blocks its own: aborting them all then
    frees every block."""
    scheduler = make_scheduler(qwen3_ckpt, 32)
    seqs = [make_seq(i, [i + 1] * 4, SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch, _ = scheduler.schedule()  # the three prompts
    postprocess(scheduler, batch, [TOKEN] * len(batch), scheduler.on_launch(batch))
    manager, calls = scheduler.block_manager, []
    append_slot = manager.append_slot

    def interrupted(seq: Sequence) -> None:
        calls.append(seq)
        if len(calls) == 2:
            raise KeyboardInterrupt
        append_slot(seq)

    manager.append_slot = interrupted
    with pytest.raises(KeyboardInterrupt):
        scheduler.schedule()
    assert list(scheduler.running) == seqs
    for seq in seqs:
        scheduler.abort(seq)
    assert scheduler.is_finished() and manager.num_free_blocks == manager.num_blocks


def test_a_later_request_goes_before_the_other_completions_of_a_large_n(qwen3_ckpt):
    """Fair admission: the other n - 1 completions of a request queue behind requests
    that have not started, so a later request is not held up by all of them."""
    scheduler = make_scheduler(qwen3_ckpt, 64, max_num_seqs=2)
    params = SamplingParams(n=4, max_tokens=2, ignore_eos=True)
    big = [make_seq(i, [1, 2, 3], params) for i in range(4)]
    scheduler.add(big[0], big[1:])
    late = make_seq(9, [4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    order = []  # sequences in the order they start
    while not scheduler.is_finished():
        batch, _ = scheduler.schedule()
        order += [seq.seq_id for seq in batch if seq.seq_id not in order]
        postprocess(scheduler, batch, [TOKEN] * len(batch), scheduler.on_launch(batch))
        if late.status is SequenceStatus.WAITING and late not in scheduler.waiting:
            scheduler.add(late)  # arrives once the big request is running
    assert order == [0, 9, 1, 2, 3]  # first come, except that 1-3 wait for requests not yet started


def test_decoding_sequences_advance_in_the_steps_that_prefill_a_long_prompt(qwen3_ckpt):
    """A prompt longer than the budget is prefilled in chunks, and each of those steps
    also carries one token for every sequence already decoding (as vLLM's scheduler)."""
    scheduler = make_scheduler(qwen3_ckpt, 64, max_num_batched_tokens=10)
    short = [make_seq(i, [i + 1] * 3, SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(2)]
    for seq in short:
        scheduler.add(seq)
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and batch == short
    postprocess(scheduler, batch, [TOKEN] * 2, scheduler.on_launch(batch))
    long = make_seq(9, list(range(10, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add(long)
    steps = []
    while long.num_completion_tokens == 0:
        batch, is_prefill = scheduler.schedule()
        steps.append((is_prefill, [(seq.seq_id, seq.num_scheduled_tokens) for seq in batch]))
        postprocess(scheduler, batch, [TOKEN] * len(batch), scheduler.on_launch(batch))
    # 30 prompt tokens at 10 - 2 per step: four chunks, the two decodes in every step.
    assert steps == [(True, [(0, 1), (1, 1), (9, 8)])] * 3 + [(True, [(0, 1), (1, 1), (9, 6)])]
    assert all(seq.num_completion_tokens == 5 for seq in short)
    batch, is_prefill = scheduler.schedule()
    # decode tokens alone: a decode step (its rows longest first, the property test's check)
    assert not is_prefill and sorted(seq.seq_id for seq in batch) == [0, 1, 9]


def test_by_priority_the_lowest_value_starts_first_then_the_earliest(qwen3_ckpt):
    scheduler = make_scheduler(qwen3_ckpt, 64, max_num_seqs=1, scheduling_policy="priority")
    for seq_id, priority in enumerate([2, 0, 1, 0]):
        scheduler.add(make_seq(seq_id, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), priority))
    order = []
    while not scheduler.is_finished():
        batch, _ = scheduler.schedule()
        order += [seq.seq_id for seq in batch if seq.seq_id not in order]
        postprocess(scheduler, batch, [TOKEN] * len(batch), scheduler.on_launch(batch))
    assert order == [1, 3, 2, 0]


@pytest.mark.parametrize(("priorities", "running", "waiting"), [
    ([0, 2, 1], [0, 2], [1]),  # the victim in the middle of the batch, after the one short of a block
    ([2, 0, 1], [1, 2], [0]),  # the victim first: its slot of this step (taken already) goes back
    ([1, 1, 1], [0, 1], [2]),  # one priority: the newest, as first come, first served
])
def test_by_priority_preemption_frees_the_lowest_priority(qwen3_ckpt, priorities, running, waiting):
    """Three one-block prompts in four blocks, then a decode step where each needs a second
    block: the running sequence of the highest priority value (the latest of them) gives
    its blocks up, wherever it stands in the batch."""
    scheduler = make_scheduler(qwen3_ckpt, 4, scheduling_policy="priority")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seqs = [make_seq(i, [i + 1] * 4, params, priority) for i, priority in enumerate(priorities)]
    for seq in seqs:
        scheduler.add(seq)
    batch, _ = scheduler.schedule()
    postprocess(scheduler, batch, [TOKEN] * len(batch), scheduler.on_launch(batch))
    batch, is_prefill = scheduler.schedule()
    assert not is_prefill and sorted(s.seq_id for s in batch) == running
    assert all(s.num_scheduled_tokens == 1 for s in batch) and seqs[waiting[0]].num_scheduled_tokens == 0
    assert sorted(s.seq_id for s in scheduler.running) == running
    assert [s.seq_id for s in scheduler.waiting] == waiting and scheduler.num_preemptions == 1
    manager = scheduler.block_manager
    assert manager.num_used_blocks == sum(len(s.block_table) for s in batch) == 4


def test_by_priority_the_other_completions_of_an_urgent_request_go_first(qwen3_ckpt):
    """The followers of an n > 1 request go before waiting requests of a higher value (and
    after those of a lower one), where first come, first served puts them last."""
    scheduler = make_scheduler(qwen3_ckpt, 64, max_num_seqs=1, scheduling_policy="priority")
    urgent = [make_seq(i, [1, 2, 3], SamplingParams(n=3, max_tokens=2, ignore_eos=True), 0) for i in range(3)]
    scheduler.add(urgent[0], urgent[1:])
    scheduler.add(make_seq(5, [4, 5], SamplingParams(max_tokens=2, ignore_eos=True), 1))
    order = []
    while not scheduler.is_finished():
        batch, _ = scheduler.schedule()
        order += [seq.seq_id for seq in batch if seq.seq_id not in order]
        postprocess(scheduler, batch, [TOKEN] * len(batch), scheduler.on_launch(batch))
        if len(order) == 1 and 9 not in order and not any(s.seq_id == 9 for s in scheduler.waiting):
            scheduler.add(make_seq(9, [6, 7], SamplingParams(max_tokens=2, ignore_eos=True), -1))
    assert order == [0, 9, 1, 2, 5]
