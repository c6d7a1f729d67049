"""Per-request logits processors: what one request changes in its own row of the logits.

The sampler runs them after it has taken logprobs from the raw logits and before the
penalties, the temperature and the filters (sampler.py), so every sampling mode and
every completion of an n > 1 request respects them. A processor has two halves:

    prepare(seqs, params) -> inputs | None     host, every step: the inputs for the rows
                                               that need it, None when none does (the step
                                               then pays nothing for this processor)
    apply(logits, inputs) -> logits            device: change those rows

min_tokens, allowed_token_ids with logit_bias, bad_words and a structured-output grammar's
token bitmask are the four. prepare runs while the previous step may still be in flight,
so a sequence's last token may not be known yet (PENDING_TOKEN): min_tokens needs only the
count, but a grammar's matcher has to have accepted every token before it can say what
comes next, and bad_words compares the last tokens with its words. Such a processor sets
`reads_last_token`: a step with grammars or bad words is forwarded first and its
processor prepared only once the step before is read (Executor.forward / sample,
SamplingState.prepare_late, LLMEngine.step).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch

from nanovllm.sampling.ops import apply_token_bitmask
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.utils.buffers import DoubleBuffered, host_values, index_lists
from nanovllm.utils.env import env_int

# The most one grammar may take to say which tokens come next, or to accept a token: an
# ambiguous grammar's parser can take seconds a token, and every sequence waits for the step.
# Past it the sequence ends (OutputProcessor; a server answers its request with an error).
# NANOVLLM_GRAMMAR_FILL_BUDGET_US (microseconds; 0: no limit).
FILL_BUDGET_S = env_int("NANOVLLM_GRAMMAR_FILL_BUDGET_US", 100_000, least=0) / 1e6


class LogitsProcessor(ABC):
    # Whether prepare needs the tokens of the step before (a grammar's state does): the
    # engine then prepares it only once those are read (SamplingState.prepare_late). A new
    # such processor adds its case to Sequence.needs_known_tokens.
    reads_last_token = False

    @abstractmethod
    def prepare(self, seqs: SequenceABC[Sequence], params: list[SamplingParams]) -> Any | None:
        """This step's inputs for apply, from its sequences (row i is seqs[i]) and their
        distinct SamplingParams; None if no row needs this processor."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, inputs: Any) -> torch.Tensor:
        """logits [batch, vocab] with this processor's rows changed (a new tensor or the same)."""


