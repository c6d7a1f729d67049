"""Decode steps through the decode graphs' static buffers (executor/cuda_graph.py). On CPU
each bucket is plain calls over the same buffers, padding and static context that a CUDA
graph replays (test_gpu.py replays real graphs): greedy output still matches transformers,
and the sampling graph draws the tokens that the eager sampler draws."""
from __future__ import annotations

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.executor.step import ForwardOutput
from nanovllm.sampling.sampler import SamplingTensors
from parity import (INTERPRETER_ONLY, assert_matches_hf, make_llm, mixed_prompts, shared_prefix_prompts,
                    use_decode_graphs)


@pytest.mark.parametrize("scenario", ["roomy", "preemption"])
def test_decode_graphs_match_hf(tiny_ckpt, scenario):
    """Batches of 8 rows, then of 3 (the prefix-cache pass) padded to bucket 4; with
    preemption the batch changes size and members from step to step (1, 2, 3, 5, 6 rows:
    buckets 1, 2, 4, 8). Served twice: the second time from the prefix cache."""
    blocks = dict(roomy=128, preemption=12)[scenario]
    with make_llm(tiny_ckpt, max_num_seqs=8, num_kvcache_blocks=blocks) as llm:
        replays = use_decode_graphs(llm)
        assert llm.executor.runner.graph_runner.buckets == [1, 2, 4, 8]
        prompts = shared_prefix_prompts(llm.vocab_size, 16)[:3] + mixed_prompts(llm.vocab_size, 16, seed=3)[:5]
        assert_matches_hf(llm, tiny_ckpt, prompts)
        assert_matches_hf(llm, tiny_ckpt, prompts[:3])
        assert (3, 4) in replays and all(bucket >= rows for rows, bucket in replays)
        if scenario == "preemption":
            assert llm.scheduler.num_preemptions > 0 and len({bucket for _, bucket in replays}) >= 3
        assert llm.stats()["graph_replays"] == len(replays)
        assert llm.scheduler.block_manager.num_used_blocks == 0


def test_sampling_graph_draws_what_the_eager_sampler_draws(qwen3_ckpt):
    """Seeded temperature sampling (the sampling graph's fast path), with one temperature
    and with each row's own (greedy rows among them: each row's temperature and key travel
    in the packed inputs), and top-k (the logits taken to the full sampler): the same
    tokens with the graphs as without."""
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              [SamplingParams(temperature=t, seed=9 + i, max_tokens=12, ignore_eos=True)
               for i, t in enumerate([0.0, 0.3, 1.7, 0.8, 0.0])],
              SamplingParams(temperature=0.8, top_k=5, seed=8, max_tokens=12, ignore_eos=True)]
    with make_llm(qwen3_ckpt, max_num_seqs=8) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16, seed=4)[:5]
        runs = []
        for graphs in (False, True):
            if graphs:
                use_decode_graphs(llm)
            runs.append([[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params])
        assert runs[0] == runs[1]
        assert llm.stats()["graph_replays"] > 0
        # Tensors prepared for a graph that samples (host arrays only) refuse an eager draw.
        with pytest.raises(ValueError, match="graph_samples=False"):
            llm.executor.runner.sample([], SamplingTensors(None, in_graph=True), ForwardOutput(torch.zeros(1, llm.vocab_size)))


@INTERPRETER_ONLY
def test_decode_graphs_with_the_triton_kernels_match_hf(qwen3_ckpt):
    """The Triton backend through the static buffers: decode attention with rotary_store
    inside it, the GEMV kernels, the sampling kernel, padding rows included."""
    with make_llm(qwen3_ckpt, max_num_seqs=4, attention_backend="triton", num_kvcache_blocks=32) as llm:
        use_decode_graphs(llm)
        assert_matches_hf(llm, qwen3_ckpt, mixed_prompts(llm.vocab_size, 16, seed=6)[:3])
        assert llm.stats()["graph_padding_ratio"] > 0


@INTERPRETER_ONLY
def test_decode_graphs_with_rotary_store_apart_match_hf(qwen3_ckpt, monkeypatch):
    """Steps of more rows than decode_attention_rotary takes: rotary_store, then decode
    attention on its own (ROTARY_MAX_BATCH 0 sends every step there), padding rows in the buckets."""
    import nanovllm.layers.triton_attention as backend

    monkeypatch.setattr(backend, "ROTARY_MAX_BATCH", 0)
    with make_llm(qwen3_ckpt, max_num_seqs=4, attention_backend="triton", num_kvcache_blocks=32) as llm:
        use_decode_graphs(llm)
        assert_matches_hf(llm, qwen3_ckpt, mixed_prompts(llm.vocab_size, 16, seed=6)[4:7])
        assert llm.stats()["graph_padding_ratio"] > 0
