"""SamplingParams.prompt_logprobs: every prompt token's logprob, rank and top alternatives
against transformers' log-softmax over a full forward pass of the prompt, whatever the
step shapes (chunked prefill, batches mixed with requests that do not ask, n > 1, the
prefix cache, preemption, tensor parallelism)."""
from __future__ import annotations

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.executor import prompt_logprobs as module
from nanovllm.testing.checkpoints import hf_greedy, hf_logits
from parity import make_llm, mixed_prompts, shared_prefix_prompts


def reference(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] log-softmax of the logits at each position (row i predicts token i + 1)."""
    return hf_logits(path, prompt).log_softmax(-1)


def assert_prompt_logprobs(path, prompt: list[int], got, top: int, tokenizer=None) -> None:
    assert len(got) == len(prompt) and got[0] is None
    expected = reference(path, prompt)
    for i in range(1, len(prompt)):
        row, token, entry = expected[i - 1], prompt[i], got[i]
        assert set(entry) == {token, *row.topk(top).indices.tolist()}, f"position {i}"
        for token_id, lp in entry.items():
            assert abs(lp.logprob - row[token_id].item()) < 1e-4, f"position {i}"
            assert lp.rank == int((row > row[token_id]).sum()) + 1
            if tokenizer is not None:
                assert lp.decoded_token == tokenizer.decode([token_id])


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    with make_llm(qwen3_ckpt) as engine:
        yield engine


def test_prompt_logprobs_equal_transformers(llm, qwen3_ckpt):
    prompts = mixed_prompts(llm.vocab_size, 16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs(qwen3_ckpt, prompt, out.prompt_logprobs, 3, llm.tokenizer)
    # The completions are what they are without prompt logprobs.
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 4, ignore_eos=True)
    [out] = llm.generate([prompts[5]], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
    [plain] = llm.generate([prompts[5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain.prompt_logprobs is None


def test_mixed_batches_n_and_the_prefix_cache(llm, qwen3_ckpt):
    """Requests with and without prompt logprobs in one batch; a request with n = 3 computes
    them once; a prompt the cache holds is computed again for them (no hits), and its
    blocks still serve a request that does not ask."""
    manager = llm.scheduler.block_manager
    prompts = shared_prefix_prompts(llm.vocab_size, 16)[:4]
    asking = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts, plain, use_tqdm=False)  # the cache holds their prefix now
    hits, queried = manager.num_prompt_tokens_hit, manager.num_prompt_tokens_queried
    outputs = llm.generate(prompts, [asking, plain, asking, plain], use_tqdm=False)
    assert manager.num_prompt_tokens_hit - hits == sum((len(p) - 1) // 16 * 16 for p in prompts[1::2])
    assert manager.num_prompt_tokens_queried - queried == sum(map(len, prompts[1::2]))  # those that looked
    for prompt, out in zip(prompts[::2], outputs[::2]):
        assert_prompt_logprobs(qwen3_ckpt, prompt, out.prompt_logprobs, 2)
    assert outputs[1].prompt_logprobs is None
    [out] = llm.generate([prompts[0]], SamplingParams(n=3, temperature=1.0, max_tokens=3, seed=1, prompt_logprobs=1),
                         use_tqdm=False)
    assert len(out.outputs) == 3
    assert_prompt_logprobs(qwen3_ckpt, prompts[0], out.prompt_logprobs, 1)
    assert llm.is_finished() and manager.num_used_blocks == 0


@pytest.mark.parametrize("scenario", ["chunked", "preempted", "slices", "tp2"])
def test_prompt_logprobs_under_every_step_shape(qwen3_ckpt, scenario, monkeypatch):
    """chunked: prompts split over prefill steps of 24 tokens; preempted: a cache too small
    for the batch recomputes sequences; slices: the LM head over a few rows at a time;
    tp2: two ranks, rank 0 gathering the vocabulary slices."""
    args = dict(chunked=dict(max_num_batched_tokens=24, max_num_seqs=4, max_model_len=128),
                preempted=dict(num_kvcache_blocks=12, max_model_len=128), slices={},
                tp2=dict(tensor_parallel_size=2))[scenario]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    with make_llm(qwen3_ckpt, **args) as llm:
        if scenario == "slices":
            monkeypatch.setattr(module, "SLICE_BYTES", 4 * 3 * llm.vocab_size)  # 3 rows a slice
        prompts = mixed_prompts(llm.vocab_size, 16, seed=3)[4:8]  # 17 to 53 tokens
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if scenario == "preempted":
            assert llm.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs(qwen3_ckpt, prompt, out.prompt_logprobs, 2)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 24, ignore_eos=True)


def test_bad_prompt_logprobs_are_refused(llm):
    for value in (-2, 1.5, "2"):
        with pytest.raises(ValueError, match="prompt_logprobs must be None, an integer >= 0, or -1"):
            SamplingParams(prompt_logprobs=value)
    with pytest.raises(ValueError, match=r"prompt_logprobs \(21\) exceeds max_logprobs \(20\)"):
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=21), use_tqdm=False)


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda_with_graphs(qwen3_ckpt):
    """On a GPU: prefill graphs give the hidden states, the Triton kernels the attention."""
    prompts = mixed_prompts(384, 16, seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3)
    with make_llm(qwen3_ckpt, device="cuda") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["prefill_graph_replays"] > 0
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs(qwen3_ckpt, prompt, out.prompt_logprobs, 3)
