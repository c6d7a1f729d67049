"""Structured outputs: the spec's checks, the bitmask (torch and Triton) against a plain
reference, greedy output equal to transformers under the same grammar, and sampled
outputs that satisfy their schema, regex, choice or grammar, whatever else the engine does
(n > 1, preemption, unconstrained neighbours, a grammar that does not compile)."""
from __future__ import annotations

import functools
import json
import re
import sys
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo import demo_model_path
from nanovllm.engine.structured import MAX_JSON_WHITESPACE, SequenceGrammar
from nanovllm.sampling.ops import apply_token_bitmask
from nanovllm.sampling_params import StructuredOutputsParams as Spec
from nanovllm.testing.checkpoints import hf_greedy
from parity import fail_at_call, make_llm, mixed_prompts

xgr = pytest.importorskip("xgrammar")

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
# Output that must end: every value bounded, whitespace runs bounded by the compiler.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "count", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
GRAMMAR_SENTENCE = re.compile(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)")


def check_satisfies(spec: Spec, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert GRAMMAR_SENTENCE.fullmatch(text), text


SPECS = [Spec(json=SCHEMA), Spec(json_object=True), Spec(regex=REGEX), Spec(choice=CHOICES), Spec(grammar=GRAMMAR)]
SPEC_IDS = ["json", "json_object", "regex", "choice", "grammar"]


# -- the spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of json, regex, choice, grammar and json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": 3}, "must be a JSON schema (a dict or its JSON text), got int"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a list of non-empty strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a list of non-empty strings"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be True or False, got 'yes'"),
])
def test_spec_refuses_what_is_not_one_valid_constraint(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Spec(**kwargs)


def test_spec_key_keeps_property_order_and_sampling_params_checks_its_type():
    assert Spec(json={"a": 1, "b": 2}).key() != Spec(json={"b": 2, "a": 1}).key()  # the output's order
    assert Spec(json={"a": 1}).key() == Spec(json='{"a": 1}').key()
    assert Spec(regex="a").key() != Spec(grammar="a").key()
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams, got dict"):
        SamplingParams(structured_outputs={"regex": "a"})


# -- the bitmask ---------------------------------------------------------------------------------


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """-inf wherever a row's bit is 0, bit by bit in Python."""
    expected = logits.clone()
    words = bitmask.tolist()
    for r, row in enumerate(rows):
        for token in range(logits.size(1)):
            if token // 32 >= len(words[r]) or not (words[r][token // 32] >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


def random_case(batch: int, vocab: int, rows: list[int], dtype: torch.dtype, seed: int, narrow: int = 0):
    """Random logits and bitmask rows; a `narrow` bitmask covers that many words fewer than the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=generator).to(dtype)
    words = (vocab + 31) // 32 - narrow
    bitmask = torch.randint(-(1 << 31), 1 << 31, (len(rows), words), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # every token allowed
    return logits, bitmask


def test_the_grammars_vocabulary_is_the_tokenizers(demo_llm):
    """A model vocabulary padded past the tokenizer's: the grammar covers the tokenizer's
    tokens (the padding would make xgrammar treat each id as a special token, slowing
    every step), and the bitmask rows are as wide as that."""
    from nanovllm.engine.structured import GrammarCompiler

    tokenizer = demo_llm.tokenizer
    compiler = GrammarCompiler(tokenizer, len(tokenizer) + 1000, {tokenizer.eos_token_id})
    assert compiler.tokenizer_info.vocab_size == len(tokenizer)
    assert compiler.bitmask_words == (len(tokenizer) + 31) // 32
    compiled = compiler.compile(Spec(choice=CHOICES)).result()
    assert compiler.sequence_grammar(compiled, None, [1, 2]).bitmask_words == compiler.bitmask_words


def test_the_cache_keeps_grammars_by_count_and_by_bytes(demo_llm, monkeypatch):
    """The least recently used compiled grammar goes first once the cache holds more than
    CACHE_SIZE of them or more than CACHE_BYTES (huge schemas compile to tens of MB)."""
    from nanovllm.engine import structured

    tokenizer = demo_llm.tokenizer
    compiler = structured.GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    specs = [Spec(choice=[f"{word}{i}" for i in range(40)]) for word in ("red", "green", "blue", "cyan")]
    sizes = [compiler.compile(spec).result().memory_size_bytes for spec in specs]
    monkeypatch.setattr(structured, "CACHE_BYTES", sizes[0] + sizes[2] + sizes[3])
    compiler.compile(specs[0])  # now the most recently used: specs[1] is the least
    assert list(compiler.cache) == [specs[i].key() for i in (2, 3, 0)]
    monkeypatch.setattr(structured, "CACHE_SIZE", 2)
    compiler.compile(specs[2])
    assert list(compiler.cache) == [specs[i].key() for i in (0, 2)]


def test_a_slow_grammar_holds_up_only_itself(demo_llm):
    """While one grammar compiles (held here until released), others compile and are
    served; a spec asked for from several threads at once compiles once."""
    import threading
    import time

    from nanovllm.engine.structured import GrammarCompiler

    tokenizer = demo_llm.tokenizer
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    release, started, compile_regex = threading.Event(), threading.Event(), compiler.compiler.compile_regex

    def held_compile(text):
        if text == "slow+":
            started.set()
            assert release.wait(timeout=60)
        return compile_regex(text)

    compiler.compiler = type("Held", (), {"compile_regex": staticmethod(held_compile)})()
    try:
        slow = compiler.compile(Spec(regex="slow+"))
        assert started.wait(timeout=60)
        fast = [compiler.compile(Spec(regex=f"[0-9]{{{n}}}")) for n in range(1, 4)]
        assert all(future.result(timeout=30) is not None for future in fast) and not slow.done()
        futures, spec, submit = [], Spec(regex="[a-z]{2}"), compiler.pool.submit
        # A pause between the cache lookup and the entry's store: unlocked, every thread would submit.
        compiler.pool.submit = lambda *args: time.sleep(0.05) or submit(*args)
        threads = [threading.Thread(target=lambda: futures.append(compiler.compile(spec))) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len({id(future) for future in futures}) == 1 and not slow.done()
    finally:
        release.set()
    assert slow.result(timeout=60) is not None
    compiler.shutdown()


@pytest.mark.parametrize("narrow", [0, 2], ids=["whole", "narrow"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_torch_bitmask_equals_bit_by_bit_reference(dtype, narrow):
    """Tokens past a narrow bitmask (a vocabulary padded past the tokenizer's) are disallowed."""
    rows = [0, 2, 5]
    logits, bitmask = random_case(6, 200, rows, dtype, seed=0, narrow=narrow)
    expected = reference_mask(logits, bitmask, rows)
    out = apply_token_bitmask(logits.clone(), bitmask, torch.tensor(rows))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("vocab,narrow", [(200, 0), (5000, 0), (151936, 0), (151936, 9)],
                         ids=["one_block", "ragged", "qwen", "padded_vocab"])
def test_triton_bitmask_equals_torch(dtype, vocab, narrow):
    """The kernel (the Triton interpreter without CUDA) against the torch path, which the
    test above checks bit by bit; rows without a grammar stay untouched."""
    pytest.importorskip("triton")
    from nanovllm.kernels.token_bitmask import apply_token_bitmask as kernel

    rows = [1, 3, 4]
    logits, bitmask = random_case(5, vocab, rows, dtype, seed=vocab, narrow=narrow)
    logits, bitmask = logits.to(DEVICE), bitmask.to(DEVICE)
    index = torch.tensor(rows, device=DEVICE)
    expected = apply_token_bitmask(logits.cpu().clone(), bitmask.cpu(), index.cpu())
    out = kernel(logits.clone(), bitmask, index)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(out[[0, 2]].cpu(), logits[[0, 2]].cpu())


# -- greedy output equals transformers under the same grammar --------------------------------------


class HFGrammarMask:
    """A transformers logits processor with its own xgrammar matcher, for one prompt: the
    oracle's view of what the grammar allows after each token."""

    def __init__(self, compiled, prompt_len: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.size(1) > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        bitmask = xgr.allocate_token_bitmask(1, scores.size(-1))
        self.matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(scores, bitmask)
        return scores


def oracle_compile(llm: LLM, spec: Spec):
    """The grammar compiled straight through xgrammar, as the engine is meant to."""
    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=llm.vocab_size,
                                              stop_token_ids=sorted(llm.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)
    if spec.json is not None or spec.json_object:
        schema = json.dumps(spec.json if spec.json is not None else {"type": "object"})
        return compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    if spec.choice is not None:
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
    return compiler.compile_grammar(spec.grammar)


def assert_greedy_equals_transformers(path, rounds: int = 1, max_tokens: int = 24, **engine_args) -> dict:
    """One batch, a different constraint on each prompt and one without: every output is
    token for token what transformers picks under the same grammar (or none), in each of
    `rounds` identical calls (the later ones from the prefix cache). Returns llm.stats()."""
    with make_llm(path, kvcache_block_size=8, **engine_args) as llm:
        prompts = mixed_prompts(llm.vocab_size, 8, seed=11, count=len(SPECS) + 1)
        specs = [*SPECS, None]
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=s) for s in specs]
        expected = []
        for prompt, spec in zip(prompts, specs):
            mask = None if spec is None else HFGrammarMask(oracle_compile(llm, spec), len(prompt))
            expected += hf_greedy(path, [prompt], max_tokens, logits_processor=mask)
        for _ in range(rounds):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for spec, out, tokens in zip(specs, outputs, expected):
                assert out.outputs[0].token_ids == tokens, spec
        assert llm.scheduler.block_manager.num_used_blocks == 0
        if rounds > 1:
            assert llm.scheduler.block_manager.num_prompt_tokens_hit > 0
        return llm.stats()


def test_greedy_equals_transformers_with_the_grammar(tiny_ckpt):
    assert_greedy_equals_transformers(tiny_ckpt)


def test_the_model_runs_while_the_matchers_advance(qwen3_ckpt, monkeypatch):
    """With grammars in the batch a decode step's model is still queued while the step
    before is in flight (Executor.forward with prev), and sampled once that step's tokens
    have advanced the matchers: the oracle's tokens all the same."""
    from nanovllm.executor.executor import Executor

    overlapped = []
    forward = Executor.forward

    def spy(self, seqs, is_prefill, prev=None):
        overlapped.append(prev is not None)
        return forward(self, seqs, is_prefill, prev)

    monkeypatch.setattr(Executor, "forward", spy)
    assert_greedy_equals_transformers(qwen3_ckpt)
    assert sum(overlapped) >= 20  # nearly every one of the 24 decode steps


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(qwen3_ckpt):
    """A token budget below the longest prompt (prefills in chunks, the first token sampled
    under the grammar only at the last chunk), then the same batch from the prefix cache."""
    assert_greedy_equals_transformers(qwen3_ckpt, rounds=2, max_num_batched_tokens=24, max_num_seqs=8)


def test_greedy_equals_transformers_under_tensor_parallelism(qwen3_ckpt):
    """Two ranks (gloo): rank 0 fills the bitmask and samples while the workers run their shards."""
    assert_greedy_equals_transformers(qwen3_ckpt, tensor_parallel_size=2)


@pytest.fixture
def draft_rows(monkeypatch) -> list[int]:
    """The drafts of each constrained sequence whose rows were filled past them."""
    from nanovllm.sampling import logits_processors

    counts, fill = [], logits_processors.fill_after_drafts

    def spy(seqs, rows, bitmask, filler):
        counts.extend(seq.num_draft_tokens for seq in seqs)
        fill(seqs, rows, bitmask, filler)

    monkeypatch.setattr(logits_processors, "fill_after_drafts", spy)
    return counts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equals_transformers_while_speculating(qwen3_ckpt, method, draft_rows):
    """Speculative decoding: row j of a constrained sequence allows what its grammar allows
    after the sequence's first j drafts (n-gram drafts stop before one the grammar refuses; a
    draft model's, the model itself unconstrained here, are verified as they come)."""
    config = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
              if method == "ngram" else {"model": str(qwen3_ckpt), "num_speculative_tokens": 3})
    stats = assert_greedy_equals_transformers(qwen3_ckpt, max_tokens=48, speculative_config=config)
    assert draft_rows and stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
