"""Data parallelism on one host (serving/data_parallel.py): replicas in engine processes
give the same outputs as one engine, in input order."""
from __future__ import annotations

import os
import re

import pytest
from parity import mixed_prompts

from nanovllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.serving.data_parallel import DataParallelLLM, spread
from nanovllm.serving.replicas import replica_devices

ENGINE = dict(device="cpu", dtype="float32", num_kvcache_blocks=64)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def dp2(qwen3_ckpt):
    with LLM(str(qwen3_ckpt), data_parallel_size=2, **ENGINE) as llm:
        yield llm


def test_greedy_seeded_and_chat_equal_one_engine(dp2, qwen3_ckpt):
    assert isinstance(dp2, DataParallelLLM) and dp2.data_parallel_size == 2
    prompts = ["The quick brown fox", *mixed_prompts(dp2.tokenizer.vocab_size, 16, seed=3)[:5], "Hello"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=8, ignore_eos=True) for i in range(len(prompts))]
    conversation = [{"role": "user", "content": "Hi there"}]
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    beams = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    with LLM(str(qwen3_ckpt), **ENGINE) as one:
        expected = [tokens(one.generate(prompts, greedy, use_tqdm=False)),
                    tokens(one.generate(prompts, seeded, use_tqdm=False)),
                    one.chat(conversation, greedy, use_tqdm=False)[0],
                    [out.prompt_logprobs for out in one.generate(prompts, scored, use_tqdm=False)],
                    [[b.tokens for b in out.sequences] for out in one.beam_search(prompts[:3], beams)]]
    before = [replica.num_generation_tokens for replica in dp2.replicas]
    outputs = dp2.generate(prompts, greedy, use_tqdm=False)
    assert tokens(outputs) == expected[0]
    assert [out.prompt for out in outputs] == [p if isinstance(p, str) else None for p in prompts]
    assert outputs[1].prompt_token_ids == prompts[1]
    assert tokens(dp2.generate(prompts, seeded, use_tqdm=False)) == expected[1]
    [chat] = dp2.chat(conversation, greedy, use_tqdm=False)
    assert chat.prompt == expected[2].prompt and tokens([chat]) == tokens([expected[2]])
    scored_outputs = dp2.generate(prompts, scored, use_tqdm=False)
    assert all(out.num_cached_tokens == 0 for out in scored_outputs)  # prompt logprobs take no cache hits
    scores = [out.prompt_logprobs for out in scored_outputs]
    assert [[e and {t: (lp.rank, lp.decoded_token) for t, lp in e.items()} for e in s] for s in scores] == \
        [[e and {t: (lp.rank, lp.decoded_token) for t, lp in e.items()} for e in s] for s in expected[3]]
    assert [[b.tokens for b in out.sequences] for out in dp2.beam_search(prompts[:3], beams)] == expected[4]
    used = [replica.num_generation_tokens - b for replica, b in zip(dp2.replicas, before)]
    assert all(n > 0 for n in used), used  # both replicas ran requests


def test_reset_prefix_cache_reaches_every_replica(dp2):
    block = dp2.config.kvcache_block_size
    vocab = dp2.tokenizer.vocab_size
    prompts = [[(i * 7919 + t * 104729) % (vocab - 3) + 3 for t in range(block + 9)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    dp2.generate(prompts, params, use_tqdm=False)
    assert any(out.num_cached_tokens for out in dp2.generate(prompts, params, use_tqdm=False))
    assert dp2.reset_prefix_cache()
    assert all(out.num_cached_tokens == 0 for out in dp2.generate(prompts, params, use_tqdm=False))


def test_requests_are_checked_before_any_runs(dp2):
    with pytest.raises(ValueError, match="max_model_len"):
        dp2.generate(["ok", "x " * 5000], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="the regex cannot be compiled"):
        dp2.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")), use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt 1: the regex cannot be compiled"):
        dp2.generate(["x", "y"], [SamplingParams(), SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="(a"))], use_tqdm=False)
    [out] = dp2.generate("x = ", SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])), use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match=r"^prompt 1: priority \(2\) needs scheduling_policy='priority'"):
        dp2.generate(["x", "y"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 2])
    assert len(dp2.generate(["x", "y"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 0])) == 2

def test_a_grammar_past_its_budget_ends_its_completion_as_on_one_engine(dp2, monkeypatch):
    """The requests generate sends its replicas say so (EngineRequest.overrun_fails off):
    a grammar past its fill budget then ends its completion with "abort", as on one engine,
    not the replica's whole batch with an error (tests/serving/test_engine_loop.py runs
    both kinds)."""
    sent = []
    for replica in dp2.replicas:
        monkeypatch.setattr(replica, "generate", lambda requests, *args, _generate=replica.generate, **kwargs:
                            sent.extend(requests) or _generate(requests, *args, **kwargs))
    assert len(dp2.generate(["x", "y", "z"], SamplingParams(max_tokens=2), use_tqdm=False)) == 3
    assert len(sent) == 3 and not any(request.overrun_fails for request in sent)


