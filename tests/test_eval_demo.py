"""benchmarks/eval_demo.py: it measures the demo models on a slice of the held-out files."""
from __future__ import annotations

import ast
import json

import pytest
from bench_scripts import load_benchmark

# Loose: text the models never saw costs far less than the ~13 bits of a uniform guess
# over their vocabulary (RESULTS.md has the measured figures).
MAX_TARGET_BITS_PER_BYTE = 2.5
MAX_DRAFT_BITS_PER_BYTE = 3.0


@pytest.fixture(scope="module")
def eval_demo():
    return load_benchmark("eval_demo")


def test_runs_on_a_few_held_out_files(eval_demo, capsys):
    eval_demo.main(["--max-files", "2", "--max-chars", "3000", "--headers", "2", "--max-tokens", "16", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["files"] == 2 and result["tokens"] > 0
    assert result["target_bits_per_byte"] < MAX_TARGET_BITS_PER_BYTE
    assert result["draft_bits_per_byte"] < MAX_DRAFT_BITS_PER_BYTE
    assert 0 <= result["agreement"] <= 1
    assert result["headers"] == 2 and 0 <= result["headers_parsed"] <= 2


@pytest.mark.parametrize("cut", [
    'def f(x):\n    """Return\n    the',           # inside a docstring
    "def f(x):\n    y = g(a, [b,\n",                 # inside brackets
    "class A:\n    def f(self):\n        # later\n",  # a block with only a comment
    "def f():\n    if x:\n",                         # a block with nothing yet
])
def test_closing_what_a_cut_left_open_makes_it_parse(eval_demo, cut):
    text = cut[: cut.rfind("\n") + 1]
    ast.parse(eval_demo.close_open_blocks(text))


def test_code_that_is_wrong_still_fails(eval_demo):
    assert not eval_demo.parses("def f(x):", "\n        y = 1\n    return y\n", finished=True)
