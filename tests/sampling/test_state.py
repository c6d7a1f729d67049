"""SamplingState: a step's sequences -> the sampler's tensors, and the penalty tables."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nanovllm.sampling.logits_processors import MinTokensProcessor
from nanovllm.sampling.state import FIRST_SLOT, SINK_SLOT, SamplingState
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

VOCAB = 50
EOS = 0


def state() -> SamplingState:
    sampling = SamplingState(VOCAB, max_num_seqs=4, device=torch.device("cpu"))
    sampling.set_eos_token_ids(frozenset({EOS}))
    return sampling


def decoding(seq_id: int, params: SamplingParams, prompt: list[int], completion: list[int] = (), key: int = 0) -> Sequence:
    """A sequence whose next step computes its last token and samples the one after."""
    seq = Sequence(seq_id, prompt + list(completion), params, 16, sampling_key=key)
    seq.num_prompt_tokens = len(prompt)
    seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1
    return seq


def test_temperature_only_batches_build_the_fast_path():
    params = SamplingParams(temperature=0.7)
    seqs = [decoding(0, params, [1, 2, 3], key=11), decoding(1, params, [4, 5], [6, 7], key=12)]
    t = state().prepare(seqs)
    assert t.is_fast and not t.in_graph and t.filters is None and t.penalties is None and t.logits_processors == ()
    assert t.temperatures.tolist() == pytest.approx([0.7, 0.7]) and t.num_logprobs is None
    assert t.keys.tolist() == [11, 12] and t.positions.tolist() == [3, 4]  # where each drawn token goes


def test_a_batch_a_decode_graph_samples_stays_on_the_host():
    """graph_samples: a temperature-only batch keeps its temperatures and keys in the host
    arrays the graph's packed inputs take them from; a batch that needs the full sampler
    still sends them."""
    params = SamplingParams(temperature=0.7)
    seqs = [decoding(0, params, [1, 2, 3], key=11), decoding(1, params, [4, 5], [6, 7], key=12)]
    sampling = state()
    t = sampling.prepare(seqs, graph_samples=True)
    assert t.in_graph and t.temperatures is None and t.keys is None and t.positions is None
    with pytest.raises(ValueError, match="decode graph"):  # late processors would go unseen by the graph
        sampling.prepare_late(t, seqs)
    assert t.host_temperatures.tolist() == pytest.approx([0.7, 0.7]) and t.host_keys.tolist() == [11, 12]
    filtered = [decoding(0, SamplingParams(top_k=3), [1])]
    t = sampling.prepare(filtered, graph_samples=True)
    assert not t.in_graph and t.temperatures.tolist() == [1.0] and t.positions.tolist() == [1]


def test_filters_logprobs_and_per_row_values():
    seqs = [decoding(0, SamplingParams(temperature=0), [1]),
            decoding(1, SamplingParams(top_k=5, top_p=0.9, logprobs=2), [2]),
            decoding(2, SamplingParams(top_k=VOCAB, min_p=0.1, logprobs=4), [3])]
    t = state().prepare(seqs)
    top_k, top_p, min_p = t.filters
    # Greedy keeps one candidate; a top_k as large as the vocabulary is no limit.
    assert top_k.tolist() == [1, 5, 0]
    assert top_p.tolist() == pytest.approx([1.0, 0.9, 1.0]) and min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert (t.max_top_k, t.all_top_k) == (5, False)
    assert t.num_logprobs == 4 and not t.is_fast


def test_min_tokens_bans_stop_and_end_tokens_until_reached():
    short = decoding(0, SamplingParams(min_tokens=3, stop_token_ids=[7, 9]), [1, 2], [5])
    ignoring = decoding(1, SamplingParams(min_tokens=3, stop_token_ids=[8], ignore_eos=True), [1], [5])
    done = decoding(2, SamplingParams(min_tokens=1, stop_token_ids=[7]), [1], [5, 6])
    t = state().prepare([short, ignoring, done])
    [(processor, banned)] = t.logits_processors
    assert isinstance(processor, MinTokensProcessor)
    assert list(zip(*banned.tolist())) == [(0, EOS), (0, 7), (0, 9), (1, 8)]
    logits = processor.apply(torch.zeros(3, VOCAB), banned)
    assert logits[0, [EOS, 7, 9]].eq(float("-inf")).all() and logits[1, 8] == float("-inf")
    assert logits[2].isfinite().all() and logits[1, EOS] == 0
    assert state().prepare([done]).logits_processors == ()


def test_penalty_tables_follow_each_sequence():
    sampling = state()
    penalized = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    a = decoding(0, penalized, [3, 4, 4])
    plain = decoding(1, SamplingParams(), [5])
    b = decoding(2, penalized, [6])
    b.num_scheduled_tokens = 0  # a prefill chunk that leaves tokens to compute: samples nothing
    t = sampling.prepare([a, plain, b])
    tables = sampling.tables
    slots = t.penalties.rows.tolist()
    assert slots == [FIRST_SLOT, 0, FIRST_SLOT + 1]
    assert tables.in_prompt[FIRST_SLOT].nonzero().flatten().tolist() == [3, 4]
    assert t.penalties.repetition.tolist() == [1.5, 1.0, 1.5]
    assert t.penalties.count_slots.tolist() == [FIRST_SLOT, SINK_SLOT, SINK_SLOT]  # the plain row, the chunk: the sink
    sampling.count(torch.tensor([9, 9, 9]), t)
    assert tables.counts[FIRST_SLOT, 9] == 1 and tables.counts[FIRST_SLOT + 1].sum() == 0
    # The next step finds the same slots; a finished sequence's slot goes to a newcomer, cleared.
    assert sampling.prepare([a]).penalties.rows.tolist() == [FIRST_SLOT]
    a.status = type(a.status).FINISHED
    c = decoding(3, penalized, [7])
    t = sampling.prepare([c])
    assert t.penalties.rows.tolist() == [FIRST_SLOT]
    assert tables.counts[FIRST_SLOT].sum() == 0 and tables.in_prompt[FIRST_SLOT].nonzero().flatten().tolist() == [7]
    # A slot does not keep its sequence alive once the engine has let go of it
    gone = weakref.ref(c)
    c.status = type(c.status).FINISHED
    del c, t
    gc.collect()
    assert gone() is None
    assert sampling.prepare([decoding(4, penalized, [8])]).penalties.rows.tolist() == [FIRST_SLOT]


def test_each_step_copies_its_tokens_to_its_own_host_buffers():
    sampling = state()
    first = sampling.prepare([decoding(0, SamplingParams(), [1])])
    second = sampling.prepare([decoding(0, SamplingParams(), [1])])
    first_tokens, first_logprobs = first.outputs.copy(torch.tensor([17]), None)
    second_tokens, _ = second.outputs.copy(torch.tensor([18]), None)
    assert first_tokens.tolist() == [17] and second_tokens.tolist() == [18] and first_logprobs is None
