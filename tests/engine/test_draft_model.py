"""Speculative decoding with a draft model (speculative_config {"model": DRAFT, ...};
engine/speculative.py's DraftModelProposer, executor/draft.py's DraftRunner): the engine's
tokens equal those of the same engine without speculation, and greedy ones Hugging Face's,
on CPU in float32. The model itself as its own draft keeps (nearly) every draft; another
random model keeps few: both ends of verification are exercised."""
from __future__ import annotations

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.demo import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR
from nanovllm.demo.corpus import held_out_sources
from nanovllm.engine.speculative import DraftModelProposer
from nanovllm.executor import draft as draft_module
from nanovllm.sequence import Sequence
from nanovllm.speculative_config import SpeculativeConfig
from nanovllm.testing.checkpoints import hf_greedy, make_tiny_checkpoint
from parity import INTERPRETER_ONLY, looping_prompts, make_llm, mixed_prompts
from test_speculative import generate_both


def draft(path, k: int = 3, **more) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, **more}


@pytest.mark.parametrize("which", ["itself", "another"])
def test_greedy_speculation_with_a_draft_model_matches_hf(qwen3_ckpt, llama_ckpt, which):
    drafter = qwen3_ckpt if which == "itself" else llama_ckpt  # the same tokenizer and vocabulary
    prompts = mixed_prompts(384, 8, count=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with make_llm(qwen3_ckpt, kvcache_block_size=8, speculative_config=draft(drafter)) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert llm.scheduler.block_manager.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 30, ignore_eos=True)
    assert stats["spec_decode_num_drafts"] > 0
    rate = stats["spec_decode_acceptance_rate"]
    assert rate > 0.9 if which == "itself" else rate < 0.9
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]  # a draft stands only after those before it
    assert len(per_pos) == 3 and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= stats["spec_decode_num_drafts"]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert stats["decode_tokens"] + stats["prefill_step_decode_tokens"] == (
        generated - len(prompts) - stats["spec_decode_num_accepted_tokens"] + stats["spec_decode_num_draft_tokens"])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=30, ignore_eos=True, logprobs=2),
], ids=["top_p_top_k", "min_p_logprobs"])
def test_sampling_with_a_draft_model_draws_the_tokens_decoding_draws(qwen3_ckpt, params):
    plain, speculated, stats = generate_both(qwen3_ckpt, mixed_prompts(384, 8, count=4), params,
                                             speculative_config=draft(qwen3_ckpt))
    assert stats["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(plain, speculated):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    if params.logprobs:
        assert [o.outputs[0].cumulative_logprob for o in plain] == pytest.approx(
            [o.outputs[0].cumulative_logprob for o in speculated], abs=1e-3)


@pytest.mark.parametrize("scenario", ["preemption", "prefix_cache", "chunked", "n", "tp2", "tp2_draft_whole",
                                      "stops"])
def test_a_draft_model_under_every_scenario(qwen3_ckpt, scenario):
    """Preemption (the draft's K/V computed again with the sequence's), prefix-cache hits,
    prompts longer than a step's budget (the draft catches up in parts), n > 1, TP 2 (every
    rank runs its shard of the draft, or rank 0 the whole draft) and stops met inside kept
    drafts."""
    args = {"preemption": dict(kvcache_block_size=8, num_kvcache_blocks=24),
            "prefix_cache": dict(kvcache_block_size=8), "chunked": dict(max_num_batched_tokens=24, max_num_seqs=8),
            "n": {}, "tp2": dict(tensor_parallel_size=2), "tp2_draft_whole": dict(tensor_parallel_size=2),
            "stops": {}}[scenario]
    prompts = looping_prompts(384, seed=4)
    params = SamplingParams(temperature=0.7 if scenario == "n" else 0, n=3 if scenario == "n" else 1, seed=2,
                            max_tokens=32, ignore_eos=True)
    if scenario == "prefix_cache":  # the second time from the cache
        prompts = prompts + prompts
    if scenario == "stops":
        params = [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=40, stop=["9"], include_stop_str_in_output=True),
                  SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["5"])]
        params = (params * 2)[: len(prompts)]
    config = draft(qwen3_ckpt, draft_tensor_parallel_size=1 if scenario == "tp2_draft_whole" else None)
    plain, speculated, stats = generate_both(qwen3_ckpt, prompts, params, speculative_config=config, **args)
    assert [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in plain] == [
        [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in speculated]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    if scenario == "preemption":
        assert stats["preemptions"] > 0


@pytest.mark.parametrize("which", ["itself", "another"])
def test_the_drafts_graphs_as_plain_calls_match_hf(qwen3_ckpt, llama_ckpt, monkeypatch, which):
    """The draft's graphs (decode steps sampling greedily inside them, for at most
    disable_by_batch_size - 1 sequences and catch-ups of up to 1 + k tokens a sequence, a
    row per token; varlen steps in pieces) as plain calls over their buffers, as CUDA
    replays them; the varlen steps past their sizes (a whole prompt) run eagerly. Where
    every draft is kept the draft is two tokens behind (the last draft and the bonus
    token): a catch-up of two rows a sequence. Another model's drafts are mostly rejected:
    each sequence's draft is then one token behind, a decode step's one row."""
    monkeypatch.setenv("NANOVLLM_PLAIN_CALL_GRAPHS", "1")  # the model's decode graphs too
    prompts = mixed_prompts(384, 8, count=3)
    config = draft(qwen3_ckpt if which == "itself" else llama_ckpt, disable_by_batch_size=4)  # graphs of 3 rows
    with make_llm(qwen3_ckpt, kvcache_block_size=8, speculative_config=config, max_prefill_graph_tokens=16) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)
        drafter = llm.executor.runner.drafter
        assert drafter.graphs.buckets == [1, 2, 4, 8, 12]  # 3 sequences x (1 + 3), catch-ups a row per token
        assert drafter.graphs.num_replays > 0 and drafter.prefill_graphs.num_replays > 0
        assert (drafter.graphs.num_multi_row_replays > 0) == (which == "itself")
        rate = llm.stats()["spec_decode_acceptance_rate"]
        assert rate > 0.9 if which == "itself" else rate < 0.9
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 24, ignore_eos=True)


