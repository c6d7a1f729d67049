"""vLLM's token-level request fields on the engine, against transformers' own logits
processors on the same checkpoint: allowed_token_ids, logit_bias (its SequenceBias with
one-token sequences), bad_words (its NoBadWords over the generated tokens),
truncate_prompt_tokens, and max_tokens fitted to the context offline."""
import functools

import pytest
import torch
from transformers.generation.logits_process import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

from nanovllm import SamplingParams
from nanovllm.sampling.logits_processors import BadWordsProcessor, MinTokensProcessor
from nanovllm.sequence import Sequence
from nanovllm.testing.checkpoints import hf_greedy

from tests.parity import looping_prompts, make_llm, mixed_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}

MAX_TOKENS = 12


def greedy(max_tokens: int = MAX_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def hf_constrained(path, prompt: list[int], allowed=None, bias=None, bad_words=None, max_tokens=MAX_TOKENS
                   ) -> list[int]:
    """transformers' greedy tokens for prompt under the same constraints, bad words matched
    against the generated tokens only (as vLLM matches them)."""
    processors = []
    if allowed is not None:
        def only(ids, scores):
            mask = torch.full_like(scores, float("-inf"))
            mask[:, allowed] = 0
            return scores + mask
        processors.append(only)
    if bias is not None:
        sequence_bias = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
        processors.append(sequence_bias)
    if bad_words is not None:
        no_bad = NoBadWordsLogitsProcessor(bad_words, eos_token_id=None)
        processors.append(lambda ids, scores: no_bad(ids[:, len(prompt):], scores))

    def apply(ids, scores):
        for processor in processors:
            scores = processor(ids, scores)
        return scores
    return hf_greedy(path, [prompt], max_tokens, ignore_eos=True, logits_processor=apply)[0]


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    with make_llm(qwen3_ckpt, max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(llm):
    return mixed_prompts(llm.vocab_size, 16, seed=11, count=5)


def test_allowed_token_ids_and_logit_bias_equal_transformers(llm, qwen3_ckpt, prompts):
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    allowed = sorted({t for tokens in free for t in tokens[1::2]} | {5, 6, 7})
    bias = {free[0][0]: -50.0, free[1][2]: 30.0, 9: 5.0}
    # One batch: rows with each constraint, both, and none, so every row's own fields count.
    params = [greedy(allowed_token_ids=allowed), greedy(logit_bias=bias),
              greedy(allowed_token_ids=allowed, logit_bias=bias), greedy(), greedy(logit_bias={free[4][0]: -100.0})]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_constrained(qwen3_ckpt, prompts[0], allowed=allowed),
                hf_constrained(qwen3_ckpt, prompts[1], bias=bias),
                hf_constrained(qwen3_ckpt, prompts[2], allowed=allowed, bias=bias),
                free[3], hf_constrained(qwen3_ckpt, prompts[4], bias={free[4][0]: -100.0})]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert set(outputs[0].outputs[0].token_ids) <= set(allowed) and outputs[0].outputs[0].token_ids != free[0]
    assert outputs[4].outputs[0].token_ids[0] != free[4][0]



def test_token_bias_inputs_are_built_once_per_request():
    """A request's ids and biases go to the device when it first samples and are reused
    while it stays in the batch (rows regathered each step), dropped once it leaves; each
    step's inputs change exactly its own rows' logits."""
    from nanovllm.sampling.logits_processors import TokenBiasProcessor
    from nanovllm.sequence import Sequence

    processor = TokenBiasProcessor(torch.device("cpu"))
    a = SamplingParams(logit_bias={3: 2.0, 7: -1.0})
    b = SamplingParams(allowed_token_ids=[1, 4], logit_bias={4: 0.5})
    seqs = [Sequence(i, [1, 2], p, 16) for i, p in enumerate([a, SamplingParams(), b, a])]
    first = processor.prepare(seqs, [a, seqs[1].params, b])
    cached = dict(processor.tensors)
    assert set(cached) == {id(a), id(b)}
    again = processor.prepare(seqs[1:], [seqs[1].params, b, a])  # rows move: a at row 2, b at row 1
    assert all(processor.tensors[k][i] is cached[k][i] for k in cached for i in range(1, 4))
    logits = torch.zeros(3, 10)
    out = processor.apply(logits.clone(), again)
    expected = torch.zeros(3, 10)
    expected[1] = float("-inf")
    expected[1, 1], expected[1, 4] = 0.0, 0.5
    expected[2, 3], expected[2, 7] = 2.0, -1.0
    assert torch.equal(out, expected)
    assert torch.equal(processor.apply(torch.zeros(4, 10), first)[3], expected[2])
    assert processor.prepare(seqs[1:2], [seqs[1].params]) is None and processor.tensors == {}

def generated_words(llm, free: list[list[int]]) -> dict[int, str]:
    """A bad word of each length (1 and 2 tokens) that some of the unconstrained outputs `free` has."""
    tokenizer = llm.get_tokenizer()

    def generated(ids: list[int]) -> bool:
        return any(tokens[i:i + len(ids)] == ids for tokens in free for i in range(len(tokens)))

    words = {}
    for tokens in free:
        for start in range(len(tokens) - 1):
            for length in (1, 2):
                word = tokenizer.decode(tokens[start:start + length]).strip()
                forms = llm.checker.bad_words_token_ids(greedy(bad_words=[word])) if word else None
                if forms and any(map(generated, forms)) and max(map(len, forms)) == length:
                    words.setdefault(length, word)
    assert set(words) == {1, 2}, words
    return words


@pytest.mark.parametrize("lengths", [(1, 2), (1,)], ids=["one_and_two_tokens", "one_token"])
def test_bad_words_equal_transformers_over_the_generated_tokens(llm, qwen3_ckpt, prompts, lengths):
    """Words taken from the unconstrained outputs, so they would be generated. With a word
    of two tokens a step samples only once the step before it is read; with one-token
    words alone steps keep one in flight (the ban needs no tokens)."""
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    tokenizer = llm.get_tokenizer()
    words = generated_words(llm, free)
    words = {length: words[length] for length in lengths}
    params = greedy(bad_words=list(words.values()))
    bad_ids = llm.checker.bad_words_token_ids(params)
    for word in words.values():  # each word as written and after a space (unless that is a space token before it)
        plain, spaced = (tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word))
        assert plain in bad_ids and (spaced in bad_ids) == (spaced[1:] != plain)
    split = []
    forward = llm.executor.forward
    llm.executor.forward = lambda *args: split.append(1) or forward(*args)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.executor.forward
    assert bool(split) == (2 in lengths)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_constrained(qwen3_ckpt, prompt, bad_words=bad_ids)
    assert [o.outputs[0].token_ids for o in outputs] != free


