"""OutputProcessor: sampled tokens in, outputs out; the one place that decides what a
sequence has produced and whether it has finished.

After each step the engine hands it the step's sampled tokens. For every sequence that got
one it records the token (and its logprobs), then decides whether the sequence is done:
end-of-sequence or a stop token (only after min_tokens), max_tokens, or a stop string in
its text (found by the incremental detokenizer, also across token boundaries; a stop
string takes precedence over the others). It returns the finished sequences with their
reasons, and the engine has the scheduler free them.

It also builds everything a user reads, in three views of a sequence's output:

    completion(seq)            everything so far (all of it once finished)
    stream_delta(seq)          what is new since the last look, as a CompletionOutput (streams)
    next_piece(seq)            the same as (text, token range), or None when nothing is to be
                               sent; the server's engine loop sends it, the finish once

and `new_outputs(request, stream)`, what the engine loop sends for a request after a step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop, num_text_tokens
from nanovllm.engine.request import Request
from nanovllm.engine.speculative import accept_verified
from nanovllm.executor.step import PromptLogprobs
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling.sampler import StepLogprobs
from nanovllm.sequence import Sequence

logger = logging.getLogger(__name__)

# (sequence, finish_reason, stop_reason): "stop" with the stop token id, the stop string or
# None (end-of-sequence); "length" with None.
Finish = tuple[Sequence, str, int | str | None]


@dataclass(slots=True)
class SequenceOutput:
    """What one sequence has output so far."""

    detokenizer: IncrementalDetokenizer | None  # when its text is needed as it grows (stop strings, streams)
    logprobs: list[dict[int, Logprob]] | None  # per completion token, when params.logprobs is set
    # Per prompt token (None: the first, and those not computed yet), when params.prompt_logprobs
    # is set; the first of a request's n sequences holds them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    num_emitted_tokens: int = 0  # what the stream has handed out so far (_take_tokens)
    num_emitted_chars: int = 0
    finish_emitted: bool = False  # next_piece has handed out its finish_reason
    decoded_elsewhere: bool = False  # a stream whose text the server's API process decodes


def _logprob_entry(token_id: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float]
                   ) -> dict[int, Logprob]:
    """A token's logprob entry: its own, then its alternatives' by rank (the token itself once)."""
    entry = {token_id: Logprob(logprob, rank)}
    for i, (alt, value) in enumerate(zip(top_ids, top_values)):
        entry.setdefault(alt, Logprob(value, i + 1))
    return entry


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.token_texts: dict[int, str] = {}  # token id -> its text alone (logprobs' decoded_token)
        self.num_output_tokens = 0  # every token recorded, ever (LLM's progress bar takes rates from it)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Speculative decoding's counts (vLLM's spec_decode metrics) from zero."""
        self.num_drafts = 0  # verifications: a sequence's drafts in a step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos: list[int] = []  # kept drafts by their place among a step's drafts

    def _count_verified(self, drafted: int, accepted: int) -> None:
        """A sequence's `drafted` drafts were verified, their first `accepted` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_per_pos
        per_pos += [0] * (drafted - len(per_pos))
        for j in range(accepted):
            per_pos[j] += 1

    def attach(self, seq: Sequence, stream: bool, engine_decodes: bool = True) -> None:
        """Give a new sequence its output state; its text is detokenized as it grows when it
        streams or has stop strings. engine_decodes=False: a stream whose text the server's API
        process decodes from its tokens (here only where stop strings need it)."""
        params = seq.params
        detokenizer = None
        if ((stream and engine_decodes) or params.stop) and params.detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        seq.output = SequenceOutput(detokenizer, [] if params.logprobs is not None else None,
                                    decoded_elsewhere=stream and params.detokenize and detokenizer is None)
        if params.prompt_logprobs is not None and seq.index == 0:
            seq.output.prompt_logprobs = [None] * seq.num_prompt_tokens

    # -- after a step ---------------------------------------------------------------------

    def process(self, seqs: list[Sequence], token_ids: list[int], samples: list[bool],
                logprobs: StepLogprobs | None, prompt_logprobs: PromptLogprobs | None = None,
                seq_rows: list[int] | None = None) -> list[Finish]:
        """Record a step's sampled tokens (`samples`: which rows sampled one; a prefill
        chunk that leaves tokens to compute does not) and prompt logprobs, and return the
        sequences they finish. A sequence that finished meanwhile (aborted) ignores the
        token sampled after it. seq_rows: each sequence's rows where some verified drafts
        (speculative decoding): such a one gets the tokens `accept_verified` keeps, in order, until
        one finishes it."""
        if prompt_logprobs is not None:
            self._record_prompt_logprobs(seqs, prompt_logprobs)
        finished = []
        row = 0
        for i, (seq, sampled) in enumerate(zip(seqs, samples)):
            first, row = row, row + (seq_rows[i] if seq_rows is not None else 1)
            if not sampled or seq.is_finished:
                continue
            if not seq.num_draft_tokens:
                seq.resolve_pending_token(token_ids[first])
                finish = self._record(seq, token_ids[first], first, logprobs)
            else:
                kept = accept_verified(seq, token_ids[first:row])
                self._count_verified(row - first - 1, len(kept) - 1)
                for j, token_id in enumerate(kept):
                    seq.append_token(token_id)
                    if (finish := self._record(seq, token_id, first + j, logprobs)) is not None:
                        break
            if finish is not None:
                finished.append((seq, *finish))
        return finished

    def _record(self, seq: Sequence, token_id: int, row: int, logprobs: StepLogprobs | None
                ) -> tuple[str, int | str | None] | None:
        """Record seq's newest token (its logprobs from `row`); returns (finish_reason,
        stop_reason) if it ends seq."""
        self.num_output_tokens += 1
        out = seq.output
        if out.logprobs is not None:
            self._record_logprobs(seq, token_id, *logprobs.row(row))
        finish = self._finish_by_token(seq, token_id)
        if seq.grammar is not None:
            finish = self._advance_grammar(seq, token_id, finish)
        if out.detokenizer is not None:
            stop = self._extend_text(seq, finish)
            if stop is not None:
                finish = ("stop", stop)
        return finish

    def _finish_by_token(self, seq: Sequence, token_id: int) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) if the token just recorded ends seq, else None.
        End-of-sequence and stop tokens count only after min_tokens (the sampler does not
        draw them before)."""
        params = seq.params
        generated = seq.num_known_completion_tokens
        if generated > params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
            if params.stop_token_ids and token_id in params.stop_token_ids:
                return "stop", token_id
        if generated >= params.max_tokens:
            return "length", None
        return None

    @staticmethod
    def _advance_grammar(seq: Sequence, token_id: int, finish: tuple[str, int | None] | None
                         ) -> tuple[str, int | None] | None:
        """Feed the token to seq's grammar (engine/structured.SequenceGrammar). The grammar's
        end (its stop token accepted) ends the sequence with "stop" even where
        end-of-sequence would not (ignore_eos). A grammar that overran its fill budget ends
        it with "abort" (a server answers the request with an error)."""
        if seq.grammar.overran:
            logger.warning("sequence %d: %s", seq.seq_id, seq.grammar.overran_message())
            return "abort", None
        if not seq.grammar.accept(token_id):
            params = seq.params
            others = [name for name in ("allowed_token_ids", "bad_words", "min_tokens") if getattr(params, name)]
            if others:  # the request's own constraints left the grammar no token to draw
                logger.warning("sequence %d: no token satisfies both its grammar and its %s; it stops here",
                               seq.seq_id, " and ".join(others))
            else:  # the bitmask allowed it, so this is a bug
                logger.error("sequence %d: its grammar refused token %d; it stops here", seq.seq_id, token_id)
            return finish or ("stop", None)
        if finish is None and seq.grammar.is_terminated():
            return "stop", None
        return finish

    def _extend_text(self, seq: Sequence, finish: tuple[str, int | None] | None) -> str | None:
        """Add seq's new tokens to its text (all of it when `finish` ends it); returns the
        stop string they complete, if any, and cuts the text there."""
        params, detok = seq.params, seq.output.detokenizer
        if detok.closed:
            return None
        end = self._num_text_tokens(seq, *finish) if finish else seq.num_known_completion_tokens
        new_text = self._detokenize_to(seq, end, final=finish is not None)
        if not params.stop or not new_text or end <= params.min_tokens:
            return None
        found = find_stop(detok.text, len(new_text), params.stop)
        if found is None:
            return None
        position, stop = found
        detok.text = detok.text[: position + (len(stop) if params.include_stop_str_in_output else 0)]
        detok.closed = True
        return stop

    @staticmethod
    def _num_text_tokens(seq: Sequence, reason: str | None, stop_reason: int | str | None) -> int:
        """Completion tokens whose text is part of the output (detokenizer.num_text_tokens)."""
        return num_text_tokens(seq.num_known_completion_tokens, reason, stop_reason,
                               seq.params.include_stop_str_in_output)

    @staticmethod
    def _record_logprobs(seq: Sequence, token_id: int, logprob: float, rank: int, top_ids: list[int],
                         top_values: list[float]) -> None:
        """The token's own log-probability and the params.logprobs most likely alternatives'."""
        out = seq.output
        out.logprobs.append(_logprob_entry(token_id, logprob, rank, top_ids[: seq.params.logprobs], top_values))
        out.cumulative_logprob += logprob

    @staticmethod
    def _record_prompt_logprobs(seqs: list[Sequence], step: PromptLogprobs) -> None:
        """Each span's rows: the row at position p gives prompt token p + 1's entry. Once the
        last is in, the sequence stops asking (and may hit the prefix cache if recomputed)."""
        values, row = step.read(), 0
        for index, first, count in step.spans:
            seq = seqs[index]
            entries, prompt = seq.output.prompt_logprobs, seq.prompt_token_ids
            for position in range(first, first + count):
                chosen, rank, top_ids, top_values = values.row(row)
                entries[position + 1] = _logprob_entry(prompt[position + 1], chosen, rank,
                                                       top_ids[: seq.params.prompt_logprobs], top_values)
                row += 1
            if first + count == seq.num_prompt_tokens - 1:
                seq.wants_prompt_logprobs = False

    # -- outputs --------------------------------------------------------------------------

    def _decode_tokens(self, entries: list[dict[int, Logprob] | None]) -> None:
        """Fill in each Logprob's token text (each token id decoded once: a long prompt's
        logprobs hold many thousands of entries, and the engine loop waits for them)."""
        texts, decode = self.token_texts, self.tokenizer.decode
        for entry in entries:
            for token_id, lp in (entry or {}).items():
                if lp.decoded_token is None:
                    text = texts.get(token_id)
                    if text is None:
                        text = texts[token_id] = decode([token_id])
                    lp.decoded_token = text

    def _final_text(self, seq: Sequence) -> None:
        """Once seq has finished, its detokenizer holds the whole text (an aborted sequence's
        held-back characters included)."""
        if seq.is_finished and not seq.output.detokenizer.closed:
            self._detokenize_to(seq, self._num_text_tokens(seq, seq.finish_reason, seq.stop_reason), final=True)

    @staticmethod
    def _detokenize_to(seq: Sequence, end: int, final: bool) -> str:
        """Add seq's completion tokens up to `end` to its detokenizer, closing it if final;
        returns the text they add."""
        detok = seq.output.detokenizer
        new_text = detok.add(seq.completion_tokens(detok.num_tokens, end), final=final)
        detok.closed = final
        return new_text

    def completion(self, seq: Sequence) -> CompletionOutput:
        """Everything seq has generated so far (all of it once finished)."""
        if not seq.params.detokenize:
            text = ""
        elif seq.output.detokenizer is not None:
            self._final_text(seq)
            text = seq.output.detokenizer.text
        else:
            ids = seq.completion_tokens(0, self._num_text_tokens(seq, seq.finish_reason, seq.stop_reason))
            text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        return self._output(seq, text, 0, seq.num_known_completion_tokens)

    def stream_delta(self, seq: Sequence) -> CompletionOutput:
        """What seq (of a request made with stream=True) has produced since the last call:
        new text, token ids and logprobs, and finish_reason once it has finished. While it
        runs, text that could still turn out to start a stop string is held back."""
        text, start, end = self._take_unsent(seq)
        return self._output(seq, text, start, end)

    def _take_unsent(self, seq: Sequence) -> tuple[str, int, int]:
        """What seq has produced since it was last handed out: the new text, and the range
        [start, end) of completion tokens it covers (marked as handed out now)."""
        out, params = seq.output, seq.params
        if not params.detokenize:  # tokens only
            return "", *self._take_tokens(seq)
        if out.detokenizer is None:
            raise ValueError("stream_delta needs a request made with stream=True")
        self._final_text(seq)
        text = out.detokenizer.text
        end_chars = len(text)
        if not seq.is_finished and params.stop and not params.include_stop_str_in_output:
            end_chars = max(out.num_emitted_chars, end_chars - max(map(len, params.stop)) + 1)
        new_text = text[out.num_emitted_chars : end_chars]
        out.num_emitted_chars = end_chars
        return new_text, *self._take_tokens(seq)

    @staticmethod
    def _take_tokens(seq: Sequence) -> tuple[int, int]:
        """The range [start, end) of seq's completion tokens not yet handed out, marked as
        handed out."""
        out = seq.output
        start, out.num_emitted_tokens = out.num_emitted_tokens, seq.num_known_completion_tokens
        return start, out.num_emitted_tokens

    def _output(self, seq: Sequence, text: str, start: int, end: int) -> CompletionOutput:
        """seq's CompletionOutput with `text` and completion tokens start..end-1 (and their
        logprobs, each Logprob's token text filled in)."""
        out = seq.output
        logprobs = None
        if out.logprobs is not None:
            logprobs = out.logprobs[start:end]
            if seq.params.detokenize:
                self._decode_tokens(logprobs)
        return CompletionOutput(seq.index, text, seq.completion_tokens(start, end), seq.finish_reason,
                                seq.stop_reason, logprobs, out.cumulative_logprob if logprobs is not None else None)

    def request_output(self, request: Request) -> RequestOutput:
        """The request's whole output so far (LLM.generate's result)."""
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [self.completion(seq) for seq in request.seqs], request.finished,
                             self.prompt_logprobs(request), request.seqs[0].num_prefix_hit_tokens)

    def prompt_logprobs(self, request: Request) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs (None unless asked for; entries not computed yet are None)."""
        entries = request.seqs[0].output.prompt_logprobs
        if entries is not None and request.params.detokenize:
            self._decode_tokens(entries)
        return entries

    def new_outputs(self, request: Request, stream: bool) -> list[CompletionOutput]:
        """What to send for a request after a step. A stream: each completion's new text,
        tokens and logprobs, and its finish once; otherwise every completion in full once
        all have finished, and nothing before."""
        if not stream:
            return [self.completion(seq) for seq in request.seqs] if request.finished else []
        return [self._output(seq, *piece) for seq in request.seqs if (piece := self.next_piece(seq)) is not None]

    def next_piece(self, seq: Sequence) -> tuple[str | None, int, int] | None:
        """The unsent part of a streamed seq, or None when there is nothing to send: no new
        text, tokens or finish, or its finish went out already (marked here as it goes).
        Its text is None where the server's API process decodes it (attach's engine_decodes=False)."""
        out = seq.output
        if out.finish_emitted:
            return None
        if out.decoded_elsewhere:
            text, (start, end) = None, self._take_tokens(seq)
        else:
            text, start, end = self._take_unsent(seq)
        out.finish_emitted = seq.finish_reason is not None
        if text or end > start or seq.finish_reason is not None:
            return text, start, end
        return None