def test_the_drafts_prefill_graphs_without_decode_graphs_match_hf(qwen3_ckpt, monkeypatch):
    """On a CPU a given max_prefill_graph_tokens builds the prefill graphs (as plain calls) and,
    without NANOVLLM_PLAIN_CALL_GRAPHS, no decode graphs: for the draft as for the model
    (executor/graphs.py's graph_plan), the draft's capture sharing no decode graphs' pool."""
    monkeypatch.delenv("NANOVLLM_PLAIN_CALL_GRAPHS", raising=False)
    prompts = mixed_prompts(384, 8, count=2)
    with make_llm(qwen3_ckpt, kvcache_block_size=8, max_prefill_graph_tokens=16,
                  speculative_config=draft(qwen3_ckpt, disable_by_batch_size=4)) as llm:
        drafter = llm.executor.runner.drafter
        assert drafter.graphs is None and llm.executor.runner.graph_runner is None
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert drafter.prefill_graphs.num_replays > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 8, ignore_eos=True)


def test_a_draft_quantized_to_fp8_changes_no_token(qwen3_ckpt):
    """The draft's own quantization (speculative_config's "quantization"): its FP8 weights
    move its drafts, never the tokens, which are the model's."""
    prompts = mixed_prompts(384, 8, count=3)
    with make_llm(qwen3_ckpt, speculative_config=draft(qwen3_ckpt, quantization="fp8")) as llm:
        assert llm.executor.runner.drafter.config.quantization == "fp8"
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 20, ignore_eos=True)


@INTERPRETER_ONLY
def test_a_draft_model_on_the_triton_kernels_matches_hf(qwen3_ckpt):
    """Both models on the Triton kernels (the interpreter on CPU): the draft's varlen and
    decode steps, the model's verification."""
    prompts = looping_prompts(384, seed=4)[:2]
    with make_llm(qwen3_ckpt, attention_backend="triton", speculative_config=draft(qwen3_ckpt, k=2)) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 12, ignore_eos=True)


