"""Steps with prompt tokens through the prefill graphs' pieces (executor/piecewise.py). On
CPU the pieces are plain calls over the same static buffers, padding and order that the
CUDA graphs replay (test_gpu.py replays them on a GPU): greedy output still matches
transformers."""
from __future__ import annotations

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.executor.piecewise import PrefillGraphRunner, prefill_graph_buckets
from nanovllm.layers.triton_attention import TritonAttentionBackend
from nanovllm.testing.checkpoints import hf_greedy
from parity import (
    INTERPRETER_ONLY, MAX_TOKENS, assert_matches_hf, generate_twice, make_llm, mixed_prompts, shared_prefix_prompts,
)


def test_buckets_double_then_step_by_256_512_1024():
    assert prefill_graph_buckets(0) == []
    assert prefill_graph_buckets(24) == [16, 32]
    assert prefill_graph_buckets(256) == [16, 32, 64, 128, 256]
    assert prefill_graph_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1008]
    buckets = prefill_graph_buckets(16384)
    assert buckets[:5] == [16, 32, 64, 128, 256] and buckets[-1] == 16384
    steps = {b: b - a for a, b in zip(buckets, buckets[1:])}
    assert {steps[b] for b in buckets[5:] if b <= 2048} == {256}
    assert {steps[b] for b in buckets if 2048 < b <= 4096} == {512}
    assert {steps[b] for b in buckets if b > 4096} == {1024}


def test_negative_size_is_refused(qwen3_ckpt):
    with pytest.raises(ValueError, match="max_prefill_graph_tokens must be an integer >= -1"):
        make_llm(qwen3_ckpt, max_prefill_graph_tokens=-2)


def test_pieces_match_hf(tiny_ckpt):
    """Chunked prompts, chunks mixed into decode steps, prefix-cache hits; steps of up to 32
    tokens take the pieces (padded to 16 or 32), larger ones the eager model. The static
    buffers start as NaNs: no real row ever reads a padding row (for Qwen3-MoE, the routing
    and expert kernels included)."""
    with make_llm(tiny_ckpt, max_num_batched_tokens=48, max_num_seqs=8, max_prefill_graph_tokens=32) as llm:
        pieces = llm.executor.runner.prefill_graphs
        for buffer in (pieces.qkv, pieces.attn_out, pieces.residual, pieces.hidden):
            buffer.fill_(float("nan"))
        prompts = shared_prefix_prompts(llm.vocab_size, 16)[:4] + mixed_prompts(llm.vocab_size, 16, seed=9)
        assert_matches_hf(llm, tiny_ckpt, prompts)
        assert_matches_hf(llm, tiny_ckpt, prompts[:4])  # served from the prefix cache
        stats = llm.stats()
        assert 0 < stats["prefill_graph_replays"] < stats["prefill_steps"]
        assert stats["eager_prefill_steps"] == stats["prefill_steps"] - stats["prefill_graph_replays"]
        assert stats["prefill_graph_padding_ratio"] > 0
        assert llm.scheduler.block_manager.num_used_blocks == 0
        assert stats["prefix_cache_hits"] > 0
        llm.reset_stats()
        stats = llm.stats()
        assert stats["prefill_graph_replays"] == 0 and pieces.num_padded_tokens == 0
        assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0


def test_start_up_prefills_run_before_the_pieces_exist(qwen3_ckpt, monkeypatch):
    """On CUDA the runner runs prefills while it is built (the memory profile, the paged
    prefill warm-up), before it captures the pieces: those run eagerly. Here the warm-up
    runs on CPU at the same point."""
    allocate = ModelRunner._allocate_kv_cache

    def allocate_then_warm_up(self, memory_used_before):
        self.num_kvcache_blocks = allocate(self, memory_used_before)
        self._warm_up_paged_prefill()
        return self.num_kvcache_blocks

    monkeypatch.setattr(ModelRunner, "_allocate_kv_cache", allocate_then_warm_up)
    with make_llm(qwen3_ckpt, max_prefill_graph_tokens=64) as llm:
        assert llm.executor.runner.prefill_graphs.num_replays == 0
        assert_matches_hf(llm, qwen3_ckpt, mixed_prompts(llm.vocab_size, 16, seed=2)[:4])
        assert llm.stats()["prefill_graph_replays"] > 0


