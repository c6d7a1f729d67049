"""benchmarks/step_trace.py: a trace's decode steps by batch size against their memory floor."""
import pytest
from bench_scripts import load_benchmark


def test_batch_brackets_are_powers_of_two():
    module = load_benchmark("step_trace")
    assert [module.batch_bracket(b) for b in (1, 2, 3, 4, 5, 8, 9, 256, 257)] == [
        (1, 1), (2, 2), (3, 4), (3, 4), (5, 8), (5, 8), (9, 16), (129, 256), (257, 512)]


def floor_table(module, trace, capsys, header: str, rows: str) -> dict[str, list[str]]:
    """step_trace's floor table for a trace of these lines, by its first column."""
    trace.write_text(header + rows)
    module.main([str(trace), "--min-steps", "1", "--gap", "100", "--bandwidth", "1e-8"])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["batch"]) + 1
    return {line.split()[0]: line.split()[1:] for line in lines[start:]}


# 1,000 bytes a token, 10,000 of weights; at 1e-8 TB/s (10,000 B/s) a dense model's step
# floor is (context * 1,000 + 10,000) / 10,000 seconds.
HEADER = "# kv_bytes_per_token 1000.0 weight_bytes 10000 expert_bytes 0 expert_share 0.0\n"
ROWS = ("0.0 p 30 0 3 0 30\n"  # a prefill step: 1 s, until the next record
        "1.0 p 20 3 4 0 60\n"  # and another: 2 s
        "3.0 d 0 4 4 0 40\n"  # batch 4: 4 s against a floor of 5 s
        "7.0 d 0 3 3 0 30\n"  # batch 3: 1 s against 4 s
        "8.0 d 0 1 1 0 10\n"  # batch 1: 1 s against 2 s
        "9.0 d 0 1 1 0 11\n")  # the run's last: no next record, left out


def test_each_step_takes_the_gap_to_the_next_record_against_its_floor(tmp_path, capsys):
    table = floor_table(load_benchmark("step_trace"), tmp_path / "trace.1", capsys, HEADER, ROWS)
    assert table["1"] == ["1", "1.000", "11.1%", "1000.000", "2.000", "200.0%"]
    assert table["3-4"] == ["2", "5.000", "55.6%", "2500.000", "9.000", "180.0%"]
    assert table["prefill"] == ["2", "3.000", "33.3%"]


def test_an_moe_floor_counts_the_experts_a_batch_routes_to(tmp_path, capsys):
    """8,000 of the 10,000 weight bytes are experts, a token routing to half of them: a batch
    of B tokens reads 2,000 + 8,000 * (1 - 0.5 ** B) bytes of weights."""
    header = "# kv_bytes_per_token 1000.0 weight_bytes 10000 expert_bytes 8000 expert_share 0.5\n"
    table = floor_table(load_benchmark("step_trace"), tmp_path / "trace.1", capsys, header, ROWS)
    assert table["1"][4:] == ["1.600", "160.0%"]  # (10,000 + 2,000 + 4,000) / 10,000
    assert table["3-4"][4:] == ["8.850", "177.0%"]  # (40,000 + 2,000 + 7,500 + 30,000 + 2,000 + 7,000) / 10,000


def test_a_trace_without_floor_terms_is_summarized_but_not_floored(tmp_path, capsys):
    module = load_benchmark("step_trace")
    trace = tmp_path / "trace.1"
    trace.write_text("".join(f"{i}.0 d 0 2 2 0\n" for i in range(3)))  # the columns before the floor's
    module.main([str(trace), "--min-steps", "1", "--gap", "100"])
    assert "3 decode steps (mean batch 2.0)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no floor terms"):
        module.main([str(trace), "--min-steps", "1", "--gap", "100", "--bandwidth", "4"])