def test_processors_see_the_drafts_before_each_row():
    """A sequence verifying drafts [5, 6, 7] has four rows in a row: row j's bad-word bans
    follow its known completion tokens and its first j drafts, and min_tokens counts them."""
    params = SamplingParams(min_tokens=4, stop_token_ids=[9], bad_words=["(as token ids below)"])
    seq = Sequence(0, [1, 2, 3], params, block_size=8, bad_words=[[5, 6], [7, 8], [3, 5], [4]])
    seq.append_token(3)  # one completion token, known
    seq.add_drafts([5, 6, 7])
    rows, cpu = [seq] * 4, torch.device("cpu")
    banned = BadWordsProcessor(cpu).prepare(rows, [params])
    # [4] on every row; [3, 5] after the known 3 (row 0), [5, 6] after draft 5 (row 1), [7, 8] after draft 7
    assert sorted(zip(*banned.tolist())) == [(0, 4), (0, 5), (1, 4), (1, 6), (2, 4), (3, 4), (3, 8)]
    # 1, 2, 3 and 4 completion tokens before rows 0-3: end-of-sequence (0) and stop token 9 banned on rows 0-2
    banned = MinTokensProcessor(frozenset({0}), cpu).prepare(rows, [params])
    assert sorted(zip(*banned.tolist())) == [(0, 0), (0, 9), (1, 0), (1, 9), (2, 0), (2, 9)]


def test_each_verified_row_sees_the_drafts_before_it(llm, qwen3_ckpt):
    """Speculative decoding (n-gram): bad words of one and two tokens (taken from the
    unconstrained outputs), allowed_token_ids and logit_bias hold on every row a step
    verifies: transformers' tokens under the same constraints."""
    prompts = looping_prompts(384, seed=6)[:4]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24), use_tqdm=False)]
    words = list(generated_words(llm, free).values())
    bad_ids = llm.checker.bad_words_token_ids(greedy(bad_words=words))
    allowed = sorted(set(range(3, 300)) - {free[2][3]})
    params = [greedy(24, bad_words=words), greedy(24, bad_words=words[1:]),
              greedy(24, allowed_token_ids=allowed), greedy(24, logit_bias={free[3][2]: -5.0, 9: 3.0})]
    constrained = functools.partial(hf_constrained, qwen3_ckpt, max_tokens=24)
    expected = [constrained(prompts[0], bad_words=bad_ids),
                constrained(prompts[1], bad_words=llm.checker.bad_words_token_ids(params[1])),
                constrained(prompts[2], allowed=allowed), constrained(prompts[3], bias=params[3].logit_bias)]
    with make_llm(qwen3_ckpt, max_model_len=256, speculative_config=NGRAM) as speculating:
        outputs = speculating.generate(prompts, params, use_tqdm=False)
        assert speculating.stats()["spec_decode_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_truncate_prompt_tokens_keeps_the_last_ones(llm, qwen3_ckpt, prompts):
    long = prompts[4]
    [out] = llm.generate([long], greedy(truncate_prompt_tokens=7), use_tqdm=False)
    assert out.prompt_token_ids == long[-7:]
    assert out.outputs[0].token_ids == hf_greedy(qwen3_ckpt, [long[-7:]], MAX_TOKENS, ignore_eos=True)[0]
    # longer than max_model_len (256): what is kept is what counts
    [out] = llm.generate([long * 20], greedy(truncate_prompt_tokens=100), use_tqdm=False)
    assert out.prompt_token_ids == (long * 20)[-100:] and len(out.outputs[0].token_ids) == MAX_TOKENS


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm, prompts):
    params = greedy(logprobs=2)
    full = llm.generate(prompts[:2], params, use_tqdm=False)
    bare = llm.generate(prompts[:2], greedy(logprobs=2, detokenize=False), use_tqdm=False)
    for a, b in zip(full, bare):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and a.outputs[0].text and b.outputs[0].text == ""
        assert all(lp.decoded_token is None for entry in b.outputs[0].logprobs for lp in entry.values())
        assert [list(e) for e in b.outputs[0].logprobs] == [list(e) for e in a.outputs[0].logprobs]
    request = llm.make_request(prompts[0], greedy(detokenize=False), stream=True)
    llm.add_request(request)
    tokens = []
    while not request.finished:
        llm.step()
        delta = llm.stream_delta(request.seqs[0])
        assert delta.text == ""
        tokens += delta.token_ids
    assert tokens == full[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_truncation_to_leave_room_for_max_tokens(llm):
    most = llm.checker.most_tokens
    [out] = llm.generate([list(range(3, most + 53))], SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=-1), use_tqdm=False)
    assert out.prompt_token_ids == list(range(3, most + 53))[-(most - 5):] and len(out.outputs[0].token_ids) == 5