@pytest.mark.gpu
def test_greedy_equals_transformers_with_the_grammar_on_cuda(qwen3_ckpt, enforce_eager, attention_backend,
                                                            speculative):
    """float32 on the GPU: the Triton bitmask kernel, with and without CUDA graphs (and
    n-gram speculation, whose verifying steps replay the decode graphs)."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    stats = assert_greedy_equals_transformers(qwen3_ckpt, device="cuda", enforce_eager=enforce_eager,
                                              attention_backend=attention_backend, max_tokens=48 if speculative else 24,
                                              speculative_config=config if speculative else None)
    assert not speculative or stats["spec_decode_num_accepted_tokens"] > 0


# -- sampled outputs satisfy their constraint --------------------------------------------------------


@pytest.fixture(scope="module")
def demo_llm():
    with LLM(demo_model_path(), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=96) as llm:
        yield llm


def test_allowed_prefix_counts_up_to_a_refused_token_and_keeps_the_state(demo_llm):
    """What n-gram drafts the grammar lets a sequence verify: up to the first it refuses, or
    through the one it ends on; its matcher's state stays as it was."""
    grammar = SequenceGrammar(xgr.GrammarMatcher(oracle_compile(demo_llm, Spec(choice=CHOICES))), demo_llm.vocab_size)
    encode = functools.partial(demo_llm.tokenizer.encode, add_special_tokens=False)
    maybe, no, eos = encode("maybe so"), encode("no"), min(demo_llm.eos_token_ids)
    assert grammar.allowed_prefix(maybe + no) == len(maybe)
    assert grammar.allowed_prefix(maybe + [eos] + no) == len(maybe) + 1
    assert grammar.allowed_prefix(no + [eos]) == len(no) + 1
    assert grammar.allowed_prefix([eos]) == 0 and not grammar.is_terminated()
    assert grammar.allowed_prefix([demo_llm.vocab_size, *maybe]) == 0  # (past the vocabulary: refused)
    assert all(grammar.accept(t) for t in maybe + [eos]) and grammar.is_terminated()


