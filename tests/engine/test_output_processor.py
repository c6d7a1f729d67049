"""OutputProcessor: sampled tokens -> finish decisions, text, stream deltas and request
outputs, fed token by token as the engine feeds it (no model)."""
from __future__ import annotations

import pytest

from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.request import Request
from nanovllm.sampling.sampler import StepLogprobs
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence, SequenceStatus
from nanovllm.testing.checkpoints import make_tokenizer

TEXT = "The scheduler decides which requests run"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def processor(tokenizer):
    return OutputProcessor(tokenizer, eos_token_ids={tokenizer.eos_token_id})


def new_seq(processor: OutputProcessor, params: SamplingParams, stream: bool = False, index: int = 0) -> Sequence:
    seq = Sequence(index, PROMPT, params, 16, index=index)
    processor.attach(seq, stream)
    return seq


def feed(processor: OutputProcessor, seq: Sequence, token_id: int, logprobs: StepLogprobs | None = None):
    """One step that sampled token_id for seq; returns its finish, if it finished, and
    ends it as the scheduler would."""
    seq.append_pending_token()
    [finish] = processor.process([seq], [token_id], [True], logprobs) or [None]
    if finish is not None:
        _, seq.finish_reason, seq.stop_reason = finish
        seq.status = SequenceStatus.FINISHED
    return finish


def run(processor: OutputProcessor, seq: Sequence, token_ids: list[int]) -> int:
    """Feed tokens until one finishes seq; returns how many were fed."""
    for i, token_id in enumerate(token_ids):
        if feed(processor, seq, token_id) is not None:
            return i + 1
    return len(token_ids)


def spanning_stop(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string from the last character of one token's text to the first of the next
    one's, first occurring there: (it, index of the token that completes it)."""
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    for k in range(1, len(ids) - 1):
        stop = texts[-1][len(texts[k]) - 1 : len(texts[k]) + 1]
        if len(texts[k + 1]) > len(texts[k]) and texts[-1].find(stop) == len(texts[k]) - 1:
            return stop, k
    raise AssertionError("no spanning stop string")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_ends_it_there(processor, tokenizer, include):
    ids = tokenizer.encode(TEXT)
    stop, last = spanning_stop(tokenizer, ids)
    seq = new_seq(processor, SamplingParams(max_tokens=50, stop=["absent", stop], include_stop_str_in_output=include))
    assert run(processor, seq, ids) == last + 1
    assert (seq.finish_reason, seq.stop_reason) == ("stop", stop)
    cut = TEXT.find(stop) + (len(stop) if include else 0)
    assert processor.completion(seq).text == TEXT[:cut]
    assert processor.completion(seq).token_ids == ids[: last + 1]


def test_end_of_sequence_stop_tokens_and_min_tokens(processor, tokenizer):
    ids = tokenizer.encode(TEXT)
    eos = tokenizer.eos_token_id
    seq = new_seq(processor, SamplingParams(max_tokens=50))
    assert run(processor, seq, ids[:3] + [eos, 9]) == 4
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)
    assert processor.completion(seq).text == tokenizer.decode(ids[:3])  # the end token's text is left out
    stop_id = 99
    seq = new_seq(processor, SamplingParams(max_tokens=50, stop_token_ids=[stop_id], min_tokens=3))
    assert run(processor, seq, [ids[0], ids[1], stop_id, ids[2], stop_id]) == 5  # the first is within min_tokens
    assert (seq.finish_reason, seq.stop_reason) == ("stop", stop_id)
    seq = new_seq(processor, SamplingParams(max_tokens=50, stop_token_ids=[ids[1]]))
    assert run(processor, seq, ids) == 2 and seq.stop_reason == ids[1]
    seq = new_seq(processor, SamplingParams(max_tokens=50, min_tokens=2))
    assert run(processor, seq, [eos, ids[0], eos]) == 3  # the first end token came too early to count
    seq = new_seq(processor, SamplingParams(max_tokens=50, ignore_eos=True))
    assert run(processor, seq, [eos, eos]) == 2 and not seq.is_finished


