"""DECODE_LONGEST_FIRST (engine/scheduler.py, on unless NANOVLLM_DECODE_LONGEST_FIRST=0): each
step's decode rows by length, longest first, so rows change places from step to step.
Everything downstream is keyed by the sequence (pending last tokens, sampling keys, penalty
slots, grammar rows, logprobs), so the outputs equal those of admission order exactly,
across the sampling features, structured outputs, n > 1, mixed steps, preemption, the decode
graphs' path and TP 2."""
from __future__ import annotations

import pytest

from nanovllm import SamplingParams
from nanovllm.engine import scheduler as scheduler_module
from nanovllm.sampling_params import StructuredOutputsParams
from parity import make_llm, mixed_prompts, use_decode_graphs

pytest.importorskip("xgrammar")

KINDS = [
    dict(temperature=0.9, seed=1, n=3, logprobs=3),
    dict(temperature=1.1, top_k=7, top_p=0.9, seed=2, logprobs=2, prompt_logprobs=2),
    dict(temperature=0.7, seed=3, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, n=2),
    dict(temperature=0.0, logprobs=1, min_tokens=4),
    dict(temperature=0.8, seed=5, logit_bias={5: 3.0, 9: -4.0}, min_p=0.05),
    dict(temperature=1.0, seed=6, structured_outputs=StructuredOutputsParams(regex="[a-z ]{3,30}")),
    dict(temperature=0.8),  # unseeded: a key drawn per sequence from the engine's generator
    dict(temperature=1.0, seed=8, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma", "delta"])),
    dict(temperature=0.9, seed=9, n=2, stop=["e"]),
]
SCENARIOS = {
    "roomy": {},
    "mixed_steps": dict(max_num_batched_tokens=24),
    "preemption": dict(num_kvcache_blocks=14),
    "decode_graphs": {},
    "tp2": dict(tensor_parallel_size=2),
}


def entries(logprobs) -> list | None:
    """Logprob entries as comparable tuples."""
    if logprobs is None:
        return None
    return [None if e is None else sorted((t, round(v.logprob, 5), v.rank) for t, v in e.items()) for e in logprobs]


def run(ckpt, scenario: str) -> tuple[list, list[list[int]]]:
    """Every output in full, and each decode step's rows (sequence ids)."""
    with make_llm(ckpt, seed=0, max_num_seqs=16, **SCENARIOS[scenario]) as llm:
        if scenario == "decode_graphs":
            use_decode_graphs(llm)
        prompts = mixed_prompts(llm.vocab_size, 16, seed=21, count=9)
        params = [SamplingParams(max_tokens=8 + 3 * (i % 4), ignore_eos=True, **KINDS[i % len(KINDS)])
                  for i in range(len(prompts))]
        schedule, steps = llm.scheduler.schedule, []

        def spy():
            seqs, is_prefill = schedule()
            steps.append([s.seq_id for s in seqs if s.num_scheduled_tokens == 1
                          and s.num_cached_tokens >= s.num_prompt_tokens])
            return seqs, is_prefill

        llm.scheduler.schedule = spy
        outputs = [(o.prompt_token_ids, entries(o.prompt_logprobs),
                    [(c.index, c.token_ids, c.text, c.finish_reason, entries(c.logprobs),
                      None if c.cumulative_logprob is None else round(c.cumulative_logprob, 4)) for c in o.outputs])
                   for o in llm.generate(prompts, params, use_tqdm=False)]
        if scenario == "preemption":
            assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.block_manager.num_used_blocks == 0
    return outputs, steps


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_longest_first_gives_the_outputs_of_admission_order(qwen3_ckpt, monkeypatch, scenario):
    monkeypatch.setattr(scheduler_module, "DECODE_LONGEST_FIRST", False)
    expected, _ = run(qwen3_ckpt, scenario)
    monkeypatch.setattr(scheduler_module, "DECODE_LONGEST_FIRST", True)
    got, steps = run(qwen3_ckpt, scenario)
    assert any(rows != sorted(rows) for rows in steps), "no decode step left admission order"
    assert got == expected
