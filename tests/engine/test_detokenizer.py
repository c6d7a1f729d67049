"""Incremental detokenization equals decoding everything at once, piece by piece."""
import pytest
from transformers import AutoTokenizer

from nanovllm.demo import demo_model_path
from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop

TEXTS = ["def f(x):\n    return x  # done", "héllo wörld, 日本語 and 🙂🙂 emoji", "  leading spaces\tand\ttabs  "]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_text_adds_up(tokenizer, text):
    prompt = tokenizer.encode("x = 1\n")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    pieces = [detok.add([t]) for t in ids[:-1]] + [detok.add(ids[-1:], final=True)]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # no broken multi-byte character is ever emitted


def test_tokens_that_decode_to_nothing_do_not_grow_the_window(tokenizer):
    """Special tokens (skipped) and ids past the tokenizer's vocabulary add no text; the
    text still adds up, and the decoded window stays short however many of them come."""
    special = tokenizer.all_special_ids[0]
    unknown = len(tokenizer) + 1000  # a model's vocabulary can be larger than its tokenizer's
    ids = tokenizer.encode("one two") + [special, unknown] * 50 + tokenizer.encode(" three 日本")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x ="), skip_special_tokens=True)
    widest = 0
    for i, token in enumerate(ids):
        detok.add([token], final=i == len(ids) - 1)
        widest = max(widest, len(detok.window))
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert widest <= 8


def test_find_stop_sees_strings_that_span_old_and_new_text():
    assert find_stop("hello wor", 3, ["world"]) is None
    assert find_stop("hello world", 2, ["world", "xyz"]) == (6, "world")
    assert find_stop("abcabc", 1, ["c", "bc"]) == (4, "bc")  # the earliest start wins
    assert find_stop("abc", 1, ["a"]) is None  # ended before the new text
