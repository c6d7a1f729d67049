"""benchmarks/bench_kernels.py's shape arguments: what it would time, refused when no kernel could run it."""
import argparse

import pytest
from bench_scripts import load_benchmark


def test_decode_and_prefill_shapes_parse_and_bad_ones_are_refused():
    module = load_benchmark("bench_kernels")
    assert module.decode_shape("64:2:2") == (64, 2, 2, 0)  # the default config's split length
    assert module.decode_shape("32:1:3:256") == (32, 1, 3, 256)
    assert module.prefill_shape("128:64:8:3") == (128, 64, 8, 3)
    for text in ["0:4:3", "48:4:3", "64:3:3", "64:4:0", "64:4"]:  # sizes, warps, stages, too few
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            module.decode_shape(text)
    for text in ["a:b:c:d", "128:64:8"]:
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            module.prefill_shape(text)