def test_a_grammar_past_its_fill_budget_ends_only_its_own_output(demo_llm, monkeypatch, caplog):
    """A grammar whose bitmask takes longer than FILL_BUDGET_S to fill (an ambiguous one's
    parser can take seconds a token, and every sequence waits) ends its output with
    "abort" and a warning that says why; its neighbours run on as alone. Here the budget
    is a nanosecond, so every grammar overruns it."""
    from nanovllm.sampling import logits_processors

    monkeypatch.setattr(logits_processors, "FILL_BUDGET_S", 1e-9)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = demo_llm.generate(["def f("], plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0, max_tokens=8, structured_outputs=Spec(choice=CHOICES))
    outputs = demo_llm.generate(["def f(", "x = ", "y = "], [plain, constrained, constrained], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone
    assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outputs[1:]] == [("abort", 1)] * 2
    assert "to find or accept the next token" in caplog.text and "an ambiguous grammar?" in caplog.text
    assert demo_llm.scheduler.block_manager.num_used_blocks == 0


def test_only_the_grammars_that_overrun_alone_are_blamed(monkeypatch):
    """After a batch fill past the budget each row is filled again alone, timed: only a
    grammar that alone takes longer is marked (SequenceGrammar.overran)."""
    import time
    from types import SimpleNamespace

    from nanovllm.sampling import logits_processors

    monkeypatch.setattr(logits_processors, "FILL_BUDGET_S", 0.2)

    def sequence(delay: float):
        matcher = SimpleNamespace(fill_next_token_bitmask=lambda bitmask, row: time.sleep(delay))
        return SimpleNamespace(grammar=SimpleNamespace(matcher=matcher, overran=0.0))

    seqs = [sequence(0), sequence(0.4), sequence(0)]
    logits_processors._blame_slow_fills(seqs, [0, 1, 2], torch.zeros(3, 4, dtype=torch.int32))
    assert [seq.grammar.overran >= 0.4 for seq in seqs] == [False, True, False]
    assert seqs[0].grammar.overran == seqs[2].grammar.overran == 0.0
    # A token's accept past the budget marks its grammar too (the sequence ends at its next token).
    slow = SequenceGrammar(SimpleNamespace(accept_token=lambda token: time.sleep(0.4) or True), vocab_size=64)
    fast = SequenceGrammar(SimpleNamespace(accept_token=lambda token: True), vocab_size=64)
    assert slow.accept(5) and fast.accept(5)
    assert slow.overran >= 0.4 and fast.overran == 0.0 and "an ambiguous grammar?" in slow.overran_message()


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_sampled_outputs_satisfy_the_constraint(demo_llm, spec):
    """The demo model (which writes Python, not JSON) sampled hot, over seeds and n = 2:
    every completion that ends with "stop" satisfies its constraint; one cut by max_tokens
    (only where the constraint is unbounded: any JSON object, the grammar) is a prefix the
    grammar accepts."""
    params = SamplingParams(temperature=1.2, top_p=0.95, max_tokens=160, n=2, seed=3, structured_outputs=spec)
    outputs = demo_llm.generate(["def main():\n", "x = ", "# data\n"], params, use_tqdm=False)
    completions = [completion for out in outputs for completion in out.outputs]
    bounded = spec.json_object is None and spec.grammar is None
    for completion in completions:
        if completion.finish_reason == "stop":
            check_satisfies(spec, completion.text)
            continue
        assert completion.finish_reason == "length" and not bounded, completion
        matcher = xgr.GrammarMatcher(oracle_compile(demo_llm, spec))
        assert all(matcher.accept_token(t) for t in completion.token_ids)
    assert sum(c.finish_reason == "stop" for c in completions) >= len(completions) // 2
    assert demo_llm.scheduler.block_manager.num_used_blocks == 0


