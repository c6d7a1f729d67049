"""Greedy generation matches Hugging Face transformers token for token (float32, CPU)."""
from __future__ import annotations

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine import scheduler as scheduler_module
from nanovllm.testing.checkpoints import hf_greedy, hf_logits
from parity import MAX_TOKENS, assert_matches_hf, make_llm, mixed_prompts, shared_prefix_prompts

@pytest.mark.parametrize("block_size", [8, 16])
def test_roomy_pool_matches_hf(tiny_ckpt, block_size):
    with make_llm(tiny_ckpt, kvcache_block_size=block_size) as llm:
        prompts = mixed_prompts(llm.vocab_size, block_size)
        assert_matches_hf(llm, tiny_ckpt, prompts)
        assert llm.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("fixture", ["llama_tied_ckpt", "qwen3_sharded_ckpt"])
def test_tied_and_sharded_checkpoints_match_hf(request, fixture):
    path = request.getfixturevalue(fixture)
    with make_llm(path) as llm:
        assert_matches_hf(llm, path, mixed_prompts(llm.vocab_size, 16, seed=3))


def test_eos_stops_generation(qwen3_ckpt):
    with make_llm(qwen3_ckpt) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16, seed=5)
        # Make every prompt's own greedy next token its end-of-sequence token.
        first = [ref[0] for ref in hf_greedy(qwen3_ckpt, prompts, 1, ignore_eos=True)]
        llm.output_processor.eos_token_ids = {first[0]}
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        stopped = outputs[0].outputs[0]
        assert stopped.token_ids == [first[0]] and stopped.finish_reason == "stop"
        for out in outputs[1:]:
            tokens = out.outputs[0].token_ids
            assert first[0] not in tokens[:-1]
            assert out.outputs[0].finish_reason == ("stop" if tokens[-1] == first[0] else "length")


@pytest.mark.parametrize("block_size", [8, 16])
def test_prefix_cache_hits_match_hf(tiny_ckpt, block_size):
    with make_llm(tiny_ckpt, kvcache_block_size=block_size) as llm:
        prompts = shared_prefix_prompts(llm.vocab_size, block_size)
        assert_matches_hf(llm, tiny_ckpt, prompts)
        manager = llm.scheduler.block_manager
        hits_first = manager.num_prompt_tokens_hit
        assert_matches_hf(llm, tiny_ckpt, prompts)  # the same call again: served from cache
        hits_second = manager.num_prompt_tokens_hit - hits_first
        # Every prompt but the last token's block comes from the cache the second time.
        assert hits_second == sum((len(p) - 1) // block_size * block_size for p in prompts)
        assert manager.num_used_blocks == 0


def test_preemption_matches_hf(tiny_ckpt):
    # 16 blocks of 8 tokens: the batch cannot all decode at once.
    with make_llm(tiny_ckpt, kvcache_block_size=8, num_kvcache_blocks=16) as llm:
        prompts = mixed_prompts(llm.vocab_size, 8, seed=7, count=8)
        prompts = [p[:40] for p in prompts]
        assert_matches_hf(llm, tiny_ckpt, prompts)
        stats = llm.stats()
        assert stats["preemptions"] == llm.scheduler.num_preemptions > 0
        assert llm.scheduler.block_manager.num_used_blocks == 0
        # Each sampled token but a sequence's last is decoded once; what a preempted sequence
        # computes again is prefill work.
        assert stats["decode_tokens"] + stats["prefill_step_decode_tokens"] == len(prompts) * (MAX_TOKENS - 1)
        assert stats["prefill_tokens"] > sum(map(len, prompts))
        llm.reset_stats()  # as the benchmarks do after their warm-up
        stats = llm.stats()
        assert stats["preemptions"] == stats["decode_steps"] == stats["prefix_cache_queries"] == 0


def test_chunked_prefill_matches_hf(tiny_ckpt):
    # A token budget of 24 is smaller than the longest prompt (64 tokens).
    with make_llm(tiny_ckpt, max_num_batched_tokens=24, max_num_seqs=8) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16, seed=9)
        assert max(map(len, prompts)) > 24
        assert_matches_hf(llm, tiny_ckpt, prompts)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="on CUDA machines test_gpu.py runs the Triton backend for real"))])
def test_requests_arriving_mid_generation_share_steps_and_match_hf(qwen3_ckpt, backend):
    """Requests added while others decode are prefilled in the same steps as the others'
    decode tokens, which are often still pending on the host (the engine launches a step
    before it reads the one before): every output still matches transformers."""
    with make_llm(qwen3_ckpt, max_num_batched_tokens=24, max_num_seqs=8, attention_backend=backend) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16, seed=5, count=7)  # 1 to 53 tokens
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        requests = [llm.make_request(p, params) for p in prompts]
        schedule, mixed = llm.scheduler.schedule, []

        def spy():
            seqs, is_prefill = schedule()
            decoding = [s for s in seqs if s.num_completion_tokens and s.num_scheduled_tokens == 1]
            mixed.append(is_prefill and bool(decoding) and len(decoding) < len(seqs))
            return seqs, is_prefill

        llm.scheduler.schedule = spy
        for request in requests:  # one new request per step
            llm.add_request(request)
            llm.step()
        while not all(r.finished for r in requests):
            llm.step()
        assert sum(mixed) >= 3
        stats = llm.stats()
        assert stats["prefill_step_decode_tokens"] > 0
        assert sum(map(len, prompts)) - len(prompts) <= stats["prefill_tokens"] <= sum(map(len, prompts))
        expected = hf_greedy(qwen3_ckpt, prompts, MAX_TOKENS)
        assert [r.seqs[0].completion_token_ids for r in requests] == expected