def test_length_and_a_stop_string_on_the_same_token(processor, tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, last = spanning_stop(tokenizer, ids)
    seq = new_seq(processor, SamplingParams(max_tokens=last + 1, stop=[stop]))
    assert run(processor, seq, ids) == last + 1
    assert (seq.finish_reason, seq.stop_reason) == ("stop", stop)  # the stop string wins, as in vLLM
    seq = new_seq(processor, SamplingParams(max_tokens=3))
    assert run(processor, seq, ids) == 3 and seq.finish_reason == "length"
    assert processor.completion(seq).text == tokenizer.decode(ids[:3])


def test_stream_deltas_hold_back_a_possible_stop_and_add_up(processor, tokenizer):
    ids = tokenizer.encode(TEXT)
    stop, last = spanning_stop(tokenizer, ids)
    seq = new_seq(processor, SamplingParams(max_tokens=50, stop=[stop]), stream=True)
    text, tokens = "", []
    for token_id in ids:
        finished = feed(processor, seq, token_id) is not None
        delta = processor.stream_delta(seq)
        text, tokens = text + delta.text, tokens + delta.token_ids
        assert stop not in text
        # What is out never ends in the stop string's first character while it could still follow.
        assert finished or not text.endswith(stop[0]) or len(stop) == 1
        if finished:
            assert delta.finish_reason == "stop"
            break
    assert text == TEXT[: TEXT.find(stop)] and tokens == ids[: last + 1]


def test_logprobs_are_recorded_per_token(processor, tokenizer):
    seq = new_seq(processor, SamplingParams(max_tokens=2, logprobs=1), stream=True)
    feed(processor, seq, 40, StepLogprobs([-0.5], [2], [[41, 40]], [[-0.25, -0.5]]))
    feed(processor, seq, 42, StepLogprobs([-1.0], [1], [[42, 43]], [[-1.0, -2.0]]))
    out = processor.completion(seq)
    assert [sorted(entry) for entry in out.logprobs] == [[40, 41], [42]]
    assert out.logprobs[0][41].rank == 1 and out.logprobs[0][40].rank == 2
    assert out.cumulative_logprob == -1.5 and out.logprobs[1][42].decoded_token == tokenizer.decode([42])


def test_request_outputs_for_n_completions(processor, tokenizer):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(n=2, max_tokens=3)
    for stream in (True, False):
        seqs = [new_seq(processor, params, stream, index=i) for i in range(2)]
        request = Request("r", None, PROMPT, params, seqs)
        feed(processor, seqs[0], ids[0])
        first = processor.new_outputs(request, stream)
        assert [(o.index, o.token_ids) for o in first] == ([(0, ids[:1])] if stream else [])
        run(processor, seqs[0], ids[1:])
        feed(processor, seqs[1], ids[0])
        second = processor.new_outputs(request, stream)
        if stream:
            assert [(o.index, o.token_ids, o.finish_reason) for o in second] == [(0, ids[1:3], "length"),
                                                                                 (1, ids[:1], None)]
        else:
            assert second == []
        run(processor, seqs[1], ids[1:])
        last = processor.new_outputs(request, stream)
        if stream:  # the first completion's finish was sent once
            assert [(o.index, o.token_ids, o.finish_reason) for o in last] == [(1, ids[1:3], "length")]
        else:
            assert [(o.index, o.text, o.finish_reason) for o in last] == [(i, tokenizer.decode(ids[:3]), "length")
                                                                          for i in range(2)]
        if stream:
            assert processor.new_outputs(request, stream) == []  # nothing new after the end


def test_an_aborted_stream_ends_with_its_whole_text(processor, tokenizer):
    ids = tokenizer.encode(TEXT)
    seq = new_seq(processor, SamplingParams(max_tokens=50, stop=["zzz"]), stream=True)
    run(processor, seq, ids[:6])
    seq.finish_reason, seq.status = "abort", SequenceStatus.FINISHED
    out = processor.completion(seq)
    assert out.text == tokenizer.decode(ids[:6]) and out.finish_reason == "abort"


def test_next_pieces_of_a_stream_by_who_decodes_it(processor, tokenizer):
    """A stream decoded here gets its text piece by piece; one whose text the API process
    decodes (attach's engine_decodes=False) gets None for it; detokenize=False gets "". Each hands
    out every token once and its finish once."""
    ids = tokenizer.encode(TEXT)[:4]
    for decode, detokenize, text in ((True, True, tokenizer.decode(ids)), (False, True, None),
                                     (True, False, "")):
        seq = Sequence(0, PROMPT, SamplingParams(max_tokens=4, detokenize=detokenize), 16)
        processor.attach(seq, stream=True, engine_decodes=decode)
        pieces = []
        for token_id in ids:
            feed(processor, seq, token_id)
            pieces.append(processor.next_piece(seq))
        assert processor.next_piece(seq) is None  # its finish went out with the last piece
        assert [(start, end) for _, start, end in pieces] == [(0, 1), (1, 2), (2, 3), (3, 4)]
        texts = [piece_text for piece_text, _, _ in pieces]
        assert (None if text is None else "".join(texts)) == text and (text is not None or texts == [None] * 4)


def test_a_request_not_made_to_stream_has_no_pieces(processor):
    seq = new_seq(processor, SamplingParams(max_tokens=4))
    feed(processor, seq, 40)
    with pytest.raises(ValueError, match="needs a request made with stream=True"):
        processor.next_piece(seq)