class MinTokensProcessor(LogitsProcessor):
    """min_tokens: end-of-sequence and stop tokens may not be drawn while a sequence has
    fewer than min_tokens completion tokens (a row after a sequence's j-th draft: counting
    the drafts before it)."""

    def __init__(self, eos_token_ids: frozenset[int], device: torch.device):
        self.eos_token_ids = eos_token_ids
        self.device = device

    def prepare(self, seqs: SequenceABC[Sequence], params: list[SamplingParams]) -> torch.Tensor | None:
        """[2, m] (row, token id) pairs that may not be drawn."""
        if not any(p.min_tokens for p in params):
            return None
        rows, ids = [], []
        for i, (seq, place) in enumerate(zip(seqs, draft_places(seqs))):
            p = seq.params
            if p.min_tokens > seq.num_completion_tokens - seq.num_draft_tokens + place:  # the tokens before row i's
                stops = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stops |= self.eos_token_ids
                rows += [i] * len(stops)
                ids += sorted(stops)
        return index_lists([rows, ids], self.device) if rows else None

    def apply(self, logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        return _ban(logits, banned)


def _ban(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """logits with -inf at banned's [2, m] (row, token id) pairs."""
    return logits.index_put((banned[0], banned[1]), torch.full((), float("-inf"), dtype=logits.dtype,
                                                               device=logits.device))


class TokenBiasProcessor(LogitsProcessor):
    """allowed_token_ids (every other token gets -inf), then logit_bias (added to its
    tokens' logits). Each request's ids and biases go to the device once, when it first
    samples: a step only gathers its rows' (a request may list hundreds, and a step holds
    hundreds of requests)."""

    def __init__(self, device: torch.device):
        self.device = device
        # id(params) -> (params, its allowed ids, biased ids, biases on the device): the
        # params of the last step's rows (kept alive here, so their ids are not reused).
        self.tensors: dict[int, tuple[SamplingParams, torch.Tensor | None, torch.Tensor | None,
                                      torch.Tensor | None]] = {}

    def _tensors(self, p: SamplingParams) -> tuple:
        cached = self.tensors.get(id(p))
        if cached is not None:
            return cached
        allowed = host_values(p.allowed_token_ids, torch.int64, self.device) if p.allowed_token_ids else None
        biased = biases = None
        if p.logit_bias:
            biased = host_values(list(p.logit_bias), torch.int64, self.device)
            biases = host_values(list(p.logit_bias.values()), torch.float32, self.device)
        return p, allowed, biased, biases

    def prepare(self, seqs: SequenceABC[Sequence], params: list[SamplingParams]) -> tuple | None:
        """(allowed, biased): allowed = (rows [r], [2, m] (row, token id) pairs) or None;
        biased = ([2, m] pairs, biases [m] float32) or None."""
        tensors = {id(p): self._tensors(p) for p in params if p.allowed_token_ids or p.logit_bias}
        self.tensors = tensors
        if not tensors:
            return None
        allowed_rows, allowed_ids, bias_rows, bias_ids, biases = [], [], [], [], []
        for i, seq in enumerate(seqs):
            entry = tensors.get(id(seq.params))
            if entry is None:
                continue
            _, allowed, biased, values = entry
            if allowed is not None:
                allowed_rows.append(i)
                allowed_ids.append(allowed)
            if biased is not None:
                bias_rows.append(i)
                bias_ids.append(biased)
                biases.append(values)
        allowed = biased = None
        if allowed_rows:
            rows = host_values(allowed_rows, torch.int64, self.device)
            allowed = rows, self._pairs(rows, allowed_ids)
        if bias_rows:
            biased = self._pairs(host_values(bias_rows, torch.int64, self.device), bias_ids), torch.cat(biases)
        return allowed, biased

    @staticmethod
    def _pairs(rows: torch.Tensor, ids: list[torch.Tensor]) -> torch.Tensor:
        """[2, m] (row, token id) pairs: each of rows with its ids."""
        counts = [t.numel() for t in ids]
        # output_size given, so that the host need not wait for the device to count them
        rows = rows.repeat_interleave(host_values(counts, torch.int64, rows.device), output_size=sum(counts))
        return torch.stack([rows, torch.cat(ids)])

    def apply(self, logits: torch.Tensor, inputs: tuple) -> torch.Tensor:
        allowed, biased = inputs
        if allowed is not None:
            rows, pairs = allowed
            kept = logits[pairs[0], pairs[1]]
            logits = logits.index_fill(0, rows, float("-inf")).index_put((pairs[0], pairs[1]), kept)
        if biased is not None:
            pairs, biases = biased
            index = (pairs[0], pairs[1])
            logits = logits.index_put(index, (logits[index].float() + biases).to(logits.dtype))
        return logits


class BadWordsProcessor(LogitsProcessor):
    """bad_words (Sequence.bad_words, as token ids): a one-token word is never drawn; a
    longer one's last token is not drawn right after the tokens before it (on a row after a
    sequence's j-th draft: after its known tokens and those drafts)."""

    reads_last_token = True

    def __init__(self, device: torch.device):
        self.device = device

    def prepare(self, seqs: SequenceABC[Sequence], params: list[SamplingParams]) -> torch.Tensor | None:
        """[2, m] (row, token id) pairs that may not be drawn."""
        if not any(p.bad_words for p in params):
            return None
        rows, ids = [], []
        for i, (seq, place) in enumerate(zip(seqs, draft_places(seqs))):
            if seq.bad_words is None or seq.is_finished:
                continue
            # The token drawn now follows the known ones: prepared late, or with nothing in
            # flight, only the one being drawn can be pending (LLMEngine.step splits the
            # steps of long_bad_words); a one-token word needs no tokens.
            known = seq.num_known_completion_tokens + place
            for word in seq.bad_words:
                before = len(word) - 1
                if before == 0 or (known >= before and seq.completion_tokens(known - before, known) == word[:-1]):
                    rows.append(i)
                    ids.append(word[-1])
        return index_lists([rows, ids], self.device) if rows else None

    def apply(self, logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        return _ban(logits, banned)


class GrammarBitmaskProcessor(LogitsProcessor):
    """Structured outputs: the tokens a sequence's grammar does not allow next get -inf.
    seq.grammar (engine/structured.SequenceGrammar, set by the engine) holds an xgrammar
    matcher, which fills its row of a [rows, words] int32 bitmask on the host (bit t of
    word w allows token 32 w + t; the words cover the tokenizer's vocabulary); the device
    applies it (sampling/ops.apply_token_bitmask). Rows without a grammar, or whose
    grammar waits for the end of the reasoning, cost nothing."""

    reads_last_token = True

    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows, self.device = max_rows, device
        self.bitmasks: DoubleBuffered | None = None  # [max_rows, words] int32 each, made on first use
        self.filler: Any = None  # xgrammar's BatchGrammarMatcher (its threads fill the rows), made on first use

    def prepare(self, seqs: SequenceABC[Sequence], params: list[SamplingParams]) -> tuple | None:
        """(rows [m] int64, bitmask [m, words] int32) on the device, for the m rows whose grammar applies."""
        if not any(p.structured_outputs is not None for p in params):
            return None
        # A sequence that finished while this step's model ran samples a token nobody reads.
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None and seq.grammar.applies
                and not seq.is_finished]
        if not rows:
            return None
        if self.filler is None:
            import xgrammar  # there is a grammar, so there is xgrammar

            self.filler = xgrammar.BatchGrammarMatcher()
            # As wide as the grammars' vocabulary (the tokenizer's; every grammar of an
            # engine shares it). Pinned, and two: a step's copy may still be reading one.
            words, pin = seqs[rows[0]].grammar.bitmask_words, self.device.type == "cuda"
            self.bitmasks = DoubleBuffered(lambda: torch.zeros(self.max_rows, words, dtype=torch.int32, pin_memory=pin))
        bitmask = self.bitmasks.flip()[: len(rows)]
        # A sequence's first row is its grammar's state now, its others (speculative decoding) come after its drafts.
        places = draft_places(seqs)
        first = [j for j, i in enumerate(rows) if places[i] == 0]
        _fill_within_budget(self.filler, [seqs[rows[j]] for j in first], first, bitmask)
        if drafted := [j for j in first if seqs[rows[j]].num_draft_tokens]:
            fill_after_drafts([seqs[rows[j]] for j in drafted], drafted, bitmask, self.filler)
        for j in first:
            opener = seqs[rows[j]].grammar.may_open
            if opener is not None:  # the first token may also open the reasoning
                word, bit = divmod(opener, 32)
                bitmask[j, word] |= INT32_BIT[bit]
        return index_lists([rows], self.device)[0], bitmask.to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor, inputs: tuple) -> torch.Tensor:
        rows, bitmask = inputs
        return apply_token_bitmask(logits, bitmask, rows)


def draft_places(seqs: SequenceABC[Sequence]) -> list[int]:
    """Per row, how many of its sequence's drafts come before it: a step that verifies a
    sequence's drafts has a row for each and one more, one after another (0 elsewhere)."""
    places = [0] * len(seqs)
    for i in range(1, len(seqs)):
        if seqs[i] is seqs[i - 1]:
            places[i] = places[i - 1] + 1
    return places


def _fill_within_budget(filler: Any, seqs: list[Sequence], rows: list[int], bitmask: torch.Tensor) -> None:
    """Fill bitmask's rows with what seqs' grammars allow next, by xgrammar's threads
    (filler); a fill past FILL_BUDGET_S then blames the grammars that overran it."""
    start = time.perf_counter()
    filler.batch_fill_next_token_bitmask([seq.grammar.matcher for seq in seqs], bitmask, rows)
    if FILL_BUDGET_S and time.perf_counter() - start > FILL_BUDGET_S:
        _blame_slow_fills(seqs, rows, bitmask)


def _blame_slow_fills(seqs: list[Sequence], rows: list[int], bitmask: torch.Tensor) -> None:
    """After a batch fill past FILL_BUDGET_S: fill each row again alone (the same bits),
    timed, and mark the grammars that alone take longer (SequenceGrammar.overran)."""
    for seq, row in zip(seqs, rows):
        start = time.perf_counter()
        seq.grammar.matcher.fill_next_token_bitmask(bitmask, row)
        if (seconds := time.perf_counter() - start) > FILL_BUDGET_S:
            seq.grammar.overran = seconds


def fill_after_drafts(seqs: list[Sequence], rows: list[int], bitmask: torch.Tensor, filler: Any) -> None:
    """The bitmask rows after the drafts of seqs (rows: each one's first row, its state
    before them, filled): row + j allows what its grammar allows after its first j drafts,
    filled a round of one draft each at a time by xgrammar's threads (filler). A row after a
    draft the grammar refuses or ends on is never kept (the row before it cannot draw that
    draft, or the sequence ends there): it takes the last filled row's."""
    drafts = [seq.drafts for seq in seqs]
    accepted, filled = [0] * len(seqs), [0] * len(seqs)
    live = list(range(len(seqs)))  # those whose rows so far each followed a draft the grammar allowed
    for j in range(1, max(map(len, drafts)) + 1):
        live = [i for i in live if j <= len(drafts[i]) and seqs[i].grammar.accepts_draft(drafts[i][j - 1])]
        for i in live:
            accepted[i] = j
        live = [i for i in live if not seqs[i].grammar.matcher.is_terminated()]
        if live:
            _fill_within_budget(filler, [seqs[i] for i in live], [rows[i] + j for i in live], bitmask)
        for i in live:
            filled[i] = j
    for i, seq in enumerate(seqs):
        bitmask[rows[i] + filled[i] + 1: rows[i] + len(drafts[i]) + 1] = bitmask[rows[i] + filled[i]]
        seq.grammar.matcher.rollback(accepted[i])


# Bit b of an int32 word as an int32 value (bit 31 is the sign): token bitmasks are int32 words.
INT32_BIT = [1 << b if b < 31 else -(1 << 31) for b in range(32)]