def test_an_interrupted_generate_aborts_its_requests_on_every_replica(dp2):
    """Ctrl-C while generate waits: the requests it started on both replicas are aborted
    (they would run on, holding their KV blocks), and the next generate runs at once."""
    import signal
    import threading
    import time

    def interrupt_once_both_run():
        deadline = time.monotonic() + 30
        while not all(replica._consumers for replica in dp2.replicas) and time.monotonic() < deadline:
            time.sleep(0.005)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # wakes the waiting main thread

    threading.Thread(target=interrupt_once_both_run, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        dp2.generate(["one", "two", "three", "four"], SamplingParams(max_tokens=100_000, ignore_eos=True),
                     use_tqdm=False)
    assert not any(replica._consumers for replica in dp2.replicas)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(replica.latest_stats.get("num_requests_running")
                                              for replica in dp2.replicas):
        time.sleep(0.1)
    assert [(r.latest_stats["num_requests_running"], r.latest_stats["kv_blocks_used"]) for r in dp2.replicas] == \
        [(0, 0), (0, 0)], [r.latest_stats for r in dp2.replicas]
    [out] = dp2.generate("x", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_shutdown_stops_every_replica(qwen3_ckpt):
    llm = LLM(str(qwen3_ckpt), data_parallel_size=2, **ENGINE)
    pids = [replica.pid for replica in llm.replicas]
    assert llm.get_default_sampling_params() == SamplingParams(**llm.replicas[0].generation_defaults)
    llm.shutdown()
    llm.shutdown()  # idempotent
    for call in (lambda: llm.generate("Hello", use_tqdm=False), llm.reset_prefix_cache):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_requests_spread_largest_first_to_the_least_loaded():
    assert spread([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]  # loads 5+2+1 = 8 and 4+3 = 7
    assert spread([1, 1, 1], 3) == [[0], [1], [2]]
    assert spread([7], 2) == [[0], []]


def test_each_replica_gets_its_own_gpus():
    assert replica_devices(2, 1, 2, None) == ["0", "1"]
    assert replica_devices(2, 2, 8, "4,5,6,7") == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="needs 4 GPUs; 2 are visible"):
        replica_devices(2, 2, 2, None)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_sizes_are_refused(qwen3_ckpt, value):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        LLM(str(qwen3_ckpt), data_parallel_size=value, **ENGINE)


def test_an_engine_is_one_replica(qwen3_ckpt):
    with pytest.raises(ValueError, match="an LLMEngine is one replica"):
        LLMEngine(str(qwen3_ckpt), data_parallel_size=2, **ENGINE)


def test_the_command_line(qwen3_ckpt):
    """`nanovllm generate -dp 2` prints what one engine does; the one-engine commands say
    in one line that they do not take -dp."""
    import subprocess
    import sys

    def nanovllm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nanovllm", *args], capture_output=True, text=True, timeout=300)

    common = ["generate", "The quick brown", "Hello", "--model", str(qwen3_ckpt), "--device", "cpu", "--dtype",
              "float32", "--temperature", "0", "--max-tokens", "6", "--json"]
    one, two = nanovllm(*common), nanovllm(*common, "-dp", "2")
    assert one.returncode == two.returncode == 0, two.stderr
    assert one.stdout == two.stdout and len(one.stdout.splitlines()) == 2
    refused = nanovllm("chat", "--model", str(qwen3_ckpt), "-dp", "2")
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("nanovllm: error: `nanovllm chat` runs one engine; --data-parallel-size (-dp) is "
                                      "for `nanovllm generate`, `serve`, `run-batch`, `bench` and "
                                      "LLM(..., data_parallel_size=N) so far")
    bench = nanovllm("bench", "--model", str(qwen3_ckpt), "--device", "cpu", "--num-seqs", "6", "-dp", "2")
    assert bench.returncode == 0, bench.stderr
    assert "data parallel 2" in bench.stdout and "output tok/s" in bench.stdout
    shares = [int(float(x)) for x in re.findall(r"replica\d_generation_tokens_total ([\d.]+)", bench.stdout)]
    assert len(shares) == 2 and all(shares), bench.stdout


def test_a_script_that_never_shuts_down_still_exits(qwen3_ckpt):
    """The replicas stop at interpreter exit, before multiprocessing would wait for them."""
    import subprocess
    import sys

    script = ("from nanovllm import LLM, SamplingParams\n"
              "if __name__ == '__main__':\n"
              f"    llm = LLM({str(qwen3_ckpt)!r}, device='cpu', dtype='float32', data_parallel_size=2)\n"
              "    print(len(llm.generate(['hi'], SamplingParams(max_tokens=2), use_tqdm=False)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
