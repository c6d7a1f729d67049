"""SamplingParams through the whole engine: filters, penalties, seeds, stops, min_tokens,
logprobs, n and streaming, with transformers as the oracle where it has an equivalent.

Each test runs on the CPU and, where there is one, on a GPU (float32, Triton attention,
CUDA graphs and torch.compile on)."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from nanovllm import LLM, SamplingParams
from nanovllm.testing.checkpoints import hf_greedy, hf_logits

ENGINE = dict(dtype="float32", kvcache_block_size=16, num_kvcache_blocks=96)
PROMPTS = [[5, 6, 7, 8], [9] * 20, [3], list(range(40, 75))]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def llm(request, qwen3_ckpt):
    with LLM(str(qwen3_ckpt), device=request.param, **ENGINE) as engine:
        yield engine


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_idle(llm) -> None:
    assert llm.is_finished() and llm.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_are_greedy(llm, qwen3_ckpt, filters):
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, **filters)
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == hf_greedy(qwen3_ckpt, PROMPTS, 6, ignore_eos=True)


class OpenAIPenalties:
    """OpenAI's presence / frequency penalties on the generated tokens, as a transformers
    logits processor (transformers has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.size(-1))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def test_penalties_equal_transformers_logits_processors(llm, qwen3_ckpt):
    greedy = hf_greedy(qwen3_ckpt, PROMPTS, 8, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8)
    got = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    expected = hf_greedy(qwen3_ckpt, PROMPTS, 8, ignore_eos=True, logits_processor=RepetitionPenaltyLogitsProcessor(1.8))
    assert got == expected and got != greedy
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7)
    got = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    expected = [hf_greedy(qwen3_ckpt, [p], 8, ignore_eos=True, logits_processor=OpenAIPenalties(len(p), 1.5, 0.7))[0]
                for p in PROMPTS]
    assert got == expected and got != greedy
    assert_idle(llm)


def test_penalized_and_plain_requests_share_a_batch(llm, qwen3_ckpt):
    """Penalty state is per sequence: a plain request next to penalized ones stays greedy,
    and penalized ones give the same tokens alone or together."""
    penalized = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.5)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    mixed = tokens(llm.generate(PROMPTS, [penalized, plain, penalized, plain], use_tqdm=False))
    alone = [tokens(llm.generate([p], params, use_tqdm=False))[0] for p, params in zip(PROMPTS, [penalized, plain] * 2)]
    assert mixed == alone
    assert mixed[1::2] == [hf_greedy(qwen3_ckpt, [p], 8, ignore_eos=True)[0] for p in PROMPTS[1::2]]


def test_seeded_requests_repeat_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1234)
    filtered = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=10, ignore_eos=True, seed=99)
    alone = [tokens(llm.generate([PROMPTS[0]], params, use_tqdm=False))[0] for params in (seeded, filtered)]
    again = [tokens(llm.generate([PROMPTS[0]], params, use_tqdm=False))[0] for params in (seeded, filtered)]
    assert alone == again
    noise = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    for others in (1, 3):
        batch = [PROMPTS[0], PROMPTS[0]] + PROMPTS[1 : 1 + others]
        params = [seeded, filtered] + [noise] * others
        assert tokens(llm.generate(batch, params, use_tqdm=False))[:2] == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=4321)
    assert tokens(llm.generate([PROMPTS[0]], other_seed, use_tqdm=False))[0] != alone[0]


def test_logprobs_equal_transformers_log_softmax(llm, qwen3_ckpt):
    params = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True, logprobs=4, seed=0)
    for prompt, out in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        completion = out.outputs[0]
        assert len(completion.logprobs) == 5
        reference = hf_logits(qwen3_ckpt, prompt + completion.token_ids).log_softmax(-1)
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            expected = reference[len(prompt) - 1 + i]
            top = expected.topk(4)
            assert set(entry) == {token, *top.indices.tolist()}
            for token_id, lp in entry.items():
                assert abs(lp.logprob - expected[token_id].item()) < 1e-4
                assert lp.rank == int((expected > expected[token_id]).sum()) + 1
                assert lp.decoded_token == llm.tokenizer.decode([token_id])
        assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, logprobs=0), use_tqdm=False)
    assert all(len(entry) == 1 for entry in out.outputs[0].logprobs)


def test_n_completions_compute_the_prompt_once(llm):
    manager = llm.scheduler.block_manager
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 can be shared
    hits_before = manager.num_prompt_tokens_hit
    [out] = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each completion draws its own tokens
    assert manager.num_prompt_tokens_hit - hits_before == 3 * 32
    [again] = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert (out.num_cached_tokens, again.num_cached_tokens) == (0, 32)  # vLLM's: the first completion's hits
    assert_idle(llm)


