"""benchmarks/bench_serving.py: its shared-prefix workload, and a run against `nanovllm
serve -dp 2` on CPU that reads the prefix cache's hit rate from /metrics."""
from __future__ import annotations

import json
import re
import sys
from collections import Counter

import pytest
from bench_scripts import load_benchmark

pytest.importorskip("aiohttp")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def bench():
    yield load_benchmark("bench_serving")
    del sys.modules["bench_serving"]


def test_shared_prefixes_are_equal_shares_in_a_random_order(bench):
    prompts = bench.make_prompts(64, 12, 1000, seed=3, shared_prefixes=8, prefix_len=8)
    assert all(len(p) == 12 for p in prompts)
    prefixes = [tuple(p[:8]) for p in prompts]
    assert sorted(Counter(prefixes).values()) == [8] * 8
    # Not every 8th prompt alike (round-robin over 2 replicas would keep each prefix on one).
    assert any(prefixes[i] != prefixes[i + 8] for i in range(56))
    assert len({tuple(p[8:]) for p in prompts}) == 64
    assert bench.make_prompts(4, 5, 50, seed=1) == bench.make_prompts(4, 5, 50, seed=1, shared_prefixes=0)


def test_a_two_replica_server_reports_its_prefix_cache_hit_rate(bench, qwen3_ckpt, capsys):
    bench.main(["--model", str(qwen3_ckpt), "--device", "cpu", "-dp", "2", "--dp-routing", "round-robin", "--port", "0",
                "--num-prompts", "24", "--shared-prefixes", "3", "--input-len", "40", "--prefix-len", "32",
                "--output-len", "4", "--vocab-size", "300", "--block-size", "16", "--max-num-seqs", "8"])
    out = capsys.readouterr().out
    assert re.search(r"completed: 24$", out, re.MULTILINE) and re.search(r"failed: 0$", out, re.MULTILINE), out
    # Prompts after the first of their prefix on a replica find its two full blocks cached.
    rate = float(re.search(r"prefix_cache_hit_rate: ([\d.]+)", out)[1])
    assert 0 < rate <= 32 / 40, out
    # The first replica's start-up phases, and the server's launch to healthy.
    assert re.search(r"startup_engine_s: [\d.]+$", out, re.MULTILINE), out
    assert re.search(r"startup_server_ready_s: [\d.]+$", out, re.MULTILINE), out


def test_repeats_run_fresh_prompts_offline_and_over_http_and_report_medians(bench, qwen3_ckpt, tmp_path, capsys):
    report = tmp_path / "results.json"
    bench.main(["--model", str(qwen3_ckpt), "--device", "cpu", "--port", "0", "--offline", "--repeats", "3",
                "--num-prompts", "6", "--input-len", "24", "--output-len", "3", "--vocab-size", "300",
                "--block-size", "16", "--max-num-seqs", "8", "--json", str(report)])
    out = capsys.readouterr().out
    assert "median of 3 runs" in out and "HTTP output tok/s is" in out, out
    results = json.loads(report.read_text())
    for kind in ("offline", "http"):
        runs = results[f"{kind}_runs"]
        assert len(runs) == 3 and all(run["completed"] == 6 for run in runs)
        speeds = sorted(run["output_throughput"] for run in runs)
        assert results[kind]["output_throughput"] == speeds[1]
        # Each run's engine steps: from LLM.stats() offline, from the server's /metrics.
        for run in runs:
            assert run["engine_prefill_steps"] >= 1 and run["engine_decode_steps"] >= 1, run
            assert 0 < run["mean_decode_batch"] <= 6, run
    # Start-up as /metrics reports it: the engine's phases and the server's launch to healthy.
    http = results["http"]
    assert 0 < http["startup_engine_s"] < http["startup_server_ready_s"] <= http["server_ready_s"], http
    assert {"startup_process_s", "startup_config_s", "startup_sampler_warm_up_s"} <= http.keys(), http
    # Run r's prompts are seeded apart, so no run starts from another's cached prompts.
    assert bench.make_prompts(6, 24, 300, seed=1) != bench.make_prompts(6, 24, 300, seed=0)


def test_runs_count_the_connections_they_open_unless_opened_beforehand(bench, qwen3_ckpt, tmp_path):
    runs = {}
    for warm in (False, True):
        report = tmp_path / f"warm{warm}.json"
        bench.main(["--model", str(qwen3_ckpt), "--device", "cpu", "--port", "0", "--num-prompts", "5",
                    "--input-len", "8", "--output-len", "2", "--vocab-size", "300", "--block-size", "16",
                    "--json", str(report)] + ["--warm-connections"] * warm)
        runs[warm] = json.loads(report.read_text())["http"]
    # Five requests at once: four new connections beside the warm-up's, then none.
    assert runs[False]["connections_opened"] == 4 and runs[False]["max_connect_ms"] > 0, runs
    assert runs[True]["connections_opened"] == 0 and runs[True]["max_connect_ms"] == 0, runs
    assert runs[True]["completed"] == runs[False]["completed"] == 5


def test_a_running_server_tells_the_prompts_its_vocabulary(bench, qwen3_ckpt, tmp_path, capsys, monkeypatch):
    """With --base-url and no --model the prompt ids stay below the served model's
    vocabulary (its /v1/models card, read once for the vocabulary and the model's name),
    so a small-vocabulary model takes the defaults."""
    vocab = json.loads((qwen3_ckpt / "config.json").read_text())["vocab_size"]
    assert vocab < bench.DEFAULT_PROMPT_VOCAB
    server = bench.launch_server(str(qwen3_ckpt), ["--device", "cpu", "--block-size", "16", "--log-level", "warning"],
                                 log=tmp_path / "server.log")
    try:
        server.wait_ready(bench.STARTUP_TIMEOUT_S)
        assert bench.served_card(server.base_url, None)["vocab_size"] == vocab
        cards = []
        read_card = bench.served_card
        monkeypatch.setattr(bench, "served_card", lambda *args: cards.append(args) or read_card(*args))
        bench.main(["--base-url", server.base_url, "--num-prompts", "3", "--input-len", "8", "--output-len", "2"])
        assert len(cards) == 1
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert re.search(r"completed: 3$", out, re.MULTILINE) and re.search(r"failed: 0$", out, re.MULTILINE), out