def test_the_demo_draft_model_speculates_for_the_demo_model():
    """The bundled pair: on held-out code the draft's tokens are often the model's, and the
    outputs are plain decoding's (float32)."""
    tokenizer_source = LLM(DEMO_MODEL_DIR, device="cpu", dtype="float32")
    ids = tokenizer_source.get_tokenizer().encode(list(held_out_sources().values())[0])
    prompts = [ids[len(ids) // 2 - 100 : len(ids) // 2], ids[len(ids) // 3 - 100 : len(ids) // 3]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = tokenizer_source.generate(prompts, params, use_tqdm=False)
    tokenizer_source.shutdown()
    with LLM(DEMO_MODEL_DIR, device="cpu", dtype="float32", speculative_config=draft(DEMO_DRAFT_MODEL_DIR, k=4)) as llm:
        speculated = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in speculated]
    assert stats["spec_decode_acceptance_rate"] > 0.3


@pytest.mark.parametrize("padded", ["draft", "model"])
def test_a_draft_padding_its_vocabulary_otherwise(qwen3_ckpt, tmp_path, padded):
    """A draft with the model's tokenizer and an embedding padded to another size (the model's
    tokens past the draft's rows go in as its last; drafts past the model's are cut off)."""
    wide = make_tiny_checkpoint(tmp_path / "wide", "qwen3", head_dim=32, vocab_size=448, seed=3)
    model, drafter = (qwen3_ckpt, wide) if padded == "draft" else (wide, qwen3_ckpt)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, speculated, stats = generate_both(model, mixed_prompts(384, 8, count=3), params,
                                             speculative_config=draft(drafter))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in speculated]
    assert stats["spec_decode_num_drafts"] > 0


def test_the_draft_graphs_draft_among_the_models_tokens_only(qwen3_ckpt, tmp_path, monkeypatch):
    """A draft padded past the model's vocabulary, its decode graphs sampling greedily inside
    them (plain calls on CPU): each draft is the best of the model's tokens, as the draft's
    eager steps take it, never a padding row's token cut to the last id."""
    wide = make_tiny_checkpoint(tmp_path / "wide", "qwen3", head_dim=32, vocab_size=448, seed=3)
    prompts = mixed_prompts(384, 8, count=3)
    propose = draft_module.DraftRunner.propose
    drafts: list[list[list[int]]] = []

    def recorded(self, *args):
        drafts.append(propose(self, *args))
        return drafts[-1]

    monkeypatch.setattr(draft_module.DraftRunner, "propose", recorded)
    for graphs in (True, False):
        monkeypatch.setenv("NANOVLLM_PLAIN_CALL_GRAPHS", "1" if graphs else "0")
        with make_llm(qwen3_ckpt, speculative_config=draft(wide, disable_by_batch_size=4)) as llm:
            assert (llm.executor.runner.drafter.graphs is not None) == graphs
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
            if graphs:
                assert llm.executor.runner.drafter.graphs.num_replays > 0
                in_graphs, drafts = drafts, []
    assert in_graphs == drafts