def greedy_text(llm, prompt: list[int], max_tokens: int = 16) -> tuple[list[int], list[str]]:
    """Greedy tokens and the text of each prefix of them."""
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    ids = out.outputs[0].token_ids
    return ids, [llm.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]


def spanning_stop(prefix_texts: list[str]) -> tuple[str, int]:
    """A stop string that starts inside one token's text and ends inside a later one's,
    and first occurs there: (it, index of the token that completes it)."""
    full = prefix_texts[-1]
    for k in range(1, len(prefix_texts) - 2):
        start, end = len(prefix_texts[k]) - 1, len(prefix_texts[k + 1]) + 1
        stop = full[start:end]
        if len(prefix_texts[k + 1]) > len(prefix_texts[k]) and "\ufffd" not in stop and full.find(stop) == start:
            return stop, k + 1
    raise AssertionError("no usable stop string in this completion")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(llm, include):
    prompt = PROMPTS[3]
    ids, texts = greedy_text(llm, prompt)
    stop, last = spanning_stop(texts)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["never there", stop],
                            include_stop_str_in_output=include)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    start = texts[-1].find(stop)
    assert completion.text == texts[-1][: start + (len(stop) if include else 0)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == ids[: last + 1]
    assert_idle(llm)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = PROMPTS[3]
    ids, texts = greedy_text(llm, prompt)
    stop_id = ids[3]
    first = ids.index(stop_id)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == ids[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.text == texts[first]  # the stop token's own text is left out
    # min_tokens: the stop token cannot be drawn before 8 tokens exist.
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id], min_tokens=8)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    got = out.outputs[0].token_ids
    assert stop_id not in got[:8] and len(got) >= 8
    assert got[-1] == stop_id or len(got) == 16
    assert_idle(llm)


def test_streamed_deltas_add_up_to_the_output(llm):
    prompt = PROMPTS[3]
    _, texts = greedy_text(llm, prompt)
    stop, _ = spanning_stop(texts)
    for params in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop)):
        request = llm.make_request(prompt, params, stream=True)
        llm.add_request(request)
        seq = request.seqs[0]
        text, ids, logprobs = "", [], []
        while not request.finished:
            llm.step()
            delta = llm.stream_delta(seq)
            assert stop not in text + delta.text or not params.stop
            text, ids = text + delta.text, ids + delta.token_ids
            logprobs += delta.logprobs or []
        llm.drain()
        delta = llm.stream_delta(seq)
        text, ids = text + delta.text, ids + delta.token_ids
        final = llm.output(request).outputs[0]
        assert (text, ids) == (final.text, final.token_ids) and delta.finish_reason == final.finish_reason
        if params.logprobs is not None:
            assert len(logprobs) == len(ids) == 16
        else:
            assert final.text == texts[-1][: texts[-1].find(stop)]
    assert_idle(llm)


def test_abort_mid_request_frees_everything(llm):
    request = llm.make_request(PROMPTS[3], SamplingParams(n=3, max_tokens=50, repetition_penalty=1.2), stream=True)
    llm.add_request(request)
    for _ in range(3):
        llm.step()
    llm.abort_request(request)
    llm.drain()
    assert request.finished and all(seq.finish_reason == "abort" for seq in request.seqs)
    assert_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(n=0), "n must"),
        (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"), (dict(seed=1.5), "seed"), (dict(stop=[""]), "stop"),
        (dict(stop=["a", 3]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(min_tokens=70), "min_tokens"),
        (dict(logprobs=-2), "logprobs"), (dict(skip_special_tokens=1), "skip_special_tokens"),
        (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"), (dict(min_p=float("nan")), "min_p"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_penalty=1e-40), "float32"), (dict(repetition_penalty=1e39), "float32"),  # 0 / inf there
        (dict(temperature=1e39), "temperature .*float32"),  # masked logits' -inf / inf: NaN
        (dict(presence_penalty=float("-inf")), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"), (dict(temperature=-1), "temperature"),
    ],
)
def test_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_numpy_numbers_and_tiny_temperatures(caplog):
    """numpy's scalars are taken as Python's numbers (np.float32 is no float, np.int64 no
    int); a temperature above 0 samples at MIN_TEMPERATURE at least, with a warning, as vLLM's."""
    import numpy as np

    from nanovllm.sampling_params import MIN_TEMPERATURE

    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float16(0.5), top_k=np.int64(5), n=np.int32(2),
                            max_tokens=np.uint8(7), seed=np.int64(-3), min_p=np.float64(0.1))
    assert (params.temperature, params.top_p, params.top_k, params.n, params.max_tokens, params.seed) == (
        0.5, 0.5, 5, 2, 7, -3)
    assert type(params.temperature) is float and type(params.top_k) is int
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=np.float32(5))  # a count is an integer, whoever's
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=np.bool_(True))
    assert SamplingParams(temperature=1e-4).temperature == MIN_TEMPERATURE and "below" in caplog.text
    assert SamplingParams(temperature=0).temperature == 0 and SamplingParams(temperature=0.02).temperature == 0.02


