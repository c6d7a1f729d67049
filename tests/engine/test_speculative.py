"""Speculative decoding by n-gram prompt lookup (engine/speculative.py): the engine's tokens
equal those of the same engine without speculation (greedy, seeded sampling, logprobs,
every stop condition), and greedy ones equal Hugging Face's, on CPU in float32."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from nanovllm import SamplingParams
from nanovllm.config import SpeculativeConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.speculative import lookup
from nanovllm.testing.checkpoints import hf_greedy
from parity import INTERPRETER_ONLY, looping_prompts, make_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def generate_both(path, prompts, params, speculative_config=NGRAM, **engine_args):
    """(outputs without speculation, outputs with it, the speculating engine's stats)."""
    with make_llm(path, **engine_args) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    with make_llm(path, speculative_config=speculative_config, **engine_args) as llm:
        speculated = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert llm.scheduler.block_manager.num_used_blocks == 0
    return plain, speculated, stats


def test_lookup_takes_the_longest_suffix_match():
    tokens = np.array([1, 2, 3, 4, 9, 7, 2, 3, 8, 1, 2, 3])
    assert lookup(tokens, 3, 1, 4) == [4, 9, 7]  # "1 2 3" beats the later "2 3"
    assert lookup(tokens, 3, 1, 2) == [8, 1, 2]  # at most two tokens: "2 3", its latest place
    assert lookup(tokens, 2, 4, 4) == []  # no earlier "3 1 2 3"
    assert lookup(np.array([5, 6, 7]), 3, 1, 4) == []
    assert lookup(np.array([7]), 3, 1, 4) == []
    # The latest match with k tokens after it, else the earliest (the longest run).
    assert lookup(np.array([1, 1, 1, 1, 1]), 2, 1, 1) == [1, 1]
    assert lookup(np.array([4, 5, 4, 6, 4]), 5, 1, 1) == [5, 4, 6, 4]


@pytest.mark.parametrize("value, error", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft's checkpoint folder"),
    ({"model": "/models/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "'prompt_lookup_max' is not supported with method 'draft_model'"),
    ({"model": "/d", "num_speculative_tokens": 2, "acceptance_method": "typical_acceptance_sampler"},
     "acceptance_method 'typical_acceptance_sampler' is not supported"),
    ({"speculative_model": "/d", "num_speculative_tokens": 2}, "give the draft's folder as 'model'"),
    ({"model": "/d", "num_speculative_tokens": 2, "revision": "main"}, "'revision' is not supported"),
    ({"model": "/models/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}, "positive integer"),
    ({"num_speculative_tokens": 2}, "needs a method"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'model' is not supported with method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 4},
     "exceeds prompt_lookup_max"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_are_refused(value, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.parse(value)


@pytest.mark.parametrize("spelling", [{"method": "[ngram]"}, {"model": "[ngram]"}, {"model": "ngram"}])
def test_vllms_older_spellings_of_ngram(spelling):
    assert SpeculativeConfig.parse({**spelling, "num_speculative_tokens": 2}).method == "ngram"


@pytest.mark.parametrize("given, bounds", [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)),
                                           ({"prompt_lookup_min": 6}, (6, 6)),
                                           ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4))])
def test_prompt_lookup_bounds_default_as_vllms(given, bounds):
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == bounds
    assert SpeculativeConfig.parse(config) == config  # an object is taken as well as a dict


@pytest.mark.parametrize("tiny_ckpt", ["qwen3", "llama", "qwen3_moe"], indirect=True)
def test_greedy_speculation_matches_hf(tiny_ckpt):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with make_llm(tiny_ckpt, kvcache_block_size=8, speculative_config=NGRAM) as llm:
        prompts = looping_prompts(llm.vocab_size)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_ckpt, prompts, 40, ignore_eos=True)
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # some rejected too
    # Each decode token (a sequence's last, or a draft) is computed once; each step outputs
    # a sequence's kept drafts and one token more.
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert stats["decode_tokens"] + stats["prefill_step_decode_tokens"] == (
        generated - len(prompts) - stats["spec_decode_num_accepted_tokens"] + stats["spec_decode_num_draft_tokens"])
    assert stats["prefill_tokens"] == sum(map(len, prompts))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
], ids=["top_p_top_k", "min_p_logprobs", "greedy_logprobs"])
def test_sampling_draws_the_tokens_decoding_draws(qwen3_ckpt, params):
    prompts = looping_prompts(384, seed=1)
    plain, speculated, stats = generate_both(qwen3_ckpt, prompts, params)
    assert stats["spec_decode_num_drafts"] > 0
    for a, b in zip(plain, speculated):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if params.logprobs is not None:
            assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys()
                assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)


