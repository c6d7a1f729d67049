"""Steps that verify drafts (speculative decoding) through the decode graphs: a row per
scheduled token (each sequence's last token and its drafts, at their own positions), in
the buckets whose graph stores every row's K/V before any row attends. On CPU the graphs
run as plain calls over the same buffers (test_gpu.py replays real ones)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.executor.cuda_graph import CUDAGraphRunner
from nanovllm.executor.inputs import PACKED_FIELDS, InputBuilder, packed_size
from nanovllm.executor.model_runner import decodes_rows
from nanovllm.executor.step import StepSeq
from nanovllm.layers.attention_backend import TorchAttentionBackend
from nanovllm.layers.triton_attention import ROTARY_MAX_BATCH, TritonAttentionBackend
from nanovllm.sequence import PENDING_TOKEN
from nanovllm.testing.checkpoints import hf_greedy
from parity import INTERPRETER_ONLY, looping_prompts, make_llm, use_decode_graphs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def use_graphs_recording_multi_row(llm) -> list[tuple[int, int]]:
    """use_decode_graphs, and the (rows, bucket) of each replay of a step that verifies drafts."""
    use_decode_graphs(llm)
    graphs, replays = llm.executor.runner.graph_runner, []
    bucket_for = graphs.bucket_for

    def recorded(rows: int, multi_row: bool = False) -> int:
        bucket = bucket_for(rows, multi_row)
        if multi_row:
            replays.append((rows, bucket))
        return bucket

    graphs.bucket_for = recorded
    return replays


def test_pack_rows_gives_each_scheduled_token_a_row():
    """Positions from the cached tokens on, slots through the block table, the table repeated
    on each of a sequence's rows, sampling values per row; a lone pending token from prev."""
    builder = InputBuilder(64, 4, 8, block_size=4, device=torch.device("cpu"))
    seqs = [StepSeq([7, 8, 9], num_cached_tokens=6, block_table=[3, 5, 2]),
            StepSeq([PENDING_TOKEN], num_cached_tokens=2, block_table=[1], prev_row=4)]

    class Prev:
        @staticmethod
        def row_of(seq):
            return seq.prev_row

    packed = np.zeros(packed_size(4, 3), dtype=np.int64)
    temperatures, keys = np.array([0.5, 0.5, 0.5, 1.0], dtype=np.float32), np.array([11, 11, 11, 12])
    size, pending = builder.pack_rows(seqs, Prev(), packed, (temperatures, keys))
    assert (size, pending) == (packed_size(4, 3), True)
    assert packed[:2].tolist() == [4, 3]
    fields = dict(zip(PACKED_FIELDS, packed[2: 2 + len(PACKED_FIELDS) * 4].reshape(-1, 4).tolist()))
    assert fields["tokens"] == [7, 8, 9, PENDING_TOKEN]
    assert fields["prev_rows"] == [-1, -1, -1, 4]
    assert fields["positions"] == [6, 7, 8, 2]
    assert fields["slots"] == [5 * 4 + 2, 5 * 4 + 3, 2 * 4 + 0, 1 * 4 + 2]
    assert fields["keys"] == [11, 11, 11, 12]
    assert np.array(fields["temperature_bits"], dtype=np.int32).view(np.float32).tolist() == [0.5, 0.5, 0.5, 1.0]
    assert packed[size - 4 * 3: size].reshape(4, 3).tolist() == [[3, 5, 2]] * 3 + [[1, -1, -1]]
    # A sequence with drafts and a pending token cannot be: its tokens are read before it drafts.
    with pytest.raises(AssertionError, match="alone"):
        builder.pack_rows([StepSeq([PENDING_TOKEN, 3], 2, [1], prev_row=0)], Prev(), packed)


