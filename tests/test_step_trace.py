"""benchmarks/step_trace.py: a trace's decode steps by batch size against their memory floor."""
import pytest
from bench_scripts import load_benchmark


def test_batch_brackets_are_powers_of_two():
    module = load_benchmark("step_trace")
    assert [module.batch_bracket(b) for b in (1, 2, 3, 4, 5, 8, 9, 256, 257)] == [
        (1, 1), (2, 2), (3, 4), (3, 4), (5, 8), (5, 8), (9, 16), (129, 256), (257, 512)]


def test_each_decode_step_takes_the_gap_before_it_against_its_floor(tmp_path, capsys):
    module = load_benchmark("step_trace")
    trace = tmp_path / "trace.1"
    # 1,000 bytes a token, 10,000 of weights; at 1e-8 TB/s (10,000 B/s) a step's floor is
    # (context * 1,000 + 10,000) / 10,000 seconds.
    trace.write_text("# kv_bytes_per_token 1000 weight_bytes 10000\n"
                     "0.0 p 30 0 3 0 30\n"  # the run's first step: no gap before it
                     "1.0 p 20 3 4 0 60\n"  # a prefill step: 1 s
                     "3.0 d 0 4 4 0 40\n"  # batch 4: 2 s against a floor of 5 s
                     "7.0 d 0 3 3 0 30\n"  # batch 3: 4 s against 4 s
                     "8.0 d 0 1 1 0 10\n")  # batch 1: 1 s against 2 s
    module.main([str(trace), "--min-steps", "1", "--gap", "100", "--bandwidth", "1e-8"])
    lines = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line.split()[1:] for line in lines[lines.index(
        next(line for line in lines if line.split()[:1] == ["batch"])) + 1:]}
    assert table["1"] == ["1", "1.000", "12.5%", "1000.000", "2.000", "200.0%"]
    assert table["3-4"] == ["2", "6.000", "75.0%", "3000.000", "9.000", "150.0%"]
    assert table["prefill"] == ["1", "1.000", "12.5%"]


def test_a_trace_without_floor_terms_is_summarized_but_not_floored(tmp_path, capsys):
    module = load_benchmark("step_trace")
    trace = tmp_path / "trace.1"
    trace.write_text("".join(f"{i}.0 d 0 2 2 0\n" for i in range(3)))  # the columns before the floor's
    module.main([str(trace), "--min-steps", "1", "--gap", "100"])
    assert "3 decode steps (mean batch 2.0)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no floor terms"):
        module.main([str(trace), "--min-steps", "1", "--gap", "100", "--bandwidth", "4"])