@pytest.mark.parametrize("temperature, method", [(0, "ngram"), (0.3, "ngram"), (0, "draft_model")],
                         ids=["greedy", "seeded", "draft_model"])
def test_penalties_count_the_drafts_before_each_row(qwen3_ckpt, temperature, method):
    """Repetition, frequency and presence penalties on a verification's rows: row j counts its
    sequence's first j drafts as output, and the step counts only the tokens it keeps (the
    penalties of later steps see exactly the output): plain decoding's tokens."""
    prompts = looping_prompts(384, seed=2)[:4]
    base = dict(temperature=temperature, seed=7, max_tokens=40, ignore_eos=True, logprobs=1)
    params = [SamplingParams(**base, repetition_penalty=1.05), SamplingParams(**base, repetition_penalty=1.3),
              SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(**base, repetition_penalty=0.9, frequency_penalty=-0.2)]
    config = NGRAM if method == "ngram" else {"model": str(qwen3_ckpt), "num_speculative_tokens": 3}
    plain, speculated, stats = generate_both(qwen3_ckpt, prompts, params, speculative_config=config)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in speculated]
    for a, b in zip(plain, speculated):
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_allowed_tokens_and_logit_bias_speculate(qwen3_ckpt):
    """allowed_token_ids and logit_bias apply to every row alike: those requests speculate
    (alone in the batch here) and draw plain decoding's tokens, greedy and seeded."""
    prompts = looping_prompts(384, seed=4)[:2]
    allowed = dict(allowed_token_ids=list(range(3, 200)))
    bias = dict(logit_bias={5: 2.0, 7: -100.0, 11: 1.5})
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **allowed),
              SamplingParams(temperature=0.8, seed=2, max_tokens=30, ignore_eos=True, **bias)]
    plain, speculated, stats = generate_both(qwen3_ckpt, prompts, params)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in speculated]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert all(t in range(3, 200) for t in speculated[0].outputs[0].token_ids)


def test_min_tokens_counts_the_drafts_before_each_row(qwen3_ckpt):
    """The token greedy decoding draws most often (its output loops) as a stop token, under
    min_tokens of 4 to 26: it may not end an output before min_tokens tokens, on any row of a
    verification (each row counts the drafts before it); the tokens are plain decoding's."""
    prompts = looping_prompts(384, seed=4)
    with make_llm(qwen3_ckpt) as llm:
        probes = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    loops = [collections.Counter(o.outputs[0].token_ids).most_common(1)[0][::-1] for o in probes]
    (_, stop), prompt = max(zip(loops, prompts))
    params = [SamplingParams(temperature=0, max_tokens=40, min_tokens=m, stop_token_ids=[stop]) for m in range(4, 27)]
    plain, speculated, stats = generate_both(qwen3_ckpt, [prompt] * len(params), params)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in speculated]
    for p, out in zip(params, speculated):
        assert stop not in out.outputs[0].token_ids[:p.min_tokens]
    assert sum(o.outputs[0].finish_reason == "stop" for o in speculated) > len(params) // 2
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_stops_inside_kept_drafts(qwen3_ckpt):
    """End-of-sequence, a stop token, max_tokens or a stop string met at a kept draft ends
    the sequence there, as in decoding: the tokens after it in the step are dropped."""
    prompts = looping_prompts(384, seed=3)
    with make_llm(qwen3_ckpt, speculative_config=NGRAM) as llm:
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                              use_tqdm=False)
    # A token each output repeats (a draft that is kept) ends it: as a stop token, and as text.
    loops = [o.outputs[0].token_ids for o in greedy]
    stop_ids = sorted({t for ids in loops for t in ids[len(ids) // 2:]})[:3]
    for params in (SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stop_ids),
                   SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["9"]),
                   SamplingParams(temperature=0, max_tokens=40, stop=["9"], include_stop_str_in_output=True)):
        plain, speculated, _ = generate_both(qwen3_ckpt, prompts, params)
        for a, b in zip(plain, speculated):
            assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason,
                    a.outputs[0].stop_reason) == (b.outputs[0].token_ids, b.outputs[0].text,
                                                  b.outputs[0].finish_reason, b.outputs[0].stop_reason)


@pytest.mark.parametrize("scenario", ["preemption", "prefix_cache", "chunked", "n", "tp2"])
def test_speculation_under_every_scenario(qwen3_ckpt, scenario):
    args = {"preemption": dict(kvcache_block_size=8, num_kvcache_blocks=24),
            "prefix_cache": dict(kvcache_block_size=8), "chunked": dict(max_num_batched_tokens=24, max_num_seqs=8),
            "n": {}, "tp2": dict(tensor_parallel_size=2)}[scenario]
    prompts = looping_prompts(384, seed=4)
    params = SamplingParams(temperature=0.7 if scenario == "n" else 0, n=3 if scenario == "n" else 1, seed=2,
                            max_tokens=32, ignore_eos=True)
    if scenario == "prefix_cache":  # the second time from the cache, drafts' blocks freed and refilled between
        prompts = prompts + prompts
    plain, speculated, stats = generate_both(qwen3_ckpt, prompts, params, **args)
    assert [[c.token_ids for c in o.outputs] for o in plain] == [[c.token_ids for c in o.outputs] for o in speculated]
    assert stats["spec_decode_num_drafts"] > 0
    if scenario == "preemption":
        assert stats["preemptions"] > 0


