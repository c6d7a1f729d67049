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
    """The text of one completion, grown token by token with add()."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The Rust tokenizer's own decode is ~5x faster than the Python wrapper's, and the
        # same text unless the wrapper also cleans up spaces before punctuation.
        backend = getattr(tokenizer, "_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._decode_fn = backend.decode if backend is not None and not cleans_up else tokenizer.decode
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.num_context_tokens = len(self.token_ids)
        self.prefix_offset = 0  # the window decoded starts here
        self.read_offset = len(self.token_ids)  # tokens before this have produced their text
        self.text = ""
        self.closed = False  # set by the engine once the text is final

    @property
    def num_tokens(self) -> int:
        """Completion tokens added so far."""
        return len(self.token_ids) - self.num_context_tokens

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_fn(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append completion tokens; returns the text they complete (may be "" while a
        character is incomplete, unless final: the last call, which emits everything) and
        adds it to self.text."""
        self.token_ids += token_ids
        before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        new_text = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
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