def test_draft_model_configs_are_checked(qwen3_ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(8192 tokens\) differs"):
        Config(str(qwen3_ckpt), speculative_config=draft(DEMO_DRAFT_MODEL_DIR))
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size \(2\) must be tensor_parallel_size \(1"):
        Config(str(qwen3_ckpt), speculative_config=draft(qwen3_ckpt, draft_tensor_parallel_size=2))
    split = Config(str(qwen3_ckpt), tensor_parallel_size=2, speculative_config=draft(qwen3_ckpt))
    whole = Config(str(qwen3_ckpt), tensor_parallel_size=2,
                   speculative_config=draft(qwen3_ckpt, draft_tensor_parallel_size=1))
    assert (split.draft.tensor_parallel_size, whole.draft.tensor_parallel_size) == (2, 1)
    with pytest.raises(ValueError, match="speculative_config's draft model: model must be a local"):
        Config(str(qwen3_ckpt), speculative_config=draft(tmp_path / "missing"))
    longer = make_tiny_checkpoint(tmp_path / "longer", "qwen3", max_position_embeddings=1024)
    config = Config(str(longer), max_model_len=300, speculative_config=draft(qwen3_ckpt, k=2))
    assert config.draft.model == str(qwen3_ckpt) and config.draft.max_model_len == 300
    assert Config(str(longer), speculative_config=draft(qwen3_ckpt)).draft.max_model_len == 512  # the draft's own
    given = draft(qwen3_ckpt, max_model_len=200, acceptance_method="rejection_sampler")
    assert Config(str(longer), speculative_config=given).draft.max_model_len == 200
    with pytest.raises(ValueError, match=r"max_model_len \(600\) exceeds the draft model's context \(512\)"):
        Config(str(longer), speculative_config=draft(qwen3_ckpt, max_model_len=600))
    with pytest.raises(ValueError, match=r"max_model_len \(400\) exceeds max_model_len \(300\)"):
        Config(str(longer), max_model_len=300, speculative_config=draft(qwen3_ckpt, max_model_len=400))
    assert config.draft.torch_dtype == config.torch_dtype and config.draft.draft is None
    assert SpeculativeConfig.parse(config.speculative) == config.speculative
    assert config.speculative.describe() == f"draft model {qwen3_ckpt}, up to 2 drafts a step"


def test_sequences_past_the_drafts_context_decode_without_drafts(qwen3_ckpt, tmp_path):
    """A draft of a shorter context (512 positions) than the model's (1024): a sequence
    drafts while its drafts fit the draft's context, then decodes a token at a time."""
    longer = make_tiny_checkpoint(tmp_path / "longer", "qwen3", head_dim=32, max_position_embeddings=1024)
    # 480 and 495 tokens: generation crosses position 512
    prompts = [(p * 100)[:n] for p, n in zip(looping_prompts(384, seed=7), (480, 495))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, speculated, stats = generate_both(longer, prompts, params, speculative_config=draft(qwen3_ckpt))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in speculated]
    assert stats["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("ranks", ["one", "tp2_draft_whole"])
def test_a_failing_draft_model_leaves_the_step_without_drafts(qwen3_ckpt, caplog, ranks):
    """A draft model that fails (out of memory, say) on its one rank costs the step its
    drafts, not its sequences: the tokens are plain decoding's, and no block is left held."""
    prompts = mixed_prompts(384, 8, count=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tp = dict(tensor_parallel_size=2) if ranks == "tp2_draft_whole" else {}
    config = draft(qwen3_ckpt, draft_tensor_parallel_size=1 if tp else None)
    with make_llm(qwen3_ckpt, kvcache_block_size=8, speculative_config=config, **tp) as llm:
        calls = failing_every_third(llm.executor.runner.drafter)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
        assert llm.scheduler.block_manager.num_used_blocks == 0
    assert len(calls) >= 3 and "the draft model failed, a step goes without its drafts" in caplog.text
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 20, ignore_eos=True)


def test_a_failing_draft_shard_stops_the_engine_with_its_error(qwen3_ckpt):
    """Under tensor parallelism with the draft split over the ranks, a failure on one rank
    leaves the ranks out of step: the engine stops, with that error (not a worker's death
    that follows it)."""
    config = draft(qwen3_ckpt)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with make_llm(qwen3_ckpt, tensor_parallel_size=2, speculative_config=config) as llm:
        failing_every_third(llm.executor.runner.drafter)
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            llm.generate(mixed_prompts(384, 8, count=2), params, use_tqdm=False)


def failing_every_third(drafter) -> list[int]:
    """Make drafter.propose raise at every third call; returns the calls' list."""
    propose, calls = drafter.propose, []

    def failing(seqs, counts):
        calls.append(len(seqs))
        if len(calls) % 3 == 0:
            raise RuntimeError("CUDA out of memory (a test's)")
        return propose(seqs, counts)

    drafter.propose = failing
    return calls


class RecordingExecutor:
    """Executor.propose's calls, answered with drafts 100, 101, ..."""

    def __init__(self):
        self.calls = []

    def propose(self, records, counts):
        self.calls.append([(r.scheduled_token_ids, r.num_cached_tokens, n) for r, n in zip(records, counts)])
        return [list(range(100, 100 + n)) for n in counts]


def test_the_draft_computes_each_token_once_and_catches_up_in_parts():
    proposer = DraftModelProposer(SpeculativeConfig.parse(draft("d", k=3)), max_tokens=8, max_len=64, block_size=4)
    executor = RecordingExecutor()

    def sequence(tokens: list[int]) -> Sequence:
        seq = Sequence(0, tokens, SamplingParams(temperature=0, max_tokens=50), block_size=4)
        seq.block_table = list(range(16))
        return seq

    def drafts_for(seq: Sequence, limit: int = 16) -> None:
        seq.add_drafts(proposer.propose(seq, limit))
        proposer.fill([seq], executor)

    def step_output(seq: Sequence, kept: int, *tokens: int) -> None:
        seq.accept_drafts(kept)
        for token in tokens:
            seq.append_token(token)

    seq = sequence(list(range(10)))
    seq.add_drafts(proposer.propose(seq, 16))
    assert seq.drafts == [-2, -2, -2]
    proposer.fill([seq], executor)
    # A 10-token prompt in calls of 8 tokens: 8 computed alone, then 2 with the drafts asked.
    assert executor.calls == [[(list(range(8)), 0, 0)], [([8, 9], 8, 3)]]
    assert seq.drafts == [100, 101, 102]
    # The model keeps one draft and outputs another token: the draft computed 100 and 101
    # (the inputs of its second and third drafts); 100 stands, so only 7 is new.
    step_output(seq, 1, 100, 7)
    drafts_for(seq, 2)  # the step's budget leaves room for two
    assert executor.calls[-1] == [([7], 11, 2)]
    # Its drafts are rejected and a step without drafts follows (no room for them): the
    # rejected draft 100 at position 12 is computed again, with what came after it.
    step_output(seq, 0, 5)
    seq.append_token(6)  # a plain decode step's token
    drafts_for(seq)
    assert executor.calls[-1] == [([5, 6], 12, 3)]
    # A preempted sequence starts after the full blocks its draft computed (the same tokens,
    # here in the same blocks): positions 0-11, three blocks of four.
    step_output(seq, 0, 9)
    seq.num_preemptions += 1
    drafts_for(seq)
    assert executor.calls[-1] == [([5, 6, 9], 12, 3)]
    # Another sequence whose prompt shares the first two blocks, held in the same blocks
    # (a prefix-cache hit), starts after them.
    other = sequence(list(range(8)) + [50, 51, 52])
    drafts_for(other)
    assert executor.calls[-1] == [([50, 51, 52], 8, 3)]
    # The blocks the draft wrote other tokens into since are not taken for its own.
    late = sequence(list(range(10)) + [100, 7, 5, 6])
    drafts_for(late)
    assert executor.calls[-1] == [([8, 9, 100, 7, 5, 6], 8, 3)]


def test_the_draft_computes_prompt_chunks_as_the_model_does():
    """A prompt computed in chunks over several steps: the draft computes each chunk in the
    same step (no drafts asked), so the first proposal finds it one token behind. A
    sequence that cannot draft (max_tokens 1) gets no chunk; one with penalties does."""
    proposer = DraftModelProposer(SpeculativeConfig.parse(draft("d", k=3)), max_tokens=8, max_len=64, block_size=4)
    executor = RecordingExecutor()

    def chunk(seq: Sequence, cached: int, scheduled: int) -> None:
        seq.num_cached_tokens, seq.num_scheduled_tokens = cached, scheduled
        proposer.fill([seq], executor)

    seq = Sequence(0, list(range(10)), SamplingParams(temperature=0, max_tokens=50), block_size=4)
    seq.block_table = list(range(16))
    chunk(seq, 0, 6)
    chunk(seq, 6, 4)
    assert executor.calls == [[(list(range(6)), 0, 0)], [([6, 7, 8, 9], 6, 0)]]
    seq.append_token(42)  # the prompt's last step samples the first output token
    seq.num_cached_tokens, seq.num_scheduled_tokens = 10, 1
    seq.add_drafts(proposer.propose(seq, 16))
    proposer.fill([seq], executor)
    assert executor.calls[-1] == [([42], 10, 3)] and seq.drafts == [100, 101, 102]
    for i, params in enumerate((SamplingParams(temperature=0, max_tokens=1),
                                SamplingParams(temperature=0, max_tokens=50, repetition_penalty=1.2))):
        other = Sequence(1 + i, list(range(10)), params, block_size=4)
        other.block_table = list(range(16 * (i + 1), 16 * (i + 2)))
        chunk(other, 0, 6)
        assert len(executor.calls) == 3 + i


def test_chunked_prompts_leave_the_draft_no_long_catch_up(qwen3_ckpt):
    """Prompts longer than a step's budget: the draft computes each chunk in the step that
    computes it, so no proposal computes more than the tokens a step can leave it behind
    (the last draft and the next token), and the outputs are plain decoding's."""
    prompts = looping_prompts(384, seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with make_llm(qwen3_ckpt, max_num_batched_tokens=24, max_num_seqs=8, speculative_config=draft(qwen3_ckpt)) as llm:
        propose, asked = llm.executor.propose, []

        def recorded(records, counts):
            asked.extend((len(r.scheduled_token_ids), n) for r, n in zip(records, counts))
            return propose(records, counts)

        llm.executor.propose = recorded
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert max(len(p) for p in prompts) > 24
    assert any(n == 0 and tokens > 2 for tokens, n in asked)  # prompt chunks
    assert max(tokens for tokens, n in asked if n > 0) <= 2
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(qwen3_ckpt, prompts, 24, ignore_eos=True)