def test_which_steps_and_buckets_take_several_rows_of_a_sequence():
    """Only a step whose sequences compute their last token and drafts alone; on the Triton
    backend only buckets above ROTARY_MAX_BATCH (decode_attention_rotary's programs store
    their own row's K/V as they attend), on the torch backend every bucket."""
    assert decodes_rows(StepSeq([4, 5, 6], 10, [0, 1, 2], num_draft_tokens=2))
    assert decodes_rows(StepSeq([4], 10, [0, 1, 2]))  # a decode token, or a prompt chunk of one
    assert not decodes_rows(StepSeq([4, 5, 6], 10, [0, 1, 2], num_draft_tokens=1))  # logits of the last two only
    assert not decodes_rows(StepSeq([4], 10, [0, 1, 2], prompt_logprob_rows=(1, [4])))
    triton, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert [triton.decode_sees_step_rows(r) for r in (ROTARY_MAX_BATCH, ROTARY_MAX_BATCH + 1)] == [False, True]
    assert torch_backend.decode_sees_step_rows(2)
    graphs = CUDAGraphRunner(torch.nn.Identity(), 64, 4, 8, torch.float32, torch.device("cpu"), graphs=False,
                             sees_step_rows=triton.decode_sees_step_rows)
    assert graphs.multi_row_buckets == [b for b in graphs.buckets if b > ROTARY_MAX_BATCH]
    assert graphs.bucket_for(5) == 8 and graphs.bucket_for(5, multi_row=True) == 16
    assert CUDAGraphRunner(torch.nn.Identity(), 64, 4, 8, torch.float32, torch.device("cpu"),
                           graphs=False).multi_row_buckets == []


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True, logprobs=1),
], ids=["greedy", "seeded", "top_p_logprobs"])
def test_verifying_in_the_decode_graphs_draws_what_decoding_draws(qwen3_ckpt, params):
    """The n-gram drafts verified in the graphs' rows (temperature-only batches sampled in
    the graph, others by the sampler on the graph's logits): the tokens of the same engine
    without speculation, and Hugging Face's where greedy."""
    prompts = looping_prompts(384, seed=1)
    with make_llm(qwen3_ckpt, max_num_seqs=4) as llm:
        use_decode_graphs(llm)
        plain = llm.generate(prompts, params, use_tqdm=False)
    with make_llm(qwen3_ckpt, max_num_seqs=4, speculative_config=NGRAM) as llm:
        multi = use_graphs_recording_multi_row(llm)
        assert llm.executor.runner.graph_runner.buckets[-1] == 16  # max_num_seqs x (1 + 3 drafts), under 64
        speculated = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert llm.scheduler.block_manager.num_used_blocks == 0
    assert stats["spec_decode_num_accepted_tokens" if params.temperature == 0 else "spec_decode_num_drafts"] > 0
    assert any(rows > 4 for rows, _ in multi)  # more rows than sequences
    for a, b in zip(plain, speculated):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if params.logprobs is not None:
            assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
    if params.temperature == 0:
        assert [o.outputs[0].token_ids for o in speculated] == hf_greedy(qwen3_ckpt, prompts, 32, ignore_eos=True)


@INTERPRETER_ONLY
def test_verifying_in_the_triton_decode_graphs_matches_hf(qwen3_ckpt):
    """On the Triton backend a step of 2-8 rows that verifies drafts goes to a bucket of more
    than 8 rows (here 9: two sequences x (1 + 3)), whose graph runs rotary_store before
    decode attention (the interpreter on CPU, which runs programs one after another, so
    the race that bucket avoids shows on a GPU only: test_gpu.py's speculative scenarios)."""
    prompts = looping_prompts(384, seed=4)[:2]
    with make_llm(qwen3_ckpt, max_num_seqs=2, attention_backend="triton", num_kvcache_blocks=32,
                  speculative_config=NGRAM) as llm:
        multi = use_graphs_recording_multi_row(llm)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert multi and all(bucket > ROTARY_MAX_BATCH for _, bucket in multi)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 20, ignore_eos=True)


def test_kv_scales_come_from_a_prefill_not_a_graph_replay(qwen3_ckpt):
    """calculate_kv_scales takes the FP8 cache's scales from the first prefill's K/V: a first
    step of one-token prompts (rows the graphs could take) runs the prefill path, so the
    scales are those of the engine without speculation."""
    scales = []
    for spec in (None, NGRAM):
        with make_llm(qwen3_ckpt, max_num_seqs=2, kv_cache_dtype="fp8", calculate_kv_scales=True,
                      speculative_config=spec) as llm:
            use_decode_graphs(llm)
            llm.generate([[5], [9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            layer = llm.executor.runner.attention_layers[0]
            assert not layer.scales_pending
            scales.append(layer.kv_scales.tolist())
    assert scales[0] == scales[1] and scales[0] != [1.0, 1.0]


@pytest.mark.parametrize("method", ["ngram", "draft", "draft_on_rank_0"])
def test_verifying_in_the_graphs_under_tensor_parallelism(qwen3_ckpt, monkeypatch, method):
    """TP 2 with every rank's decode graphs as plain calls (NANOVLLM_PLAIN_CALL_GRAPHS, which
    the workers read as they start): each rank takes the same multi_row steps (rank 0's graph
    stopping at the hidden states, its logits and sampler outside), and the tokens are those
    of TP 2 without speculation; the draft on both ranks, or whole on rank 0."""
    monkeypatch.setenv("NANOVLLM_PLAIN_CALL_GRAPHS", "1")
    config = NGRAM if method == "ngram" else {"model": str(qwen3_ckpt), "num_speculative_tokens": 3}
    if method == "draft_on_rank_0":
        config["draft_tensor_parallel_size"] = 1
    prompts = looping_prompts(384, seed=5)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=1)
    with make_llm(qwen3_ckpt, max_num_seqs=4, tensor_parallel_size=2) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    with make_llm(qwen3_ckpt, max_num_seqs=4, tensor_parallel_size=2, speculative_config=config) as llm:
        speculated = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.executor.runner
        assert runner.graph_runner.num_multi_row_replays > 0
        assert not runner.graph_runner.samples
        if method != "ngram":
            assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
            assert runner.drafter.graphs.num_replays > 0
    for a, b in zip(plain, speculated):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