def test_offline_max_tokens_stop_at_the_context_end(llm):
    most = llm.checker.most_tokens
    prompt = [5] * (most - 4)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"leaves no room for output.*; shorten it \(or set truncate_prompt_tokens"):
        llm.generate([[5] * most], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"leaves no room for output.*; lower truncate_prompt_tokens, or set it to -1"):
        llm.generate([[5] * (most + 5)], SamplingParams(truncate_prompt_tokens=most), use_tqdm=False)
    past = llm.config.max_model_len + 1  # could never be what is kept: refused, as vLLM refuses it
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens \({past}\) exceeds max_model_len"):
        llm.generate([[5] * 3], SamplingParams(truncate_prompt_tokens=past), use_tqdm=False)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(logit_bias={"5": 1.0}), "logit_bias must map token ids"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(bad_words=["ok", " "]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(prompt_logprobs=-2), r"prompt_logprobs must be None, an integer >= 0, or -1 \(the whole vocabulary\)"),
    (dict(logprobs=1.0), "logprobs must be"),
    (dict(seed=1 << 63), "64-bit"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_bad_values_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_allowed_token_ids_that_leave_nothing_to_draw_are_refused(llm):
    """Every allowed token a one-token bad word, or (under min_tokens) an end-of-sequence or
    stop token: the first token could be nothing, and the request is refused up front
    rather than run to an output that breaks its own constraints."""
    eos = min(llm.eos_token_ids)
    word = llm.tokenizer.decode([300])
    plain = next(ids[0] for ids in llm.checker.bad_words_token_ids(greedy(bad_words=[word])) if len(ids) == 1)
    for fields, message in [
        (dict(allowed_token_ids=[plain], bad_words=[word]), "allow only tokens that bad_words forbid"),
        (dict(allowed_token_ids=[eos], min_tokens=2), r"only end-of-sequence or stop tokens, which min_tokens \(2\)"),
        (dict(allowed_token_ids=[7, 9], stop_token_ids=[7, 9], min_tokens=1), "only end-of-sequence or stop"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6]], SamplingParams(max_tokens=4, **fields), use_tqdm=False)
    # The same with a token left to draw, or end-of-sequence not stopping (ignore_eos), runs.
    for fields in (dict(allowed_token_ids=[plain, 11], bad_words=[word]),
                   dict(allowed_token_ids=[eos], min_tokens=2, ignore_eos=True)):
        [out] = llm.generate([[5, 6]], SamplingParams(max_tokens=3, **fields), use_tqdm=False)
        assert len(out.outputs[0].token_ids) >= 1
    assert llm.is_finished()


def test_a_grammar_its_other_constraints_leave_no_token_stops_with_a_warning(llm, caplog):
    """allowed_token_ids that exclude every token a grammar allows first: refused before
    anything runs. Where they exclude every token it allows later, the sequence stops there,
    logged as the request's conflict (a warning), not as the engine's bug."""
    pytest.importorskip("xgrammar")
    from nanovllm.sampling_params import StructuredOutputsParams

    letter = llm.tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
                            allowed_token_ids=letter)
    with pytest.raises(ValueError, match="allowed_token_ids forbid every token the structured output's grammar"):
        llm.generate([[5, 6]], params, use_tqdm=False)
    one = llm.tokenizer.encode("1", add_special_tokens=False)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="1x"), allowed_token_ids=one)
    with caplog.at_level("WARNING", logger="nanovllm.engine.output_processor"):
        [out] = llm.generate([[5, 6]], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[:1] == one
    [record] = [r for r in caplog.records if "no token satisfies" in r.getMessage()]
    assert record.levelname == "WARNING" and "allowed_token_ids" in record.getMessage()
    assert llm.is_finished()
