"""benchmarks/bench_structured.py runs (on CPU, the demo model, a few requests) and both
of its runs generate the same tokens per request."""
from __future__ import annotations

import re

import pytest
from bench_scripts import load_benchmark

pytest.importorskip("xgrammar")


def test_bench_structured_reports_both_workloads(capsys):
    load_benchmark("bench_structured").main(["--num-seqs", "4", "--min-len", "8", "--max-len", "24", "--device", "cpu"])
    out = capsys.readouterr().out
    assert len(re.findall(r"schema \d compiled in [\d.]+ ms", out)) == 7
    for name in ("one schema", "eight schemas"):
        assert re.search(rf"^{name}: \d+ output tokens; constrained .* of unconstrained$", out, re.MULTILINE), out
    assert len(re.findall(r"us per row", out)) == 2
