"""LLM.beam_search (nanovllm/beam_search.py, vLLM's) against transformers' own beam search."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, BeamSearchParams, SamplingParams
from nanovllm.beam_search import beam_score
from nanovllm.testing.checkpoints import _reference_model

ENGINE = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128)
PROMPTS = [[5, 17, 42, 9], [100, 3, 77, 250, 31, 8, 64, 2, 90, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    with LLM(str(qwen3_ckpt), **ENGINE) as engine:
        yield engine


@torch.inference_mode()
def hf_beams(path, prompt: list[int], width: int, max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beams with no end-of-sequence token: their new tokens and their summed
    log-probabilities, best first."""
    model = _reference_model(path)
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         length_penalty=1.0, early_stopping=False, return_dict_in_generate=True, output_scores=True)
    # sequences_scores: the sums over the new tokens divided by their number (length_penalty 1)
    return [s[len(prompt):].tolist() for s in out.sequences], (out.sequences_scores * max_tokens).tolist()


def test_beams_equal_transformers(llm, qwen3_ckpt):
    width, max_tokens = 3, 6
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    text = "The weather in Oslo"
    [tokenized] = llm.generate([text], SamplingParams(max_tokens=1), use_tqdm=False)
    results = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}, PROMPTS[1], text], params)
    assert len(results) == 3
    # Two prompts at a time, in vLLM's order of arguments (prompts, params, lora_request, use_tqdm, concurrency_limit).
    two_at_a_time = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}, PROMPTS[1], text], params, None, False, 2)
    assert [[b.tokens for b in r.sequences] for r in two_at_a_time] == [
        [b.tokens for b in r.sequences] for r in results]
    assert [b.cum_logprob for r in two_at_a_time for b in r.sequences] == pytest.approx(
        [b.cum_logprob for r in results for b in r.sequences], rel=1e-5)  # (other batches: float32's last bits)
    for prompt, result in zip([*PROMPTS, tokenized.prompt_token_ids], results):
        expected_tokens, expected_sums = hf_beams(qwen3_ckpt, prompt, width, max_tokens)
        assert [beam.tokens[:len(prompt)] for beam in result.sequences] == [prompt] * width
        assert [beam.tokens[len(prompt):] for beam in result.sequences] == expected_tokens
        assert [beam.cum_logprob for beam in result.sequences] == pytest.approx(expected_sums, rel=1e-4)
        for beam in result.sequences:
            assert beam.finish_reason == "length" and beam.text == llm.tokenizer.decode(beam.tokens)
            assert len(beam.logprobs) == max_tokens and all(len(step) >= 2 * width for step in beam.logprobs)
            chosen = [step[token].logprob for step, token in zip(beam.logprobs, beam.tokens[len(prompt):])]
            assert sum(chosen) == pytest.approx(beam.cum_logprob)


def test_a_beam_ends_at_end_of_sequence(llm, monkeypatch):
    """A candidate that ends the sequence is set aside (finish_reason "stop", not grown
    further), ranked by vLLM's score with the end token not counted, and its text leaves
    the end token out unless include_stop_str_in_output."""
    prompt = PROMPTS[0]
    [free] = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True))
    end = free.sequences[0].tokens[-1]  # the likeliest first token, made the end of sequence
    monkeypatch.setattr(llm, "eos_token_ids", {end})
    for include in (False, True):
        params = BeamSearchParams(beam_width=2, max_tokens=4, include_stop_str_in_output=include)
        [result] = llm.beam_search([prompt], params)
        ended = [beam for beam in result.sequences if beam.finish_reason == "stop"]
        assert [beam.tokens for beam in ended] == [prompt + [end]]
        assert ended[0].text == llm.tokenizer.decode(prompt + [end] if include else prompt)
        assert all(end not in beam.tokens[len(prompt):] for beam in result.sequences if beam.finish_reason == "length")
        scores = [beam_score(beam, 1.0, {end}) for beam in result.sequences]
        assert scores == sorted(scores, reverse=True)
        assert scores[result.sequences.index(ended[0])] == ended[0].cum_logprob / len(prompt)


def test_bad_beam_search_parameters(llm):
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    for penalty in (float("nan"), 400, -17, True):
        with pytest.raises(ValueError, match=r"length_penalty must be a number in \[-16, 16\]"):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=penalty)
    for temperature in (float("inf"), 1e39, True, -1):  # at construction, not in beam_search
        with pytest.raises(ValueError, match="temperature must be a number >= 0"):
            BeamSearchParams(beam_width=2, max_tokens=4, temperature=temperature)
    for name in ("ignore_eos", "include_stop_str_in_output"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'x'"):
            BeamSearchParams(beam_width=2, max_tokens=4, **{name: "x"})
    with pytest.raises(ValueError, match="max_logprobs=20"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["hi"], {"beam_width": 2})
    with pytest.raises(ValueError, match="concurrency_limit must be None or an integer >= 1, got 0"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())


def test_beams_end_where_the_kv_cache_does(qwen3_ckpt):
    """A request may hold at most the whole cache's tokens (here 8 blocks of 16, less than
    max_model_len): beams that reach it end there ("length"), as generate's outputs do."""
    with LLM(str(qwen3_ckpt), **{**ENGINE, "num_kvcache_blocks": 8}) as small:
        [result] = small.beam_search([list(range(3, 103))], BeamSearchParams(beam_width=2, max_tokens=50,
                                                                            ignore_eos=True))
    assert [len(beam.tokens) for beam in result.sequences] == [128, 128]
    assert {beam.finish_reason for beam in result.sequences} == {"length"}
