"""kv_cache_dtype="fp8": K/V stored in FP8 with per-layer scales, on CPU through the torch
backend (store quantized, upcast on read) and the Triton kernels (interpreter).

Quantization is deterministic, so with fixed scales every scenario (prefix-cache hits,
preemption, chunked prefill, block size 8, the Triton kernels, tensor parallelism) gives
the tokens of the plain FP8 run, exactly as the unquantized engine gives Hugging Face's.
Accuracy against the unquantized engine is test_fp8_accuracy.py's.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from parity import INTERPRETER_ONLY, MAX_TOKENS, generate_twice, make_llm, mixed_prompts, shared_prefix_prompts
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.executor import model_runner
from nanovllm.layers.attention import FP8_SCALE_HEADROOM

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def prompts(qwen3_ckpt) -> list[list[int]]:
    return mixed_prompts(384, 16)


@pytest.fixture(scope="module")
def fp8_tokens(qwen3_ckpt, prompts) -> list[list[int]]:
    with make_llm(qwen3_ckpt, kv_cache_dtype="fp8", enable_prefix_caching=False) as llm:
        return greedy(llm, prompts)


@pytest.mark.parametrize("scenario", ["preemption", "chunked_prefill", "block_size_8",
                                      pytest.param("triton", marks=INTERPRETER_ONLY), "tp2"])
def test_fp8_scenarios_give_the_plain_fp8_tokens(qwen3_ckpt, prompts, fp8_tokens, scenario):
    args = {
        "preemption": dict(num_kvcache_blocks=10),
        "chunked_prefill": dict(max_num_batched_tokens=32, max_num_seqs=8),
        "block_size_8": dict(kvcache_block_size=8, num_kvcache_blocks=256),
        "triton": dict(attention_backend="triton"),
        "tp2": dict(tensor_parallel_size=2),
    }[scenario]
    with make_llm(qwen3_ckpt, kv_cache_dtype="fp8", **args) as llm:
        assert llm.executor.runner.kv_cache.dtype == torch.float8_e4m3fn
        if scenario == "triton":  # the fused rotary-store kernel writes the cache; the interpreter is slow
            assert all(layer.stores_rotated() for layer in llm.executor.runner.attention_layers)
            assert greedy(llm, prompts[:5]) == fp8_tokens[:5]
            return
        assert greedy(llm, prompts) == fp8_tokens
        if scenario == "preemption":
            assert llm.scheduler.num_preemptions > 0


def test_fp8_cache_keeps_v_in_ks_layout(qwen3_ckpt):
    """An FP8 cache stores V as K is stored: every kernel and the torch backend address both
    with K's strides (the transposed V of sessions 43-58 was removed: benchmarks/RESULTS.md,
    session 59)."""
    with make_llm(qwen3_ckpt, kv_cache_dtype="fp8", num_kvcache_blocks=8) as llm:
        for layer in llm.executor.runner.attention_layers:
            assert layer.v_cache.dtype == layer.k_cache.dtype == torch.float8_e4m3fn
            assert layer.v_cache.shape == layer.k_cache.shape
            assert layer.v_cache.stride() == layer.k_cache.stride()


def test_fp8_prefix_cache_hits(qwen3_ckpt):
    shared = shared_prefix_prompts(384, 16)
    with make_llm(qwen3_ckpt, kv_cache_dtype="fp8", enable_prefix_caching=False) as plain:
        expected = greedy(plain, shared)
    with make_llm(qwen3_ckpt, kv_cache_dtype="fp8") as llm:
        assert generate_twice(llm, shared) == expected
        assert llm.scheduler.block_manager.num_prompt_tokens_hit > 0


def test_fp8_cache_holds_more_tokens_in_the_same_bytes(qwen3_ckpt, monkeypatch):
    """On CPU the pool is a fixed number of bytes (here 16 MiB, below what max_num_seqs
    sequences could fill): FP8 fits 4x the blocks of float32. stats() says what it holds."""
    monkeypatch.setattr(model_runner, "DEFAULT_CPU_KV_CACHE_BYTES", 16 << 20)
    sizes = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(str(qwen3_ckpt), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype) as llm:
            stats = llm.stats()
            sizes[kv_cache_dtype] = llm.num_kvcache_blocks
            assert stats["kv_cache_tokens"] == llm.num_kvcache_blocks * llm.config.kvcache_block_size
            assert stats["kv_cache_dtype"] == {"auto": "float32", "fp8": "float8_e4m3fn"}[kv_cache_dtype]
            assert llm.num_kvcache_blocks == (16 << 20) // llm.executor.runner.kv_bytes_per_block()
    assert sizes["fp8"] == 4 * sizes["auto"]


def test_the_cpu_cache_holds_no_more_than_max_num_seqs_can_fill(qwen3_ckpt):
    """Blocks past max_num_seqs sequences of max_model_len would only cost start-up time."""
    with LLM(str(qwen3_ckpt), device="cpu", dtype="float32", max_num_seqs=3, max_model_len=300) as llm:
        assert llm.num_kvcache_blocks == 3 * 2  # 300 tokens take two blocks of 256


def test_checkpoint_scales_are_loaded_and_used(qwen3_ckpt, tmp_path, prompts):
    """k_scale / v_scale tensors in the checkpoint (vLLM's names) become the layers' scales:
    K and V are stored divided by them."""
    path = tmp_path / "scaled"
    shutil.copytree(qwen3_ckpt, path)
    [weights_file] = path.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.02)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.01)
    weights["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.03)  # the older single scale
    save_file(weights, weights_file)
    with make_llm(path, kv_cache_dtype="fp8", num_kvcache_blocks=32) as llm, \
            make_llm(qwen3_ckpt, kv_cache_dtype="fp8", num_kvcache_blocks=32) as unscaled:
        layers = llm.executor.runner.attention_layers
        assert layers[0].kv_scales.tolist() == pytest.approx([0.02, 0.01])
        assert layers[1].kv_scales.tolist() == pytest.approx([0.03, 0.03])
        greedy(llm, prompts[:3])
        greedy(unscaled, prompts[:3])
        # The same keys divided by 0.02 instead of 1.0: stored ~50x larger.
        largest = [engine.executor.runner.attention_layers[0].k_cache.float().abs().max().item()
                   for engine in (llm, unscaled)]
    assert 40 < largest[0] / largest[1] < 60


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=INTERPRETER_ONLY)])
def test_calculate_kv_scales_from_the_first_batch(qwen3_ckpt, prompts, backend):
    """The first prefill sets each layer's scales so that its largest |K| and |V| land at
    the format's maximum over FP8_SCALE_HEADROOM; they stay fixed after it (later keys
    may be larger, up to the headroom)."""
    with make_llm(qwen3_ckpt, kv_cache_dtype="fp8", calculate_kv_scales=True, num_kvcache_blocks=32,
                  attention_backend=backend) as llm:
        layers = llm.executor.runner.attention_layers
        assert all(layer.kv_scales.tolist() == [1.0, 1.0] for layer in layers)
        assert not any(layer.stores_rotated() for layer in layers)  # K must be seen, not fused away
        llm.generate(prompts[:4], SamplingParams(max_tokens=1), use_tqdm=False)  # one prefill
        target = torch.finfo(torch.float8_e4m3fn).max / FP8_SCALE_HEADROOM
        scales = [layer.kv_scales.tolist() for layer in layers]
        for layer in layers:
            assert 0 < layer.kv_scales.min() and (layer.kv_scales != 1.0).all()
            assert layer.k_cache.float().abs().max().item() == target
            assert layer.v_cache.float().abs().max().item() == target
        assert all(layer.stores_rotated() for layer in layers) == (backend == "triton")
        greedy(llm, prompts[4:6])
        assert [layer.kv_scales.tolist() for layer in layers] == scales


def test_calculate_kv_scales_needs_an_fp8_cache(qwen3_ckpt):
    with pytest.raises(ValueError, match="calculate_kv_scales is for an FP8 KV cache"):
        make_llm(qwen3_ckpt, calculate_kv_scales=True)


def test_benchmark_floor_counts_fp8_bytes(qwen3_ckpt):
    """bench's floor reads the cache in its own bytes (FP8: a quarter of float32's) and the
    weights in theirs; given a wider cache's bytes per token it gives that cache's floor."""
    from nanovllm.entrypoints.bench import floor_seconds

    prompts, max_tokens = [[5] * 20] * 3, [8] * 3
    with make_llm(qwen3_ckpt, num_kvcache_blocks=16) as plain, \
            make_llm(qwen3_ckpt, num_kvcache_blocks=16, kv_cache_dtype="fp8", quantization="fp8") as fp8:
        wide, narrow = (floor_seconds(llm, prompts, max_tokens, 1e12) for llm in (plain, fp8))
        assert narrow["kv_s"] * 4 == pytest.approx(wide["kv_s"])
        assert narrow["weights_s"] < wide["weights_s"]
        as_wide = floor_seconds(fp8, prompts, max_tokens, 1e12, plain.executor.kv_bytes_per_token())
        assert as_wide["kv_s"] == pytest.approx(wide["kv_s"])