def test_the_grammar_ends_the_output_even_with_ignore_eos(demo_llm):
    params = SamplingParams(temperature=0.8, max_tokens=40, seed=0, ignore_eos=True, structured_outputs=Spec(regex=REGEX))
    [out] = demo_llm.generate(["x = "], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and re.fullmatch(REGEX, out.outputs[0].text)


def test_preemption_and_unconstrained_neighbours_change_nothing(tiny_ckpt):
    """Seeded constrained requests beside unconstrained ones: the same tokens in a pool so
    small that sequences are preempted and recomputed as in a roomy one, and the
    unconstrained ones the same as when they run alone."""
    spec_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=s)
                   for i, s in enumerate(SPECS)]
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    with make_llm(tiny_ckpt, kvcache_block_size=8) as llm:
        prompts = [p[:20] for p in mixed_prompts(llm.vocab_size, 8, seed=2, count=8)][: len(SPECS) + 2]
        params = [*spec_params, free, free]
        roomy = llm.generate(prompts, params, use_tqdm=False)
        alone = llm.generate(prompts[-2:], free, use_tqdm=False)
    with make_llm(tiny_ckpt, kvcache_block_size=8, num_kvcache_blocks=12) as llm:
        tight = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert [o.outputs[0].token_ids for o in roomy[-2:]] == [o.outputs[0].token_ids for o in alone]