def test_decode_rows_longest_first_match_hf(qwen3_ckpt, monkeypatch):
    """Each step's decode rows ordered by length, longest first (engine/scheduler.py's
    DECODE_LONGEST_FIRST, the default; set here whatever the environment says), so rows
    change places between steps while their last tokens are often still pending on the
    host: every output still matches transformers."""
    monkeypatch.setattr(scheduler_module, "DECODE_LONGEST_FIRST", True)
    with make_llm(qwen3_ckpt, max_num_seqs=8) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16, seed=5, count=7)
        schedule, steps = llm.scheduler.schedule, []

        def spy():
            seqs, is_prefill = schedule()
            if not is_prefill:
                steps.append([(len(s), s.seq_id) for s in seqs])
            return seqs, is_prefill

        llm.scheduler.schedule = spy
        assert_matches_hf(llm, qwen3_ckpt, prompts)
    assert steps and all([n for n, _ in rows] == sorted((n for n, _ in rows), reverse=True) for rows in steps)
    assert any([i for _, i in rows] != sorted(i for _, i in rows) for rows in steps)  # not admission order


def test_prefill_logits_match_hf(tiny_ckpt):
    """Each prefix of a prompt is its own sequence, so the batch's last-token logits are
    the full-sequence logits of the prompt."""
    with make_llm(tiny_ckpt) as llm:
        prompt = mixed_prompts(llm.vocab_size, 16, seed=11)[6]
        requests = [llm.make_request(prompt[: n + 1], SamplingParams(temperature=0)) for n in range(len(prompt))]
        for request in requests:
            llm.add_request(request)
        seqs = [request.seqs[0] for request in requests]
        scheduled, is_prefill = llm.scheduler.schedule()
        assert is_prefill and scheduled == seqs
        logits = llm.executor.runner.forward(scheduled, True).logits
        expected = hf_logits(tiny_ckpt, prompt)
        rel = (logits - expected).norm() / expected.norm()
        assert rel < 1e-4
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA machines test_gpu.py runs the Triton backend for real")
# Qwen2 differs from Qwen3 outside the Triton kernels (q/k/v biases) and in the rotary
# kernels' QK_NORM=False path, which tests/kernels check against torch: slow.
@pytest.mark.parametrize("arch", ["qwen3", pytest.param("qwen2", marks=pytest.mark.slow), "qwen3_moe"])
def test_triton_backend_matches_hf(arch, request, monkeypatch):
    """The Triton kernels inside the engine, on CPU through the Triton interpreter: Qwen3's
    q/k norms and Qwen2's q/k/v biases through the fused rotary-and-store kernel,
    Qwen3-MoE's experts through the fused MoE kernels, and decode steps' projections
    through the GEMV kernel (the MLP's with SiLU-and-mul in it)."""
    from nanovllm.kernels import gemv, split_gemm
    from nanovllm.layers.linear import LinearBase

    calls = {False: 0, True: 0}

    def counted(x, weight, bias=None, gated=False, _gemv=gemv.gemv):
        calls[gated] += 1
        return _gemv(x, weight, bias, gated)

    monkeypatch.setattr(gemv, "gemv", counted)
    # One prompt: decode steps of one row, below where the split-K tiles take the MLP's gate_up.
    assert split_gemm.SPLIT_MIN_ROWS > 1
    ckpt = request.getfixturevalue(f"{arch}_ckpt")
    with make_llm(ckpt, attention_backend="triton", num_kvcache_blocks=32) as llm:
        assert all(layer.stores_rotated() for layer in llm.executor.runner.attention_layers)
        assert all(m.gemv_rows == gemv.GEMV_MAX_ROWS for m in llm.executor.runner.model.modules()
                   if isinstance(m, LinearBase))
        prompts = shared_prefix_prompts(llm.vocab_size, 16)[1:2]
        assert_matches_hf(llm, ckpt, prompts)
        assert_matches_hf(llm, ckpt, prompts)  # prefix-cache hits: the paged prefill kernel
        assert llm.scheduler.block_manager.num_prompt_tokens_hit > 0
    assert calls[False] > 0 and (calls[True] > 0 or arch == "qwen3_moe")


