"""Helpers shared by the parity tests: prompt sets that exercise block boundaries and
prefix sharing, a CPU engine for them, and comparisons against the transformers oracle;
and a method made to fail once, for the engine's failure paths."""
from __future__ import annotations

import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.testing.checkpoints import hf_greedy, hf_logits

MAX_TOKENS = 10


def mixed_prompts(vocab_size: int, block_size: int, seed: int = 0, count: int = 9) -> list[list[int]]:
    """Prompts from 1 token to several blocks, including exact block multiples."""
    rng = random.Random(seed)
    lengths = [1, 2, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size + 5, 5, 4 * block_size]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths[:count]]


def shared_prefix_prompts(vocab_size: int, block_size: int, seed: int = 1) -> list[list[int]]:
    """Prompts sharing a two-block prefix, some ending exactly on a block boundary."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(2 * block_size)]
    tails = [0, 1, 3, block_size, block_size - 1, 2 * block_size, 7, 5]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in tails]


def looping_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short pattern (which a tiny random model tends to continue, so
    drafts are found and some kept), and a random one and a one-token one."""
    rng = random.Random(seed)

    def repeated(length: int, period: int) -> list[int]:
        pattern = [rng.randrange(3, vocab_size) for _ in range(period)]
        return (pattern * (length // period + 1))[:length]

    return [repeated(30, 5), repeated(17, 3), [5], repeated(60, 7), [rng.randrange(3, vocab_size) for _ in range(20)]]


# The Triton kernels on a CPU engine (make_llm's default) run under the interpreter, which
# only a machine without CUDA uses; on a CUDA machine test_gpu.py runs them for real.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernels on a CPU engine need "
                                      "the interpreter (no CUDA); on CUDA machines test_gpu.py runs them")


def make_llm(path, **kwargs) -> LLM:
    args = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=512)
    args.update(kwargs)
    return LLM(str(path), **args)


def assert_matches_hf(llm: LLM, path, prompts: list[list[int]], ignore_eos: bool = True) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(path, prompts, MAX_TOKENS, ignore_eos=ignore_eos)
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == ref, f"prompt {i} (length {len(prompts[i])})"


def use_decode_graphs(llm) -> list[tuple[int, int]]:
    """Give a CPU engine the decode graphs in their plain-call form, captured as on CUDA;
    returns the (rows, bucket) of every replay from then on."""
    runner = llm.executor.runner
    graphs = runner.graph_runner = runner.decode_graph_runner(graphs=False)
    graphs.capture()
    replays, bucket_for = [], graphs.bucket_for

    def recorded(rows: int, multi_row: bool = False) -> int:
        replays.append((rows, bucket_for(rows, multi_row)))
        return replays[-1][1]

    graphs.bucket_for = recorded
    return replays


def generate_twice(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of a second identical call (the first fills the prefix cache)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_differs_only_at_ties(path, prompts, got, expected, tolerance: float) -> None:
    """Tokens equal the oracle's up to the first divergence, and there the oracle's
    logits for the two tokens are within `tolerance` times the largest |logit| of each
    other (a tie at the precision in use)."""
    for prompt, ours, ref in zip(prompts, got, expected):
        if ours == ref:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        logits = hf_logits(path, prompt + ref[:i])[-1]
        gap = (logits[ref[i]] - logits[ours[i]]).item()
        scale = logits.abs().max().item()
        assert gap <= tolerance * scale, f"diverged at step {i} with an oracle logit gap of {gap:.4f} (max |logit| {scale:.2f})"


# A tie, as a fraction of the oracle's largest |logit|: float32 differs from transformers
# only by summation order; bf16 keeps 8 significant bits (0.4%), and through two layers and
# the LM head a few percent of the logit scale is a tie.
TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.03}


def fail_at_call(monkeypatch, owner, name: str, call: int, error: BaseException) -> None:
    """owner.name raises `error` at its call-th call, and runs as before at every other one
    (monkeypatch.undo restores it)."""
    method, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise error
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
