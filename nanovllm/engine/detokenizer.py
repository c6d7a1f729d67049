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


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last new_len characters of text (so
    one that spans the boundary with older text is found): (its start, it), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best
