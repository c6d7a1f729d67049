"""InputBuilder: scheduled sequences -> the model's input tensors and attention metadata."""
from __future__ import annotations

import torch

from nanovllm.executor.inputs import InputBuilder
from nanovllm.executor.step import SharedTokens, StepSeq
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import PENDING_TOKEN, Sequence

BLOCK = 4


def builder() -> InputBuilder:
    return InputBuilder(max_tokens=64, max_seqs=8, max_blocks_per_seq=8, block_size=BLOCK, device=torch.device("cpu"))


def scheduled(token_ids: list[int], block_table: list[int], num_cached: int, num_scheduled: int) -> Sequence:
    seq = Sequence(0, token_ids, SamplingParams(), BLOCK)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = block_table, num_cached, num_scheduled
    return seq


def test_prefill_packs_new_tokens_after_a_cached_prefix():
    """The worked example: A has 4 cached tokens and 2 new ones, B 3 new ones."""
    a = scheduled([10, 11, 12, 13, 14, 15], block_table=[7, 3], num_cached=4, num_scheduled=2)
    b = scheduled([20, 21, 22], block_table=[5], num_cached=0, num_scheduled=3)
    inputs = builder().prefill([a, b])
    ctx = inputs.context
    assert ctx.is_prefill
    assert inputs.input_ids.tolist() == [14, 15, 20, 21, 22]
    assert inputs.positions.tolist() == [4, 5, 0, 1, 2]
    assert ctx.cu_seqlens_q.tolist() == [0, 2, 5] and ctx.cu_seqlens_k.tolist() == [0, 6, 9]
    assert ctx.max_seqlen_q == 3
    # A's tokens 4 and 5 sit at offsets 0 and 1 of its second block (3); B's in block 5.
    assert ctx.slot_mapping.tolist() == [3 * BLOCK, 3 * BLOCK + 1, 5 * BLOCK, 5 * BLOCK + 1, 5 * BLOCK + 2]
    assert ctx.block_tables.tolist() == [[7, 3], [5, -1]]


def test_a_chunk_in_the_middle_of_a_prompt():
    seq = scheduled(list(range(100, 110)), block_table=[2, 9, 4], num_cached=4, num_scheduled=3)
    inputs = builder().prefill([seq])
    assert inputs.input_ids.tolist() == [104, 105, 106]
    assert inputs.positions.tolist() == [4, 5, 6]
    assert inputs.context.cu_seqlens_k.tolist() == [0, 7]
    assert inputs.context.slot_mapping.tolist() == [9 * BLOCK, 9 * BLOCK + 1, 9 * BLOCK + 2]


def test_the_profiling_prefill_holds_no_blocks():
    seq = scheduled([0] * 6, block_table=[], num_cached=0, num_scheduled=6)
    inputs = builder().prefill([seq])
    assert inputs.context.slot_mapping.tolist() == [-1] * 6 and inputs.context.block_tables is None


def test_decode_pads_block_tables_and_takes_pending_tokens_from_the_previous_step():
    short = scheduled([1, 2, 3], block_table=[6], num_cached=2, num_scheduled=1)
    long = scheduled([4, 5, 6, 7, 8, 9], block_table=[1, 8], num_cached=5, num_scheduled=1)
    long.token_ids[-1] = PENDING_TOKEN  # sampled by the step still in flight, row 1 of its output
    prev = SharedTokens(torch.tensor([41, 42, 43]))
    records = [StepSeq(*StepSeq.pack(short)), StepSeq(*StepSeq.pack(long, prev_row=1))]
    inputs = builder().decode(records, prev)
    ctx = inputs.context
    assert not ctx.is_prefill
    assert inputs.input_ids.tolist() == [3, 42]
    assert inputs.positions.tolist() == [2, 5]
    assert ctx.context_lens.tolist() == [3, 6]
    assert ctx.slot_mapping.tolist() == [6 * BLOCK + 2, 8 * BLOCK + 1]
    assert ctx.block_tables.tolist() == [[6, -1], [1, 8]]


def test_consecutive_steps_build_in_alternate_buffers():
    """On CPU the inputs are the host buffers themselves: building the next step must not
    overwrite the one before, which may still be running."""
    build = builder()
    first = build.prefill([scheduled([1, 2, 3], [0], 0, 3)])
    second = build.prefill([scheduled([7, 8, 9], [1], 0, 3)])
    third = build.prefill([scheduled([4, 5, 6], [2], 0, 3)])
    assert first.input_ids.tolist() == [4, 5, 6]  # the third step reuses the first one's set
    assert second.input_ids.tolist() == [7, 8, 9] and third.input_ids.tolist() == [4, 5, 6]
    assert first.input_ids.data_ptr() != second.input_ids.data_ptr()


def test_drafts_take_logit_rows_of_their_own():
    """A step verifying drafts (speculative decoding) computes logits at a sequence's last
    token and each draft; steps without drafts leave the LM head its last tokens."""
    a = scheduled([10, 11, 12], block_table=[1, 5], num_cached=2, num_scheduled=1)
    a.add_drafts([13, 14])
    a.num_scheduled_tokens = 3
    b = scheduled([20, 21, 22, 23, 24], block_table=[2, 3], num_cached=0, num_scheduled=5)  # a prompt
    c = scheduled([30, 31], block_table=[4], num_cached=1, num_scheduled=1)
    c.add_drafts([32])
    c.num_scheduled_tokens = 2
    drafting = InputBuilder(64, 8, 8, BLOCK, torch.device("cpu"))
    inputs = drafting.prefill([StepSeq(*StepSeq.pack(s)) for s in (a, b, c)])
    assert inputs.input_ids.tolist() == [12, 13, 14, 20, 21, 22, 23, 24, 31, 32]
    assert inputs.context.logit_rows.tolist() == [0, 1, 2, 7, 8, 9]
    assert drafting.prefill([b]).context.logit_rows is None
    assert builder().prefill([b]).context.logit_rows is None