def test_a_grammar_that_does_not_compile_fails_before_anything_runs(demo_llm):
    good = SamplingParams(temperature=0, max_tokens=8)
    bad = SamplingParams(max_tokens=8, structured_outputs=Spec(regex="(a"))
    with pytest.raises(ValueError, match=r"^prompt 1: the regex cannot be compiled: .*parenthesis"):
        demo_llm.generate(["x = ", "y = "], [good, bad], use_tqdm=False)
    assert demo_llm.is_finished() and demo_llm.scheduler.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match=r"^the JSON schema cannot be compiled"):
        demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(json={"type": "no-such-type"})),
                          use_tqdm=False)
    for spec, kind in [(Spec(grammar="root ::= root"), "the grammar"), (Spec(regex=r"[^\s\S]"), "the regex")]:
        with pytest.raises(ValueError, match=f"^{kind} matches no text this model's tokens can spell$"):
            demo_llm.generate("x = ", SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)
    with pytest.raises(ValueError, match="^the JSON schema matches no JSON value$"):  # xgrammar's: the empty text
        demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(json={"anyOf": []})), use_tqdm=False)
    [empty] = demo_llm.generate("x = ", SamplingParams(max_tokens=4, structured_outputs=Spec(regex="a?")),
                                use_tqdm=False)  # a regex may match the empty text
    assert empty.outputs[0].text in ("", "a")
    [out] = demo_llm.generate("x = ", SamplingParams(temperature=0, max_tokens=4, structured_outputs=Spec(choice=CHOICES)),
                              use_tqdm=False)
    assert out.outputs[0].text in CHOICES


# Schemas xgrammar's grammars do not hold to (engine/json_schema.py's refusal), each with a
# value that breaks it and that the grammar takes, and what the refusal names.
UNENFORCED = [
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, '"abcd"', "'allOf' of more than one schema (at #)"),
    ({"not": {"type": "string"}}, '"a"', "'not'"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "3", "'if'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems'"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]", "'contains'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "'dependentRequired'"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "'multipleOf' other than an integer on integers"),
    ({"type": "integer", "multipleOf": 2.5}, "4", "'multipleOf' other than an integer on integers"),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5}, "3", "'minimum' beside '$ref'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "anyOf": [{"required": ["a"]}]}, "5",
     "'properties' beside 'anyOf'"),
    ({"anyOf": [{"type": "integer"}], "minimum": 3}, "1", "'minimum' beside 'anyOf'"),
    ({"minLength": 3}, '"ab"', "'minLength' without a 'type'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a": 1}',
     "'required' naming 'b', which 'properties' does not define"),
    ({"enum": ["a", "b"], "const": "c"}, '"c"', "a 'const' that is not among the 'enum' values"),
    ({"type": "string", "enum": ["a", 1]}, "1", "'enum' values that are not of the schema's 'type'"),
    ({"components": {"x": {"not": {"type": "string"}}}, "$ref": "#/components/x"}, '"a"',
     "'not' (at #/components/x)"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     '{"tags": [1, 1]}', "'uniqueItems' (at #/properties/tags)"),
]


@pytest.mark.parametrize(("schema", "breaking", "refusal"), UNENFORCED, ids=[c[2] for c in UNENFORCED])
def test_a_schema_the_grammar_would_not_hold_to_is_refused(demo_llm, schema, breaking, refusal):
    """xgrammar's grammar of the schema takes a value that breaks it (so an output could),
    and the engine refuses the schema, naming the keyword and where it is."""
    from xgrammar.testing import _is_grammar_accept_string

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema)
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), breaking)
    with pytest.raises(ValueError, match=f"^the JSON schema uses {re.escape(refusal)}.*, which structured outputs "
                                         f"cannot enforce$"):
        demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(json=schema)), use_tqdm=False)
    assert demo_llm.is_finished() and demo_llm.scheduler.block_manager.num_used_blocks == 0