def test_pieces_with_an_fp8_cache_equal_eager(qwen3_ckpt):
    """An FP8 KV cache (stored and read back through the paged path) behind the pieces:
    the tokens the eager engine gives, fresh prompts and prefix-cache hits alike."""
    runs = []
    for tokens in (0, 32):
        with make_llm(qwen3_ckpt, kv_cache_dtype="fp8", max_num_batched_tokens=48, max_num_seqs=8,
                      max_prefill_graph_tokens=tokens) as llm:
            runs.append(generate_twice(llm, shared_prefix_prompts(llm.vocab_size, 16)[:4]))
            assert (llm.stats()["prefill_graph_replays"] > 0) == (tokens > 0)
    assert runs[0] == runs[1]


def test_auto_size_is_off_without_cuda_graphs(qwen3_ckpt):
    with make_llm(qwen3_ckpt) as llm:
        assert llm.config.max_prefill_graph_tokens == -1 and llm.executor.runner.prefill_graphs is None


@INTERPRETER_ONLY
@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "whole"])
def test_triton_attention_in_prefill_graphs_matches_hf(qwen3_ckpt, monkeypatch, whole):
    """The Triton backend between the pieces (the fused rotary-and-store kernel, paged
    prefill attention), or inside whole graphs over a static context (its grid searched
    by tile), with requests arriving while others decode: every step with prompt tokens
    goes through the graphs, decoding sequences' pending tokens included. The whole
    graphs' buffers start as NaNs: padding rows and padding sequences reach no real row."""
    if not whole:  # the pieces, as for a backend that cannot run attention inside a graph
        monkeypatch.setattr(TritonAttentionBackend, "captures_prefill", lambda self: False)
    if whole:  # each replay also against the eager model on the step's own context
        replay = PrefillGraphRunner.run

        def run_and_compare(self, input_ids, positions):
            expected = llm.executor.runner.model.model(input_ids, positions).clone()
            hidden = replay(self, input_ids, positions)
            torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
            return hidden

        monkeypatch.setattr(PrefillGraphRunner, "run", run_and_compare)
    with make_llm(qwen3_ckpt, max_num_batched_tokens=24, max_num_seqs=8, attention_backend="triton",
                  max_prefill_graph_tokens=24) as llm:
        graphs = llm.executor.runner.prefill_graphs
        assert graphs.capture_attention == whole
        if whole:
            for buffer in (graphs.attn_out, graphs.hidden):
                buffer.fill_(float("nan"))
            # Stale context that would attend rows 0, 1, ... again and store the padding
            # rows' keys over the first slots, were it read or not replaced on every step.
            for buffer in (graphs.cu_seqlens_q, graphs.cu_seqlens_k, graphs.slot_mapping, graphs.positions):
                buffer.copy_(torch.arange(buffer.numel()))
            graphs.block_tables.fill_(0)
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


def test_until_captured_the_pieces_do_not_run(qwen3_ckpt, monkeypatch):
    """On CUDA the paged-prefill warm-up runs after the runner is built but before it
    captures (kernels/launch.py's pre-compile pass walks the runner in between): until
    then every prefill takes the eager path; after release, too."""
    capture, seen = PrefillGraphRunner.capture, []

    def checking_capture(self, pool=None):
        seen.append(self.can_run(16))
        capture(self, pool)

    monkeypatch.setattr(PrefillGraphRunner, "capture", checking_capture)
    with make_llm(qwen3_ckpt, max_prefill_graph_tokens=64) as llm:
        pieces = llm.executor.runner.prefill_graphs
        assert seen == [False] and pieces.can_run(16)
        assert_matches_hf(llm, qwen3_ckpt, mixed_prompts(llm.vocab_size, 16, seed=3)[:2])
    assert not pieces.can_run(16)
