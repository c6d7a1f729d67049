"""Structured outputs through xgrammar: grammars compiled off the step loop, cached by
their text, and a matcher per sequence.

A request's StructuredOutputsParams is compiled in a thread pool (GrammarCompiler.compile
returns a future): the request waits outside the scheduler until its grammar is ready, so
compiling never holds up the steps of the others. Each of its sequences then
gets a SequenceGrammar around an xgrammar GrammarMatcher: the output processor advances
it on every token the sequence records, and the sampler's bitmask processor asks it which
tokens may come next. The grammar's end allows only end-of-sequence, which ends the
sequence with "stop". With a reasoning parser, the grammar applies after the reasoning
(engine/reasoning.py).
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.json_schema import refusal
from nanovllm.engine.reasoning import OPEN, UNDECIDED, ReasoningTags
from nanovllm.sampling import logits_processors
from nanovllm.sampling.logits_processors import INT32_BIT
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.utils.env import env_int

XGRAMMAR_MISSING = "structured outputs need xgrammar: pip install 'nanovllm[structured]'"
# Whitespace runs inside JSON are bounded: a model that would loop on spaces still ends.
MAX_JSON_WHITESPACE = 16
# Compiled grammars kept (the least recently used goes first): at most this many, and at
# most this many bytes as xgrammar counts them (a huge schema's grammar runs to tens of MB;
# vLLM bounds xgrammar's cache at 512 MB too).
CACHE_SIZE = 256
CACHE_BYTES = env_int("NANOVLLM_GRAMMAR_CACHE_MB", 512, least=0) << 20
# Grammars compiling at once: xgrammar releases the GIL while it compiles, so a schema that
# takes seconds holds up only itself, not the small ones that arrive behind it.
COMPILE_THREADS = 4
# What each kind of spec is called in an error.
KIND_NAMES = {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
              "choice": "the choices", "grammar": "the grammar"}
# xgrammar's errors start with a time and its source file: "[09:47:30] /project/cpp/x.cc:94: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON's string escapes are
    EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class GrammarCompiler:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: set[int]):
        try:
            import xgrammar
        except ImportError:
            raise ValueError(XGRAMMAR_MISSING) from None
        self._xgrammar = xgrammar
        # The grammar's vocabulary is the tokenizer's: ids past it (a model's vocabulary is
        # often padded) are never allowed. Counting them in would make xgrammar treat each
        # as a special token, which slows every accepted token down (benchmarks/RESULTS.md).
        text_vocab = max(len(tokenizer), max(stop_token_ids, default=-1) + 1)
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=min(vocab_size, text_vocab), stop_token_ids=sorted(stop_token_ids) or None)
        self.bitmask_words = (self.tokenizer_info.vocab_size + 31) // 32
        self.compiler = xgrammar.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self.pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="nanovllm-grammar")
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache's: a server checks grammars from several threads

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar, soon: a future whose result raises ValueError if the spec
        cannot be compiled."""
        key = spec.key()
        with self._lock:
            future = self.cache.get(key)
            if future is None:
                future = self.cache[key] = self.pool.submit(self._compile, *key)
            self.cache.move_to_end(key)
            self._evict()
        return future

    def _evict(self) -> None:
        """Drop the least recently used grammars past CACHE_SIZE or CACHE_BYTES (those still
        compiling count no bytes yet). A request holding one keeps it until it ends."""
        sizes = [_size(future) for future in self.cache.values()]
        total = sum(sizes)
        for size in sizes:
            if len(self.cache) <= CACHE_SIZE and total <= CACHE_BYTES:
                break
            self.cache.popitem(last=False)
            total -= size

    def shutdown(self) -> None:
        """Stop the compiling threads (compiles under way run to their end) and drop the cache."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self.cache.clear()

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile now (the caller is off the event loop); ValueError if it cannot be."""
        self.compile(spec).result()

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self.compiler
        kind, compact = kind.removesuffix("_compact"), kind.endswith("_compact")
        if kind == "json" and (why := refusal(text)):
            raise ValueError(f"{KIND_NAMES[kind]} {why}")
        try:
            if kind in ("json", "json_object"):
                compiled = compiler.compile_json_schema(
                    text if kind == "json" else '{"type": "object"}', any_whitespace=not compact,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(choice_grammar(json.loads(text)) if kind == "choice" else text)
        except RuntimeError as exc:
            message = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
            raise ValueError(f"{KIND_NAMES[kind]} cannot be compiled: {message}") from None
        first = self._first_tokens(compiled)
        if first == "none":
            raise ValueError(f"{KIND_NAMES[kind]} matches no text this model's tokens can spell")
        if first == "stop" and kind == "json":  # no JSON value is empty: a schema of none ({"anyOf": []})
            raise ValueError(f"{KIND_NAMES[kind]} matches no JSON value")
        return compiled

    def _first_tokens(self, compiled: Any) -> str:
        """What a fresh matcher allows: "none" (`root ::= root`, the regex `[^\\s\\S]`: every
        request would end at once with empty text and "stop"), "stop" (end-of-sequence
        alone: the empty text only) or "text"."""
        bitmask = self._first_bitmask(compiled)
        if not bitmask.any():
            return "none"
        for stop in self.tokenizer_info.stop_token_ids:  # clear the stop tokens' bits: any left?
            bitmask[0, stop // 32] &= ~INT32_BIT[stop % 32]
        return "text" if bitmask.any() else "stop"

    def _first_bitmask(self, compiled: Any) -> Any:
        """The [1, words] int32 bitmask of the tokens a fresh matcher of `compiled` allows."""
        bitmask = self._xgrammar.allocate_token_bitmask(1, self.tokenizer_info.vocab_size)
        self._xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return bitmask

    def check_first_token(self, compiled: Any, params: Any, bad_words: list[list[int]] | None,
                          eos_token_ids: set[int]) -> None:
        """ValueError where the request's own token constraints forbid every token its grammar
        allows first (the output could only be empty): allowed_token_ids, one-token bad_words,
        and under min_tokens the end-of-sequence and stop tokens. params: its SamplingParams."""
        if params.allowed_token_ids is None and not bad_words:
            return
        # Bit j of word i is token 32 i + j; the last word's bits past the vocabulary are padding.
        bits = (self._first_bitmask(compiled)[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        first = set(bits.flatten()[:self.tokenizer_info.vocab_size].nonzero().flatten().tolist())
        if params.allowed_token_ids is not None:
            first &= set(params.allowed_token_ids)
        first -= {words[0] for words in bad_words or () if len(words) == 1}
        if params.min_tokens:
            first -= set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos_token_ids)
        if not first:
            names = [name for name in ("allowed_token_ids", "bad_words", "min_tokens") if getattr(params, name)]
            raise ValueError(f"{' and '.join(names)} forbid every token the structured output's grammar allows "
                             f"first: nothing could be generated")

    def sequence_grammar(self, compiled: Any, reasoning: ReasoningTags | None, prompt_token_ids: list[int]
                         ) -> SequenceGrammar:
        """A fresh matcher of a compiled grammar for one sequence, applying after the
        reasoning where there is a reasoning parser."""
        state = reasoning.state_after(prompt_token_ids) if reasoning is not None else None
        matcher = self._xgrammar.GrammarMatcher(compiled)
        return SequenceGrammar(matcher, self.tokenizer_info.vocab_size, reasoning, state)


def _size(future: Future) -> int:
    """The bytes of a compiled grammar, 0 while it compiles or if it failed."""
    if not future.done() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes


class GrammarOverran(ValueError):
    """A request ended because its grammar took longer than its fill budget (the server's 400)."""


class SequenceGrammar:
    """One sequence's grammar: its matcher, and whether it applies yet.

    waits_for: a token id (the end of the reasoning) before which the grammar does not
    apply; None once it does. may_open: at the first token only, a token id (the start of
    the reasoning) allowed beside what the grammar allows, which then defers the grammar
    to the reasoning's end. The sampler's bitmask processor reads all three.
    """

    __slots__ = ("matcher", "vocab_size", "bitmask_words", "waits_for", "may_open", "overran", "_end_id")

    def __init__(self, matcher: Any, vocab_size: int, reasoning: ReasoningTags | None = None,
                 state: str | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size  # the grammar's (the tokenizer's): it allows no id past it
        self.bitmask_words = (vocab_size + 31) // 32  # the width of the matcher's bitmask rows (int32 words)
        self._end_id = reasoning.end_id if reasoning is not None else None
        self.waits_for = self._end_id if state == OPEN else None
        self.may_open = reasoning.start_id if state == UNDECIDED else None
        # Seconds one fill of its bitmask, or one token's accept, took past the budget
        # (logits_processors.FILL_BUDGET_S); 0.0 within.
        self.overran = 0.0

    @property
    def applies(self) -> bool:
        return self.waits_for is None

    def accept(self, token_id: int) -> bool:
        """Advance past the sequence's next token; False if the grammar refuses it."""
        opener, self.may_open = self.may_open, None
        if opener is not None and token_id == opener:
            self.waits_for = self._end_id
            return True
        if self.waits_for is not None:
            if token_id == self.waits_for:
                self.waits_for = None
            return True
        start = time.perf_counter()
        accepted = self.matcher.accept_token(token_id)
        budget = logits_processors.FILL_BUDGET_S
        if budget and (seconds := time.perf_counter() - start) > budget:
            self.overran = seconds  # (the sequence ends at its next token)
        return accepted

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order from its state now, the grammar accepts (up to one it
        refuses, or the one it ends on included); its state stays as it was. For a grammar that
        applies (its matcher's alone)."""
        accepted = 0
        for token_id in tokens:
            if not self.accepts_draft(token_id):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
        self.matcher.rollback(accepted)
        return accepted

    def accepts_draft(self, token_id: int) -> bool:
        """Advance the matcher past a drafted token, if it allows it (to be rolled back). Not
        for an id past the vocabulary, which it never allows (nor asks xgrammar about)."""
        return token_id < self.vocab_size and self.matcher.accept_token(token_id)

    def overran_message(self) -> str:
        """Why a sequence whose grammar overran its fill budget stopped."""
        budget_ms = logits_processors.FILL_BUDGET_S * 1e3
        return (f"its grammar took {self.overran * 1e3:.0f} ms to find or accept the next token, more than the "
                f"{budget_ms:g} ms allowed (NANOVLLM_GRAMMAR_FILL_BUDGET_US): an ambiguous grammar? the output "
                f"stops there")

    def is_terminated(self) -> bool:
        return self.waits_for is None and self.matcher.is_terminated()