def test_what_the_grammar_holds_to_is_not_refused(demo_llm):
    """The forms next to the refused ones that the grammar does hold to: one schema under
    allOf, annotations and extensions beside a $ref or anyOf, multipleOf on integers, a const
    among the enum values, enum values of the type, and properties named like the refused
    keywords; a $ref out of the schema is refused."""
    from xgrammar.testing import _is_grammar_accept_string

    for schema, breaking in [
        ({"allOf": [{"type": "string"}]}, "3"),
        ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "description": "a count", "x-order": 1}, '"x"'),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "n", "default": None}, '"x"'),
        ({"type": ["integer", "null"], "multipleOf": 3}, "4"),
        ({"type": "string", "enum": ["a", "b"], "const": "b"}, '"a"'),  # (pydantic's single-value Literal)
        ({"type": ["string", "null"], "enum": ["a", None]}, '"b"'),
        ({"type": "object", "properties": {"not": {"type": "integer"}, "uniqueItems": {"type": "integer"}},
          "required": ["not"]}, '{"uniqueItems": 1}'),
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(breaking), schema)
        assert not _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), breaking)
        [out] = demo_llm.generate("x = ", SamplingParams(max_tokens=24, structured_outputs=Spec(json=schema)),
                                  use_tqdm=False)
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    with pytest.raises(ValueError, match=r"uses a '\$ref' outside the schema \('http://example.com/a.json'\) \(at #\)"):
        demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(json={"$ref": "http://example.com/a.json"})),
                          use_tqdm=False)


def test_a_pattern_too_costly_to_build_is_refused(demo_llm):
    """A pattern that xgrammar would write out to millions of rules (minutes of a compile
    thread, which no client's departure stops) is refused at once, naming where it is, and so
    is an integer bound xgrammar cannot compile; the patterns of everyday schemas are not, and
    their outputs match them."""
    from nanovllm.engine.json_schema import MAX_PATTERN_COST, pattern_cost

    costly = "^([a-z]{1,100}){1,100}$"
    assert pattern_cost(costly) > MAX_PATTERN_COST
    for schema, where in [({"type": "string", "pattern": costly}, "#"),
                          ({"type": "object", "patternProperties": {costly: {"type": "integer"}}}, "#"),
                          ({"type": "object", "properties": {"id": {"type": "string", "pattern": costly}}},
                           "#/properties/id")]:
        refused = rf"^the JSON schema has a 'pattern' .* too large to build .*\(at {where}\)$"
        with pytest.raises(ValueError, match=refused):
            demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(json=schema)), use_tqdm=False)
    assert pattern_cost("^(?<n>[a-z]{1,100}){1,100}$") > MAX_PATTERN_COST  # ECMA's named group, read as (?:
    assert pattern_cost(r"(a{1,50}\k<x>){1,100}") > MAX_PATTERN_COST  # unread by Python: the product of the counts
    assert pattern_cost("(a|" * 400 + "b" + ")" * 400) <= MAX_PATTERN_COST  # past Python's depth: no error
    for bound, shown in [(1e30, "1e+30"), (10**400, "1" + "0" * 19 + "..."), (2**63, str(2**63))]:
        refused = rf"^the JSON schema has an integer 'minimum' \({re.escape(shown)}\) past "
        with pytest.raises(ValueError, match=refused):
            schema = {"type": "integer", "minimum": bound}
            demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(json=schema)), use_tqdm=False)
    lowest = {"type": "integer", "minimum": -2**63}  # the 64 bits' own least value compiles
    demo_llm.generate("x = ", SamplingParams(max_tokens=2, structured_outputs=Spec(json=lowest)), use_tqdm=False)
    everyday = [r"^(\d{1,3}\.){3}\d{1,3}$", r"^\d{4}-\d{2}-\d{2}$", "^[A-Z][a-z]{1,20}( [A-Z][a-z]{1,20}){0,3}$",
                "^[a-z]{1,1000}$", "^([a-z]{1,3}){1,10}$", r"^(\w+\s?){1,50}$", r"^\p{L}+$",
                r"^(([0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}|::)$"]
    for pattern in everyday:
        assert pattern_cost(pattern) <= MAX_PATTERN_COST
    schema = {"type": "string", "pattern": everyday[0]}
    [out] = demo_llm.generate("x = ", SamplingParams(max_tokens=24, structured_outputs=Spec(json=schema)),
                              use_tqdm=False)
    if out.outputs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert demo_llm.is_finished()


def test_token_constraints_that_forbid_the_grammars_first_tokens_are_refused(demo_llm):
    """allowed_token_ids or bad_words that leave none of the tokens a grammar allows first
    could only give empty text: refused before anything runs (offline, as a server's 400),
    where they once ended with "stop" and a warning in the log. Constraints that leave one
    token run, and the output keeps to both."""
    tokenizer = demo_llm.tokenizer
    choices = Spec(choice=["yes", "no"])
    for fields in (dict(allowed_token_ids=[tokenizer.convert_tokens_to_ids("x")]),
                   dict(bad_words=["yes", "y", "ye", "no", "n"])):
        with pytest.raises(ValueError, match=r"forbid every token the structured output's grammar allows first"):
            demo_llm.generate("Answer: ", SamplingParams(max_tokens=4, structured_outputs=choices, **fields),
                              use_tqdm=False)
        assert demo_llm.is_finished()
    [yes] = tokenizer.encode("yes")
    [out] = demo_llm.generate("Answer: ", SamplingParams(temperature=0, max_tokens=4, structured_outputs=choices,
                                                         allowed_token_ids=[yes, *demo_llm.eos_token_ids]),
                              use_tqdm=False)
    assert out.outputs[0].text == "yes"