def count_split_gemm(monkeypatch, module, name: str) -> set[tuple[int, int]]:
    """Patch `module`'s `name` (kernels/split_gemm.py's split_gemm, wide_gemm.py's
    wide_split_gemm) to record each call's (weight's data pointer, rows), and SplitSum.dense
    to fail: every SplitSum must be summed by the kernel that reads it, never in torch.
    Returns the set it fills."""
    from nanovllm.kernels import split_gemm

    calls, original = set(), getattr(module, name)

    def counted(x, weight, descriptor, bias=None):
        calls.add((weight.data_ptr(), x.shape[0]))
        return original(x, weight, descriptor, bias)

    def dense(self):
        raise AssertionError("a SplitSum was summed in torch, not by the kernel that reads it")

    monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(split_gemm.SplitSum, "dense", dense)
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA machines test_gpu.py runs the Triton backend for real")
def test_split_gemm_in_the_engine_matches_hf(qwen3_ckpt, monkeypatch):
    """Decode batches of SPLIT_MIN_ROWS-64 rows (and prompt chunks that short) through
    kernels/split_gemm.py: q/k/v, o_proj, gate_up and down_proj hand their splits to
    rotary_store, the norms and SiLU-and-mul that read them (never summed in torch); tokens
    equal HF's. Nine prompts make decode steps past ROTARY_MAX_BATCH rows; three of them stop
    early, and the steps of six rows that follow take decode attention with rotary_store
    inside, which sums q/k/v's splits itself."""
    import nanovllm.layers.triton_attention as backend
    from nanovllm.kernels import gemv, split_gemm

    assert split_gemm.SPLIT_MIN_ROWS <= 6 <= min(backend.ROTARY_MAX_BATCH, gemv.GEMV_MAX_ROWS) < 9
    weights = count_split_gemm(monkeypatch, split_gemm, "split_gemm")
    # Prompt chunks of at most 64 tokens: the prompts' 183 tokens through the tiles too.
    with make_llm(qwen3_ckpt, attention_backend="triton", num_kvcache_blocks=64, max_num_batched_tokens=64,
                  max_num_seqs=16) as llm:
        layer = llm.executor.runner.model.model.layers[0]
        prompts = mixed_prompts(llm.vocab_size, 16, seed=3, count=6)
        prompts += shared_prefix_prompts(llm.vocab_size, 16, seed=4)[:3]
        lengths = [MAX_TOKENS] * 6 + [MAX_TOKENS // 2] * 3
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(qwen3_ckpt, prompts, MAX_TOKENS)
    assert [out.outputs[0].token_ids for out in outputs] == [ref[:n] for ref, n in zip(expected, lengths)]
    projections = {layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj}
    assert {(p.weight.data_ptr(), n) for p in projections for n in (9, 6)} <= weights  # layer 0's decode steps
    rows = [n for _, n in weights]
    assert rows and min(rows) >= split_gemm.SPLIT_MIN_ROWS and max(rows) <= split_gemm.SPLIT_MAX_ROWS


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA machines test_gpu.py runs the Triton backend for real")
def test_wide_split_tiles_in_the_engine_match_hf(qwen3_ckpt, monkeypatch):
    """Prompt chunks of 65-256 tokens through kernels/wide_gemm.py's tiles: o_proj and
    down_proj (outputs narrow beside their K) hand their splits to the norms that read them
    (never summed in torch), q/k/v and gate_up stay with torch; tokens equal HF's."""
    from nanovllm.kernels import wide_gemm

    weights = count_split_gemm(monkeypatch, wide_gemm, "wide_split_gemm")
    with make_llm(qwen3_ckpt, attention_backend="triton", num_kvcache_blocks=64, max_num_batched_tokens=256,
                  max_num_seqs=16) as llm:
        layer = llm.executor.runner.model.model.layers[0]
        prompts = mixed_prompts(llm.vocab_size, 16, seed=6)[4:]
        assert 64 < sum(map(len, prompts)) <= 256  # one prefill step, on the wide tiles
        assert_matches_hf(llm, qwen3_ckpt, prompts)
    assert all(wide_gemm.WIDE_MIN_ROWS <= rows <= wide_gemm.WIDE_MAX_ROWS for _, rows in weights)
    wide = {ptr for ptr, _ in weights}
    assert {layer.self_attn.o_proj.weight.data_ptr(), layer.mlp.down_proj.weight.data_ptr()} <= wide
    assert not {layer.self_attn.qkv_proj.weight.data_ptr(), layer.mlp.gate_up_proj.weight.data_ptr()} & wide


def test_the_cache_keeps_each_heads_tokens_together(qwen3_ckpt):
    """The cache's memory is [.., heads, tokens, dim] behind [blocks, tokens, heads, dim]
    views (the kernels also read tokens-outer memory through its strides: tests/kernels)."""
    with make_llm(qwen3_ckpt, num_kvcache_blocks=48) as llm:
        k_cache = llm.executor.runner.attention_layers[0].k_cache
        assert k_cache.stride(2) == k_cache.shape[1] * k_cache.stride(1)  # heads outside tokens
