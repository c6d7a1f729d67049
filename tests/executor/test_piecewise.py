"""Steps with prompt tokens through the prefill graphs' pieces (executor/piecewise.py). On
CPU the pieces are plain calls over the same static buffers, padding and order that the
CUDA graphs replay (test_gpu.py replays them on a GPU): greedy output still matches
transformers."""
from __future__ import annotations

import pytest

from nanovllm import SamplingParams
from nanovllm.executor.piecewise import prefill_graph_buckets
from nanovllm.testing.checkpoints import hf_greedy
from parity import INTERPRETER_ONLY, MAX_TOKENS, assert_matches_hf, make_llm, mixed_prompts, shared_prefix_prompts


def test_buckets_double_then_step_by_256():
    assert prefill_graph_buckets(0) == []
    assert prefill_graph_buckets(24) == [16, 32]
    assert prefill_graph_buckets(256) == [16, 32, 64, 128, 256]
    assert prefill_graph_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1008]
    buckets = prefill_graph_buckets(4096)
    assert buckets[:5] == [16, 32, 64, 128, 256] and buckets[-1] == 4096 and len(buckets) == 20
    assert all(b - a == 256 for a, b in zip(buckets[4:], buckets[5:]))


def test_negative_size_is_refused(qwen3_ckpt):
    with pytest.raises(ValueError, match="max_prefill_graph_tokens must be an integer >= 0"):
        make_llm(qwen3_ckpt, max_prefill_graph_tokens=-1)


def test_pieces_match_hf(tiny_ckpt):
    """Chunked prompts, chunks mixed into decode steps, prefix-cache hits; steps of up to 32
    tokens take the pieces (padded to 16 or 32), larger ones the eager model."""
    with make_llm(tiny_ckpt, max_num_batched_tokens=48, max_num_seqs=8, max_prefill_graph_tokens=32) as llm:
        prompts = shared_prefix_prompts(llm.vocab_size, 16)[:4] + mixed_prompts(llm.vocab_size, 16, seed=9)
        assert_matches_hf(llm, tiny_ckpt, prompts)
        assert_matches_hf(llm, tiny_ckpt, prompts[:4])  # served from the prefix cache
        stats = llm.stats()
        assert 0 < stats["prefill_graph_replays"] < stats["prefill_steps"]
        assert stats["prefill_graph_padding_ratio"] > 0
        assert llm.scheduler.block_manager.num_used_blocks == 0


@INTERPRETER_ONLY
def test_pieces_with_triton_attention_match_hf(qwen3_ckpt):
    """The Triton backend between the pieces (the fused rotary-and-store kernel, paged
    prefill attention), with requests arriving while others decode: every step with
    prompt tokens goes through the pieces, decoding sequences' pending tokens included."""
    with make_llm(qwen3_ckpt, max_num_batched_tokens=24, max_num_seqs=8, attention_backend="triton",
                  max_prefill_graph_tokens=24) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16, seed=5)[:6]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        requests = [llm.make_request(p, params) for p in prompts]
        for request in requests:  # one new request per step
            llm.add_request(request)
            llm.step()
        while not all(r.finished for r in requests):
            llm.step()
        stats = llm.stats()
        assert stats["prefill_graph_replays"] == stats["prefill_steps"] > 0
        assert stats["prefill_step_decode_tokens"] > 0
        assert [r.seqs[0].completion_token_ids for r in requests] == hf_greedy(qwen3_ckpt, prompts, MAX_TOKENS)