def test_a_schema_nested_past_pythons_depth_is_refused(demo_llm):
    schema: dict = {}
    inner = schema
    for _ in range(5000):
        inner["anyOf"] = [{}]
        inner = inner["anyOf"][0]
    with pytest.raises(ValueError, match="^structured_outputs.json cannot be written as JSON: maximum recursion"):
        demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(json=schema)), use_tqdm=False)
    assert demo_llm.is_finished() and demo_llm.scheduler.block_manager.num_used_blocks == 0


def test_a_grammar_failing_after_add_request_is_reported_not_run(demo_llm):
    """The server's path: add_request does not wait for the grammar; one that then fails
    ends its request, which take_failed hands over with the reason."""
    request = demo_llm.make_request("x = ", SamplingParams(max_tokens=8, structured_outputs=Spec(regex="a+")))
    request.grammar = Future()  # still compiling when it is added
    demo_llm.add_request(request)
    demo_llm.step()
    assert not demo_llm.is_finished() and demo_llm.scheduler.is_finished()  # it waits outside the scheduler
    request.grammar.set_exception(ValueError("the regex cannot be compiled: test"))
    while not demo_llm.is_finished():
        demo_llm.step()
    [failed] = demo_llm.take_failed()
    assert failed is request and str(request.error) == "the regex cannot be compiled: test"
    assert request.finished and all(seq.finish_reason == "abort" for seq in request.seqs)
    assert demo_llm.take_failed() == []


def test_a_grammar_failing_otherwise_ends_its_request_alone(demo_llm):
    """A grammar whose future fails with another error than a spec's ValueError (here a
    cancelled compilation) ends its request with that error; the request queued after it
    runs."""
    from concurrent.futures import CancelledError

    cancelled = demo_llm.make_request("x = ", SamplingParams(max_tokens=8, structured_outputs=Spec(regex="a+")))
    cancelled.grammar = Future()  # still compiling when it is added
    after = demo_llm.make_request("y = ", SamplingParams(temperature=0, max_tokens=4,
                                                         structured_outputs=Spec(choice=CHOICES)))
    after.grammar.result()
    after.grammar, compiled = Future(), after.grammar
    for request in (cancelled, after):
        demo_llm.add_request(request)
    cancelled.grammar.set_exception(CancelledError())
    after.grammar.set_result(compiled.result())
    while not demo_llm.is_finished():
        demo_llm.step()
    [failed] = demo_llm.take_failed()
    assert failed is cancelled and isinstance(cancelled.error, CancelledError)
    assert demo_llm.output(after).outputs[0].text in CHOICES


def test_shutting_down_mid_run_lets_go_of_the_half_run_step_and_the_grammars():
    """shutdown() while a structured step is queued in two halves: the queued step (its
    logits), the grammar compiler's thread and its compiled grammars go too."""
    import threading

    def grammar_threads() -> set[threading.Thread]:
        return {thread for thread in threading.enumerate() if thread.name.startswith("nanovllm-grammar")}

    others = grammar_threads()  # other engines' in this process
    llm = LLM(demo_model_path(), device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=32)
    for prompt, spec in (("x = ", Spec(regex="[a-z ]{1,40}")), ("def f():", None)):
        llm.add_request(llm.make_request(prompt, SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec)))
    while llm.forwarded is None:
        llm.step()
    grammars = llm.grammars
    llm.shutdown()
    assert llm.forwarded is None and llm.grammars is None and not grammars.cache and llm.is_finished()
    grammars.pool.shutdown(wait=True)  # returns at once: nothing was left to compile
    assert grammar_threads() <= others


