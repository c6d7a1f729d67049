"""Incremental detokenization: a completion's text as its tokens arrive, and stop strings.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character can
span tokens (its first token alone decodes to U+FFFD), and some tokenizers drop or add
a leading space depending on what comes before. So each step decodes a short window of
recent tokens twice, without and with the new ones, and emits the difference, holding
the new tokens back while the window still ends in an incomplete character.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded before the first output token, so that its leading space (or
# its absence) comes out as it would in the full text.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of one completion, grown token by token with add().

    It keeps only the window it decodes: `window[:read]` are tokens whose text is out
    (context for the next ones), `window[read:]` tokens still held back.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The Rust tokenizer's own decode is several times faster than the Python wrapper's, and the
        # same text unless the wrapper also cleans up spaces before punctuation.
        backend = getattr(tokenizer, "_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._decode_fn = backend.decode if backend is not None and not cleans_up else tokenizer.decode
        self.window = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.read = len(self.window)
        self.num_tokens = 0  # completion tokens added so far
        self.text = ""
        self.closed = False  # set by the engine once the text is final

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_fn(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append completion tokens; returns the text they complete (may be "" while a
        character is incomplete, unless final: the last call, which emits everything) and
        adds it to self.text."""
        self.num_tokens += len(token_ids)
        window = self.window
        window += token_ids
        before = self._decode(window[: self.read])
        after = self._decode(window)
        if after == before and not after.endswith(REPLACEMENT_CHAR):
            # The held tokens decode to nothing (skipped special tokens, ids past the
            # tokenizer's vocabulary): drop them, so such tokens never widen the window.
            del window[self.read :]
            return ""
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        new_text = after[len(before) :]
        # The tokens just emitted are the next call's context.
        self.window = window[self.read :]
        self.read = len(self.window)
        self.text += new_text
        return new_text


def num_text_tokens(num_tokens: int, finish_reason: str | None, stop_reason: int | str | None,
                    include_stop_str_in_output: bool) -> int:
    """How many of a completion's num_tokens tokens have text in its output: all but the
    stop token (or end-of-sequence) that ended it, unless include_stop_str_in_output."""
    if finish_reason == "stop" and not isinstance(stop_reason, str) and not include_stop_str_in_output:
        return num_tokens - 1
    return num_tokens


class StreamText:
    """The text of a stream whose tokens come from elsewhere: the server's API process
    decodes a plain stream without stop strings (EngineRequest.engine_decodes=False) by the
    engine's rules, from the same per-step pieces the engine would have decoded."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool,
                 include_stop_str_in_output: bool):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.include_stop_str_in_output = include_stop_str_in_output

    def add(self, token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None) -> str:
        """The text of a step's new tokens; with its finish the last piece (the token that
        stopped it, last of them, has none)."""
        if finish_reason is not None and token_ids:
            token_ids = token_ids[: num_text_tokens(len(token_ids), finish_reason, stop_reason,
                                                    self.include_stop_str_in_output)]
        return self.detokenizer.add(token_ids, final=finish_reason is not None)


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last new_len characters of text (so
    one that spans the boundary with older text is found): (its start, it), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best
