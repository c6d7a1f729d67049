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


def test_find_stop_sees_strings_that_span_old_and_new_text():
    assert find_stop("hello wor", 3, ["world"]) is None
    assert find_stop("hello world", 2, ["world", "xyz"]) == (6, "world")
    assert find_stop("abcabc", 1, ["c", "bc"]) == (4, "bc")  # the earliest start wins
    assert find_stop("abc", 1, ["a"]) is None  # ended before the new text