@INTERPRETER_ONLY
def test_speculation_on_the_triton_kernels_matches_hf(qwen3_ckpt):
    """The paged prefill kernel verifies the drafts (the interpreter on CPU)."""
    prompts = looping_prompts(384, seed=4)[:2]
    with make_llm(qwen3_ckpt, attention_backend="triton", speculative_config=NGRAM) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 20, ignore_eos=True)


def test_no_drafts_at_or_above_disable_by_batch_size(qwen3_ckpt):
    """disable_by_batch_size: a step that starts with that many running sequences drafts
    nothing, and the engine keeps a step in flight while it schedules the next."""
    prompts = looping_prompts(384, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 6, 8, 10, 12)]
    with make_llm(qwen3_ckpt) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    for limit, drafted in ((len(prompts), True), (1, False)):
        config = {**NGRAM, "disable_by_batch_size": limit}
        with make_llm(qwen3_ckpt, speculative_config=config) as llm:
            # All five run at once: only the steps after one finishes may draft (none with a limit of 1).
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert (llm.stats()["spec_decode_num_drafts"] > 0) == drafted
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_streamed_text_is_the_same(qwen3_ckpt):
    """A step that outputs several tokens streams them as one piece; the pieces join up to the text."""
    prompts = looping_prompts(384, seed=5)[:2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with make_llm(qwen3_ckpt, speculative_config=NGRAM) as llm:
        engine = llm
        requests = [engine.make_request(p, params, stream=True) for p in prompts]
        for request in requests:
            engine.add_request(request)
        pieces = {id(r): [] for r in requests}
        while not all(r.finished for r in requests):
            engine.step()
            for r in requests:
                pieces[id(r)].append(engine.stream_delta(r.seqs[0]).text)
        for r in requests:
            assert "".join(pieces[id(r)]) == engine.output(r).outputs[0].text


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_step_after_verifying_drafts_waits_for_them(qwen3_ckpt, method, monkeypatch):
    """A step that verified drafts is read before the next is built even where that one
    drafts nothing: here a one-token request finishes and the next admission brings the
    running sequences to disable_by_batch_size, so the step after a verification drafts
    nothing (which the test checks happens) yet must know how many tokens each kept."""
    config = {**NGRAM, "disable_by_batch_size": 2} if method == "ngram" else {
        "model": str(qwen3_ckpt), "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    prompts = [[200, 218, 23] * 5, [11, 12] * 3, [135, 264, 251] * 4]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 1, 10)]
    read_before_schedule, guarded = LLMEngine._read_before_schedule, []

    def spy(engine):
        verified = engine.inflight is not None and engine.inflight[0].seq_rows is not None
        guarded.append(verified and not engine.scheduler.drafts())
        return read_before_schedule(engine)

    monkeypatch.setattr(LLMEngine, "_read_before_schedule", spy)
    plain, speculated, stats = generate_both(qwen3_ckpt, prompts, params, speculative_config=config,
                                             kvcache_block_size=8, max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in speculated]
    assert stats["spec_decode_num_drafts"] > 0 and any(guarded)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_aborting_a_request_while_its_drafts_are_verified(qwen3_ckpt, method):
    """A request aborted while a step verifies its drafts leaves the other's tokens as
    plain decoding's, and no block held."""
    config = NGRAM if method == "ngram" else {"model": str(qwen3_ckpt), "num_speculative_tokens": 3}
    prompts = [[7, 8, 9] * 4, [11, 12] * 6]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.5)]
    with make_llm(qwen3_ckpt, kvcache_block_size=8, speculative_config=config) as llm:
        plain_b = llm.generate(prompts[1:2], params[1], use_tqdm=False)[0].outputs[0].token_ids
        a, b = (llm.make_request(p, sp) for p, sp in zip(prompts, params))
        llm.add_request(a)
        llm.add_request(b)
        while not (llm.inflight is not None and llm.inflight[0].seq_rows is not None):
            llm.step()
        llm.abort_request(a)
        while not llm.is_finished():
            llm.step()
        assert llm.output(b).outputs[0].token_ids == plain_b
        assert llm.scheduler.block_manager.num_used_blocks == 0

