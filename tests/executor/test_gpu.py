"""The engine on CUDA: each attention backend, CUDA graphs and torch.compile against the
transformers oracle (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.triton_attention import TritonAttentionBackend
from nanovllm.testing.checkpoints import hf_greedy
from parity import (
    MAX_TOKENS, TIE_TOLERANCE, assert_differs_only_at_ties, generate_twice, looping_prompts, mixed_prompts,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.gpu

SCENARIOS = {
    "roomy": dict(num_kvcache_blocks=256),
    "prefix_cache": dict(num_kvcache_blocks=256),
    "preemption": dict(num_kvcache_blocks=10),
    "chunked_prefill": dict(num_kvcache_blocks=256, max_num_batched_tokens=24, max_num_seqs=8),
    # Every step with prompt tokens (chunks mixed into decode steps too) replays piecewise graphs.
    "prefill_graphs": dict(num_kvcache_blocks=256, max_num_batched_tokens=24, max_num_seqs=8,
                           max_prefill_graph_tokens=24),
    # Drafts verified in steps that replay the decode graphs, a row per token (engine/speculative.py).
    "speculative": dict(num_kvcache_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 1}),
    # The model as its own draft (speculative_config's "model" set in gpu_llm): the draft's
    # varlen step and decode graphs, then verification (engine/speculative.py, executor/draft.py).
    "draft_model": dict(num_kvcache_blocks=256),
}


def scenario_prompts(name: str, vocab_size: int) -> list[list[int]]:
    if name == "prefix_cache":
        return shared_prefix_prompts(vocab_size, 16)
    if name == "speculative":
        return looping_prompts(vocab_size)
    prompts = mixed_prompts(vocab_size, 16)
    return [p[:40] for p in prompts] if name == "preemption" else prompts


def gpu_llm(path, dtype: str, backend: str, scenario: str) -> LLM:
    if backend == "triton" and "llama" in path.name:
        pytest.skip("the llama fixture's head_dim 8 is below the Triton kernels' 16")
    args = dict(SCENARIOS[scenario])
    if scenario == "draft_model":
        args["speculative_config"] = {"model": str(path), "num_speculative_tokens": 3}
    return LLM(str(path), device="cuda", dtype=dtype, kvcache_block_size=16, max_model_len=512,
               attention_backend=backend, **args)


@pytest.mark.parametrize("dtype", list(TIE_TOLERANCE))
@pytest.mark.parametrize("backend", ["torch", "triton", "triton_precompiled"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_hf_with_graphs(tiny_ckpt, backend, scenario, dtype, monkeypatch):
    if backend == "torch":  # torch's attention with cuBLAS projections throughout (no GEMV kernel)
        monkeypatch.setenv("NANOVLLM_GEMV", "0")
    precompiled = backend == "triton_precompiled"
    if precompiled:  # the kernels compiled on a thread pool before capture (kernels/launch.py)
        monkeypatch.setenv("NANOVLLM_PRECOMPILE", "1")
        backend = "triton"
    if "moe" in tiny_ckpt.name and dtype == "bfloat16":
        # A router in bf16 picks other experts than the fp32 oracle wherever two are near
        # a tie, which moves the output by far more than a tie in the final logits. MoE in
        # bf16 is checked by test_graph_replay_equals_eager and the kernel's bf16 tests.
        pytest.skip("bf16 routing flips are not logit ties")
    with gpu_llm(tiny_ckpt, dtype, backend, scenario) as llm:
        prompts = scenario_prompts(scenario, llm.vocab_size)
        got = generate_twice(llm, prompts)
        stats = llm.stats()
        assert stats["graph_replays"] > 0
        assert ("precompile_s" in llm.executor.runner.timings) == precompiled
        if scenario == "prefill_graphs":
            assert stats["prefill_graph_replays"] == stats["prefill_steps"] > 0
        if scenario == "preemption":
            assert llm.scheduler.num_preemptions > 0
        if scenario in ("speculative", "draft_model"):
            assert stats["spec_decode_num_drafts"] > 0 and stats["prefill_graph_replays"] > 0
            assert llm.executor.runner.graph_runner.num_multi_row_replays > 0
        if scenario == "draft_model":
            assert stats["spec_decode_num_accepted_tokens"] > 0
            assert llm.executor.runner.drafter.graphs.num_replays > 0
    expected = hf_greedy(tiny_ckpt, prompts, MAX_TOKENS, ignore_eos=True)
    assert_differs_only_at_ties(tiny_ckpt, prompts, got, expected, TIE_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "qwen3_moe_ckpt"])
def test_graph_replay_equals_eager(request, ckpt, dtype):
    """The same decode batch through the captured graph and through the eager model (for
    Qwen3-MoE, the fused MoE kernels inside the graph)."""
    with LLM(str(request.getfixturevalue(ckpt)), device="cuda", dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=256,
             max_model_len=512) as llm:
        runner = llm.executor.runner
        prompts = mixed_prompts(llm.vocab_size, 16)[:5]  # batch 5 replays the bucket-8 graph
        requests = [llm.make_request(p, SamplingParams(temperature=0, max_tokens=4)) for p in prompts]
        for request in requests:
            llm.add_request(request)
        while True:  # prefill everything, then stop at the first decode batch
            batch, is_prefill = llm.scheduler.schedule()
            if not is_prefill:
                break
            tokens = runner.launch(batch, True).token_ids()
            finished = llm.output_processor.process(batch, tokens, llm.scheduler.on_launch(batch), None)
            llm.scheduler.update(batch, finished)
        assert runner.graph_runner.bucket_for(len(batch)) == 8
        sampling = runner.sampling.prepare(batch, graph_samples=True)  # greedy: the graph samples the argmax
        graph_logits, graph_tokens, _ = runner.forward(batch, False, sampling=sampling)
        graph_runner, runner.graph_runner = runner.graph_runner, None
        try:
            eager_logits = runner.forward(batch, False).logits
        finally:
            runner.graph_runner = graph_runner
        assert torch.equal(graph_tokens, eager_logits.argmax(-1))
        rel = ((graph_logits.float() - eager_logits.float()).norm() / eager_logits.float().norm()).item()
        assert rel < (1e-5 if dtype == "float32" else 1e-2)
        assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "qwen3_moe_ckpt"])
@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "whole"])
def test_prefill_graph_pieces_equal_eager(request, ckpt, dtype, whole, monkeypatch):
    """The same prefill step (six prompts, bucket 128) through the captured pieces (or one
    whole graph, attention included) twice and through the eager model: the same logits."""
    if not whole:  # the pieces, as for a backend that cannot run attention inside a graph
        monkeypatch.setattr(TritonAttentionBackend, "captures_prefill", lambda self: False)
    with LLM(str(request.getfixturevalue(ckpt)), device="cuda", dtype=dtype, kvcache_block_size=16,
             num_kvcache_blocks=256, max_model_len=512, max_prefill_graph_tokens=256) as llm:
        runner = llm.executor.runner
        assert runner.prefill_graphs.capture_attention == whole
        prompts = mixed_prompts(llm.vocab_size, 16)[:6]  # 1 to 32 tokens: 83 in all, bucket 128
        for p in prompts:
            llm.add_request(llm.make_request(p, SamplingParams(temperature=0, max_tokens=4)))
        batch, is_prefill = llm.scheduler.schedule()
        assert is_prefill and runner.prefill_graphs.can_run(sum(s.num_scheduled_tokens for s in batch))
        # The cache gets each token's K/V again on every run: the same values at the same slots.
        pieces = [runner.forward(batch, True)[0] for _ in range(2)]
        graphs, runner.prefill_graphs = runner.prefill_graphs, None
        try:
            eager = runner.forward(batch, True).logits
        finally:
            runner.prefill_graphs = graphs
        assert graphs.num_replays == 2 and graphs.num_padded_tokens == 2 * (128 - 83)
        assert torch.equal(pieces[0], pieces[1])
        rel = ((pieces[0].float() - eager.float()).norm() / eager.float().norm()).item()
        assert rel < (1e-5 if dtype == "float32" else 1e-2)
        assert torch.equal(pieces[0].argmax(-1), eager.argmax(-1))


def test_two_engines_side_by_side_share_the_gpu(qwen3_ckpt):
    """Each engine sizes its KV cache from its own gpu_memory_utilization share of the
    device, whatever the other already holds; both serve, and both shut down."""
    prompts = mixed_prompts(256, 16)[:4]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16, max_model_len=256)
    with LLM(str(qwen3_ckpt), **engine) as first, LLM(str(qwen3_ckpt), **engine) as second:
        total = torch.cuda.mem_get_info()[1]
        for llm in (first, second):
            cache_bytes = llm.num_kvcache_blocks * llm.executor.runner.kv_bytes_per_block()
            assert 0.2 * total < cache_bytes < 0.3 * total
        outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                   for llm in (first, second)]
    assert outputs[0] == outputs[1] == hf_greedy(qwen3_ckpt, prompts, MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_speculation_under_penalties_and_constraints_on_cuda(qwen3_ckpt, backend):
    """float32 on the GPU, graphs on: penalties (the Triton kernel, then the tokens among a
    row's drafts penalized again), min_tokens and logit_bias under n-gram drafts verified in
    the decode graphs: plain decoding's tokens."""
    prompts = looping_prompts(384)[:4]
    base = dict(temperature=0.3, seed=7, max_tokens=32, ignore_eos=True)
    params = [SamplingParams(**base, repetition_penalty=1.3),
              SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(**base, min_tokens=16, logit_bias={5: 1.0}),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=0.9)]
    outputs = []
    for speculative in (None, SCENARIOS["speculative"]["speculative_config"]):
        with LLM(str(qwen3_ckpt), device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256,
                 max_model_len=512, attention_backend=backend, speculative_config=speculative) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            if speculative is not None:
                assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
                assert llm.executor.runner.graph_runner.num_multi_row_replays > 0
    assert outputs[0] == outputs[1]