def test_without_xgrammar_a_structured_request_says_what_to_install(demo_llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now fails
    monkeypatch.setattr(demo_llm, "grammars", None)
    with pytest.raises(ValueError, match=re.escape("pip install 'nanovllm[structured]'")):
        demo_llm.generate("x = ", SamplingParams(structured_outputs=Spec(regex="a")), use_tqdm=False)
    assert demo_llm.is_finished()


# -- with a reasoning parser: the grammar applies after the reasoning -------------------------------


class HFReasoningThenGrammar:
    """The oracle's reading of the rule: no grammar while the reasoning runs, which it does
    from the start when the prompt opened <think>, or from the first token when that token
    is <think> (allowed there beside the grammar's own); the grammar after </think>."""

    def __init__(self, compiled, prompt_len: int, state: str, tags):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.prompt_len, self.tags = prompt_len, tags
        self.waiting, self.first_may_open = state == "open", state == "undecided"

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.size(1) - self.prompt_len
        if generated:
            last = int(input_ids[0, -1])
            if generated == 1 and self.first_may_open and last == self.tags.start_id:
                self.waiting = True
            elif self.waiting:
                self.waiting = last != self.tags.end_id
            else:
                assert self.matcher.accept_token(last)
        if self.waiting:
            return scores
        bitmask = xgr.allocate_token_bitmask(1, scores.size(-1))
        self.matcher.fill_next_token_bitmask(bitmask)
        if generated == 0 and self.first_may_open:
            allowed = scores.clone()
            xgr.apply_token_bitmask_inplace(scores, bitmask)
            scores[0, self.tags.start_id] = allowed[0, self.tags.start_id]
            return scores
        xgr.apply_token_bitmask_inplace(scores, bitmask)
        return scores


def prompt_whose_greedy_next_is(path, token_id: int, suffix: list[int], vocab: int, tries: int = 4000) -> list[int]:
    """A random prompt ending in `suffix` after which the model's greedy pick is token_id."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    body = torch.randint(3, vocab, (tries, 6), generator=torch.Generator().manual_seed(token_id))
    ids = torch.cat([body, torch.tensor([suffix] * tries, dtype=torch.long)], dim=1)
    with torch.inference_mode():
        hits = (model(input_ids=ids).logits[:, -1].argmax(-1) == token_id).nonzero()
    assert len(hits), "no such prompt among the tries"
    return ids[int(hits[0])].tolist()


def test_grammar_applies_after_the_reasoning(qwen3_tools_ckpt):
    """Each way an output can start (inside the reasoning, undecided, after it) with the
    grammar on every prompt: token for token what transformers gives under the same rule.
    The prompts include ones after which the model closes the reasoning, or opens it, at
    once, so that both turns of the rule are taken."""
    max_tokens = 16
    spec = Spec(regex=REGEX)
    with make_llm(qwen3_tools_ckpt, kvcache_block_size=8, reasoning_parser="qwen3") as llm:
        tags = llm.reasoning
        vocab = tags.start_id  # the added tags come last: draw below them
        plain = mixed_prompts(vocab, 8, seed=4, count=3)
        prompts = [
            prompt_whose_greedy_next_is(qwen3_tools_ckpt, tags.end_id, [tags.start_id], vocab),  # closes at once
            plain[0] + [tags.start_id],  # reasoning to the end
            prompt_whose_greedy_next_is(qwen3_tools_ckpt, tags.start_id, [], vocab),  # opens at once
            plain[1],  # undecided
            plain[2] + [tags.start_id, 5, tags.end_id],  # closed in the prompt
        ]
        states = [tags.state_after(p) for p in prompts]
        assert states == ["open", "open", "undecided", "undecided", "closed"]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        compiled = oracle_compile(llm, spec)
        for prompt, state, out in zip(prompts, states, outputs):
            rule = HFReasoningThenGrammar(compiled, len(prompt), state, tags)
            [expected] = hf_greedy(qwen3_tools_ckpt, [prompt], max_tokens, logits_processor=rule)
            assert out.outputs[0].token_ids == expected, state
        closed_at_once = outputs[0].outputs[0]
        assert closed_at_once.token_ids[0] == tags.end_id
        assert re.fullmatch(REGEX, closed_at_once.text.removeprefix(tags.end))
        assert outputs[2].outputs[0].token_ids[0] == tags.start_id
        assert re.fullmatch(REGEX, outputs[4].outputs[0].text)


def test_a_structured_step_whose_sampling_fails_ends_its_sequences_and_the_engine_serves_on(demo_llm, monkeypatch):
    """A structured step goes in two halves (its model queued, then sampled once the step
    before is read): a sampling half that raises ends that step's sequences, and the
    engine serves the next structured request as it would alone."""
    params = SamplingParams(temperature=0, max_tokens=6, structured_outputs=Spec(choice=CHOICES))
    [alone] = demo_llm.generate("y = ", params, use_tqdm=False)
    request = demo_llm.make_request("x = ", SamplingParams(temperature=0, max_tokens=6,
                                                           structured_outputs=Spec(regex="[a-z]{6}")))
    demo_llm.add_request(request)
    fail_at_call(monkeypatch, demo_llm.executor, "sample", 2, RuntimeError("the bitmask could not be filled"))
    with pytest.raises(RuntimeError, match="the bitmask could not be filled"):
        while not demo_llm.is_finished():
            demo_llm.step()
    monkeypatch.undo()
    while not demo_llm.is_finished():
        demo_llm.step()
    assert demo_llm.output(request).outputs[0].finish_reason == "abort"
    assert demo_llm.scheduler.block_manager.num_used_blocks == 0
    [again] = demo_llm.generate("y = ", params, use_tqdm=False)
    assert again.outputs[0].text == alone.outputs[0].text