def test_from_optional_and_clone():
    params = SamplingParams.from_optional(temperature=None, top_p=0.5, stop=["x"], max_tokens=None)
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.5, None)
    copy = params.clone()
    copy.stop.append("y")
    assert copy.stop == ["x", "y"] and params.stop == ["x"]


def test_seed_minus_one_is_no_seed_and_stops_are_lists():  # as vLLM's after init
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    default = SamplingParams()
    assert default.stop == [] and default.stop_token_ids == [] and SamplingParams(stop="x").stop == ["x"]
    assert default.stop is not SamplingParams().stop  # each its own


def test_logprobs_minus_one_is_the_whole_vocabulary(llm, qwen3_ckpt):
    """-1 asks for every token's logprob (vLLM's), which an engine gives only with
    max_logprobs=-1; the default engine's 20 refuses it, saying what -1 meant."""
    vocab = llm.config.hf_config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        whole = rf"{name} \(-1, the whole vocabulary of {vocab}\) exceeds max_logprobs \(20\)"
        with pytest.raises(ValueError, match=whole):
            llm.generate(["hi"], SamplingParams(**{name: -1}), use_tqdm=False)
    assert_idle(llm)
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    with LLM(str(qwen3_ckpt), device=llm.config.device, max_logprobs=-1, **ENGINE) as whole:
        assert whole.config.max_logprobs == vocab
        [out] = whole.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    reference = hf_logits(qwen3_ckpt, prompt + completion.token_ids).log_softmax(-1)
    rows = [(len(prompt) - 1 + i, entry) for i, entry in enumerate(completion.logprobs)]
    rows += [(i - 1, entry) for i, entry in enumerate(out.prompt_logprobs) if entry is not None]
    assert len(rows) == 3 + len(prompt) - 1
    for position, entry in rows:
        assert sorted(entry) == list(range(vocab))
        got = torch.tensor([entry[t].logprob for t in range(vocab)])
        torch.testing.assert_close(got, reference[position].float(), atol=1e-4, rtol=0)


def test_stop_token_ids_outside_the_vocabulary_are_rejected(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    assert_idle(llm)


def test_logprobs_beyond_the_engines_max_logprobs_are_rejected(llm):
    with pytest.raises(ValueError, match=r"logprobs \(21\) exceeds max_logprobs \(20\)"):
        llm.generate(["hi"], SamplingParams(logprobs=21), use_tqdm=False)
    [out] = llm.generate(["hi"], SamplingParams(logprobs=20, max_tokens=2), use_tqdm=False)
    assert all(len(entry) >= 20 for entry in out.outputs[0].logprobs)
    assert_idle(llm)


def test_after_the_engines_sampler_warm_up_no_request_compiles(qwen3_ckpt):
    """What the server's engine process runs at start-up (LLMEngine.warm_up_sampler)
    covers what the engine samples later: filtered and penalized batches of one and of
    several requests compile nothing new. The warm-up once ran under inference_mode while
    steps sampled from buffers made outside it; torch.compile told the two apart, so on the
    H200 the first filtered batch compiled again while every running stream waited."""
    from torch._dynamo.utils import counters

    from nanovllm.utils.compile import set_compile_enabled

    with LLM(str(qwen3_ckpt), device="cpu", **ENGINE) as llm:
        set_compile_enabled(True)
        try:
            plain = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1)
            for prompts in (PROMPTS, PROMPTS[:1]):  # the model's compiled layers, for these shapes
                llm.generate(prompts, plain, use_tqdm=False)
            assert llm.warm_up_sampler() > 0
            compiled = counters["stats"]["unique_graphs"]
            for extra in (dict(top_k=5, top_p=0.9), dict(top_p=0.8), dict(min_p=0.1, repetition_penalty=1.3),
                          dict(top_k=3, presence_penalty=0.5, frequency_penalty=0.2)):
                params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1, **extra)
                for prompts in (PROMPTS, PROMPTS[:1]):
                    llm.generate(prompts, params, use_tqdm=False)
            assert counters["stats"]["unique_graphs"] == compiled
        finally:
            set_compile_enabled(False)
