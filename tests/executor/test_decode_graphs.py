"""Decode steps through the decode graphs' static buffers (executor/cuda_graph.py). On CPU
each bucket is plain calls over the same buffers, padding and static context that a CUDA
graph replays (test_gpu.py replays real graphs): greedy output still matches transformers,
and the sampling graph draws the tokens that the eager sampler draws."""
from __future__ import annotations

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.sampling.sampler import SamplingTensors
from parity import INTERPRETER_ONLY, assert_matches_hf, make_llm, mixed_prompts, shared_prefix_prompts


def use_decode_graphs(llm) -> list[tuple[int, int]]:
    """Give a CPU engine the decode graphs in their plain-call form, captured as on CUDA;
    returns the (rows, bucket) of every replay from then on."""
    runner = llm.executor.runner
    graphs = runner.graph_runner = runner.decode_graph_runner(graphs=False)
    graphs.capture()
    replays, bucket_for = [], graphs.bucket_for

    def recorded(rows: int) -> int:
        replays.append((rows, bucket_for(rows)))
        return replays[-1][1]

    graphs.bucket_for = recorded
    return replays


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
            llm.executor.runner.sample([], torch.zeros(1, llm.vocab_size), SamplingTensors(None))


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


def check_overlapped_parts(ckpt, backend: str, parts: int, turns: bool, monkeypatch) -> None:
    """Buckets of 4 to 8 rows run the decoder in `parts` parts (executor/overlap.py; on CPU
    one after the other), each under its rows' slice of the context, padding rows and the
    prefix cache included; buckets outside the window run whole: the same tokens as HF.
    With the Triton kernels, each part's split kernels count in its own counter lane."""
    import nanovllm.executor.cuda_graph as cuda_graph
    import nanovllm.executor.model_runner as model_runner
    import nanovllm.kernels.decode_attention as decode_attention
    import nanovllm.kernels.split_counters as counters
    from nanovllm.executor.overlap import Overlap

    monkeypatch.setattr(model_runner, "overlap_from_env", lambda: Overlap(4, 8, parts, turns))
    split = []
    overlapped = cuda_graph.overlapped_forward
    monkeypatch.setattr(cuda_graph, "overlapped_forward",
                        lambda model, ids, *args: split.append(len(ids)) or overlapped(model, ids, *args))
    lanes = set()  # the split kernels' counter buffers: each part its own (they run side by side on CUDA)
    take = decode_attention.split_counters
    monkeypatch.setattr(decode_attention, "split_counters",
                        lambda *args: lanes.add(counters.current_lane()) or take(*args))
    with make_llm(ckpt, max_num_seqs=8, num_kvcache_blocks=128, attention_backend=backend) as llm:
        replays = use_decode_graphs(llm)
        prompts = shared_prefix_prompts(llm.vocab_size, 16)[:3] + mixed_prompts(llm.vocab_size, 16, seed=3)[:4]
        assert_matches_hf(llm, ckpt, prompts)
        assert_matches_hf(llm, ckpt, prompts[:3])
        assert {8, 4} <= set(split) and not set(split) & {1, 2}
        assert any(4 <= bucket <= 8 and bucket > rows for rows, bucket in replays)  # padding rows in the last part
        assert lanes == (set(range(parts)) if backend == "triton" else set())


@pytest.mark.parametrize(("parts", "turns"), [(2, True), (4, False)])
def test_decode_in_overlapped_parts_matches_hf(tiny_ckpt, monkeypatch, parts, turns):
    check_overlapped_parts(tiny_ckpt, "torch", parts, turns, monkeypatch)


@INTERPRETER_ONLY
def test_decode_in_overlapped_parts_with_the_triton_kernels_matches_hf(qwen3_ckpt, monkeypatch):
    check_overlapped_parts(qwen3_ckpt, "triton", 2, True, monkeypatch)


def test_overlap_settings_and_row_parts(monkeypatch):
    """The window from the environment (a bad one refused by name); parts as even as rows allow."""
    from nanovllm.executor.overlap import Overlap, overlap_from_env, row_parts

    monkeypatch.delenv("NANOVLLM_DECODE_OVERLAP_ROWS", raising=False)
    assert overlap_from_env() is None
    monkeypatch.setenv("NANOVLLM_DECODE_OVERLAP_ROWS", "16-64")
    monkeypatch.setenv("NANOVLLM_DECODE_OVERLAP_PARTS", "4")
    monkeypatch.setenv("NANOVLLM_DECODE_OVERLAP_TURNS", "0")
    overlap = overlap_from_env()
    assert overlap == Overlap(16, 64, 4, False)
    assert [overlap.applies(rows) for rows in (8, 16, 64, 80)] == [False, True, True, False]
    for bad in ("16", "64-16", "a-b", "0-4"):
        monkeypatch.setenv("NANOVLLM_DECODE_OVERLAP_ROWS", bad)
        with pytest.raises(ValueError, match="NANOVLLM_DECODE_OVERLAP_ROWS"):
            overlap_from_env()
    monkeypatch.setenv("NANOVLLM_DECODE_OVERLAP_ROWS", "16-64")
    monkeypatch.setenv("NANOVLLM_DECODE_OVERLAP_PARTS", "8")
    with pytest.raises(ValueError, match="NANOVLLM_DECODE_OVERLAP_PARTS"):
        overlap_from_env()
    assert row_parts(10, 4) == [slice(0, 2), slice(2, 5), slice(5, 7), slice(7, 10)]
    assert row_parts(8, 2) == [slice(0, 4), slice(4, 8)]
