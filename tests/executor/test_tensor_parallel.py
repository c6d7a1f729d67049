"""Tensor parallelism on CPU over gloo: the same greedy tokens as one rank and as Hugging
Face, several engines per process, clean shutdown, and a dead worker raising an error."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.executor.worker import SHM_PREFIX
from nanovllm.testing.checkpoints import hf_greedy
from nanovllm.utils.distributed import TPGroup
from parity import (
    MAX_TOKENS, TIE_TOLERANCE, assert_differs_only_at_ties, generate_twice, make_llm, mixed_prompts,
    shared_prefix_prompts,
)

# 10 blocks of 16 tokens: too few for the mixed prompts to all decode at once (preemption).
SMALL_POOL = dict(kvcache_block_size=16, num_kvcache_blocks=10)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def greedy_tokens(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def hf_tokens(path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(path, prompts, MAX_TOKENS, ignore_eos=True)


def our_shm_segments(pid: int | None = None) -> set[str]:
    """The engines' shared-memory segments, or those of the engine in process `pid` (test
    files running beside this one in other processes make and free their own meanwhile)."""
    prefix = SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}_"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def assert_cleaned_up(pids: list[int], shm_name: str) -> None:
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} is still there"
    assert shm_name not in our_shm_segments()


@pytest.fixture(scope="module")
def qwen3_tp2(qwen3_ckpt):
    with make_llm(qwen3_ckpt, tensor_parallel_size=2, **SMALL_POOL) as llm:
        yield llm


@pytest.fixture(scope="module")
def llama_tp2(llama_ckpt):
    with make_llm(llama_ckpt, tensor_parallel_size=2, **SMALL_POOL) as llm:
        yield llm


@pytest.fixture(scope="module")
def qwen3_moe_tp2(qwen3_moe_ckpt):
    """Each rank holds half of every expert's intermediate dimension."""
    with make_llm(qwen3_moe_ckpt, tensor_parallel_size=2, **SMALL_POOL) as llm:
        yield llm


@pytest.fixture(scope="module")
def qwen3_moe_ep2(qwen3_moe_ckpt):
    """Expert parallel: each rank holds four of the eight experts, whole."""
    with make_llm(qwen3_moe_ckpt, tensor_parallel_size=2, enable_expert_parallel=True, **SMALL_POOL) as llm:
        yield llm


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe", "qwen3_moe_ep"])
def test_tp2_matches_one_rank_and_hf(request, arch):
    path = request.getfixturevalue(f"{arch.removesuffix('_ep')}_ckpt")
    llm = request.getfixturevalue(f"{arch}2" if arch.endswith("_ep") else f"{arch}_tp2")
    mixed = mixed_prompts(llm.vocab_size, 16)
    shared = shared_prefix_prompts(llm.vocab_size, 16)
    with make_llm(path, **SMALL_POOL) as single:
        expected_mixed = greedy_tokens(single, mixed)
        expected_shared = greedy_tokens(single, shared)
    assert expected_mixed == hf_tokens(path, mixed)

    preemptions = llm.scheduler.num_preemptions
    assert greedy_tokens(llm, mixed) == expected_mixed
    assert llm.scheduler.num_preemptions > preemptions

    manager = llm.scheduler.block_manager
    assert greedy_tokens(llm, shared) == expected_shared
    hits = manager.num_prompt_tokens_hit
    assert greedy_tokens(llm, shared) == expected_shared  # the same call again: prefix-cache hits
    assert manager.num_prompt_tokens_hit > hits
    assert manager.num_used_blocks == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA machines the two-GPU test runs the Triton backend for real")
def test_tp2_with_the_triton_kernels_matches_hf(qwen3_ckpt):
    """The Triton backend under tensor parallelism, through the interpreter on CPU: each
    rank's fused rotary-store and attention kernels work on its own share of the heads,
    from fresh prompts and from the prefix cache; the steps with prompt tokens go through
    the prefill graphs' pieces (plain calls on CPU), all-reduces inside them."""
    with make_llm(qwen3_ckpt, tensor_parallel_size=2, attention_backend="triton", num_kvcache_blocks=32,
                  max_prefill_graph_tokens=256) as llm:
        assert all(layer.stores_rotated() for layer in llm.executor.runner.attention_layers)
        prompts = shared_prefix_prompts(llm.vocab_size, 16)[:3]
        expected = hf_tokens(qwen3_ckpt, prompts)
        assert greedy_tokens(llm, prompts) == expected
        assert greedy_tokens(llm, prompts) == expected  # prefix-cache hits: the paged prefill kernel
        assert llm.scheduler.block_manager.num_prompt_tokens_hit > 0
        assert llm.stats()["prefill_graph_replays"] > 0


def test_expert_parallel_shards_and_the_fused_kernels(qwen3_moe_ep2, qwen3_moe_ckpt):
    """Rank 0 holds experts 0-3 with their whole intermediate dimension (the workers hold
    the rest); with the fused MoE kernels (interpreter on CPU) the pairs routed to the
    other rank's experts count as no expert, and the tokens are still HF's."""
    from nanovllm.layers.fused_moe import FusedMoE

    moe = [m for m in qwen3_moe_ep2.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == 1 and moe[0].first_expert == 0 and moe[0].w13.shape == (4, 2 * 32, 64)
    if torch.cuda.is_available():
        return  # on CUDA machines the two-GPU test runs the fused kernels for real
    with make_llm(qwen3_moe_ckpt, tensor_parallel_size=2, enable_expert_parallel=True, attention_backend="triton",
                  num_kvcache_blocks=32) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16, seed=2, count=4)
        assert greedy_tokens(llm, prompts) == hf_tokens(qwen3_moe_ckpt, prompts)


def test_tp_steps_stay_in_flight(qwen3_ckpt, monkeypatch):
    """With room to spare, a TP step is launched before the previous one's tokens reach the
    host, as on one rank: the workers get those tokens from rank 0's broadcast. Greedy
    output is still HF's."""
    from nanovllm.executor.model_runner import ModelRunner

    shared = []
    share_sampled = ModelRunner.share_sampled

    def spy(self, num_prev, sampled=None):
        shared.append(num_prev)
        return share_sampled(self, num_prev, sampled)

    monkeypatch.setattr(ModelRunner, "share_sampled", spy)
    prompts = mixed_prompts(384, 16, seed=8, count=4)
    with make_llm(qwen3_ckpt, tensor_parallel_size=2) as llm:
        assert greedy_tokens(llm, prompts) == hf_tokens(qwen3_ckpt, prompts)
    assert sum(n > 0 for n in shared) >= MAX_TOKENS - 2  # every decode step but the first few


def test_a_message_is_not_overwritten_by_the_next():
    """Rank 0 may write step N + 1's message before a slow worker has read step N's (its
    collectives are queued, not waited for): the two lie in different halves, and a
    worker reading late still gets both, in order."""
    from multiprocessing.shared_memory import SharedMemory

    from nanovllm.executor.worker import read_message, write_message

    shm = SharedMemory(create=True, size=2 * 4096)
    try:
        write_message(shm, ("execute", (True, [[1, 2]], 0)), 0)
        write_message(shm, ("execute", (False, [[3]], 1)), 1)
        assert read_message(shm, 0) == ("execute", (True, [[1, 2]], 0))
        assert read_message(shm, 1) == ("execute", (False, [[3]], 1))
        write_message(shm, ("exit", ()), 2)  # step 0's half again, once step 0 is done
        assert read_message(shm, 2) == ("exit", ()) and read_message(shm, 1)[1][0] is False
        with pytest.raises(RuntimeError, match="exceeds the 4096-byte buffer"):
            write_message(shm, ("execute", (list(range(2000)),)), 3)
        # A worker still to read message 2 when rank 0 stops it: the exit written over it.
        write_message(shm, ("execute", (True, [[4]], 0)), 2)
        write_message(shm, ("exit", ()), 4)
        assert read_message(shm, 2) == ("exit", ())
        write_message(shm, ("execute", (True, [[5]], 0)), 5)  # past message 3: not an exit
        with pytest.raises(RuntimeError, match="message 3 was overwritten"):
            read_message(shm, 3)
    finally:
        shm.close()
        shm.unlink()


def test_two_engines_side_by_side(qwen3_tp2, llama_tp2, qwen3_ckpt, llama_ckpt):
    prompts = mixed_prompts(qwen3_tp2.vocab_size, 16, seed=4, count=5)
    assert qwen3_tp2.executor.workers.shm.name != llama_tp2.executor.workers.shm.name
    for _ in range(2):  # interleaved
        assert greedy_tokens(qwen3_tp2, prompts) == hf_tokens(qwen3_ckpt, prompts)
        assert greedy_tokens(llama_tp2, prompts) == hf_tokens(llama_ckpt, prompts)


def test_engines_one_after_the_other_and_a_killed_worker(qwen3_ckpt, llama_ckpt):
    prompts = mixed_prompts(384, 16, seed=6, count=6)
    llm = make_llm(qwen3_ckpt, tensor_parallel_size=2)
    workers = llm.executor.workers
    pids, shm_name = [p.pid for p in workers.processes], workers.shm.name
    assert shm_name in our_shm_segments()
    assert greedy_tokens(llm, prompts) == hf_tokens(qwen3_ckpt, prompts)
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert_cleaned_up(pids, shm_name)

    # Four ranks over Llama's two KV heads: each KV head is replicated on two ranks.
    llm = make_llm(llama_ckpt, tensor_parallel_size=4)
    workers = llm.executor.workers
    pids, shm_name = [p.pid for p in workers.processes], workers.shm.name
    assert greedy_tokens(llm, prompts) == hf_tokens(llama_ckpt, prompts)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2"):
        greedy_tokens(llm, prompts)
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError):  # still unusable, still no hang
        greedy_tokens(llm, prompts)
    llm.shutdown()
    assert_cleaned_up(pids, shm_name)


def test_worker_killed_during_a_step(qwen3_ckpt):
    """A worker that dies mid-step breaks the collective rank 0 waits in: an error, no hang."""
    llm = make_llm(qwen3_ckpt, tensor_parallel_size=2)
    workers = llm.executor.workers
    pids, shm_name = [p.pid for p in workers.processes], workers.shm.name
    call = workers.call

    def call_then_kill(*args):
        call(*args)
        os.kill(pids[0], signal.SIGKILL)

    workers.call = call_then_kill
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        greedy_tokens(llm, mixed_prompts(384, 16, count=4))
    assert time.monotonic() - start < 10
    llm.shutdown()
    assert_cleaned_up(pids, shm_name)


def test_a_stuck_group_teardown_is_given_up_on(caplog):
    """Shutting down never hangs on a communicator that does not tear down (NCCL can block
    on a peer or on work a CUDA graph holds): it warns and leaves it to process exit."""
    class StuckGroup:
        def name(self) -> str:
            return "nccl"

        def abort(self) -> None:
            threading.Event().wait()

    with caplog.at_level(logging.WARNING):
        TPGroup(0, 2, StuckGroup()).shutdown(timeout_s=0.1)
    assert "did not tear down within" in caplog.text


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_that_does_not_divide_the_heads_is_rejected(qwen3_ckpt, tp):
    before = our_shm_segments(os.getpid())
    with pytest.raises(ValueError, match="num_attention_heads"):
        make_llm(qwen3_ckpt, tensor_parallel_size=tp)
    assert our_shm_segments(os.getpid()) == before


CTRL_C_SCRIPT = """
import sys, time
from nanovllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32",
              kvcache_block_size=16, num_kvcache_blocks=64)
    print("pids", *[p.pid for p in llm.executor.workers.processes], flush=True)
    while True:  # until Ctrl-C
        llm.generate([[5, 6, 7] * 10], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
"""


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie waiting to be reaped by init."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_shuts_everything_down(qwen3_ckpt, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(qwen3_ckpt)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids"), proc.stderr.read()
        workers = [int(pid) for pid in line.split()[1:]]
        time.sleep(1.0)  # let it generate
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in proc.stderr.read()
    deadline = time.monotonic() + 10
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in workers:
        assert not running(pid), f"worker {pid} outlived Ctrl-C"
    assert not our_shm_segments(proc.pid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", list(TIE_TOLERANCE))
def test_tp2_on_two_gpus_matches_hf(qwen3_ckpt, dtype, caplog):
    """NCCL, Triton attention, CUDA graphs and torch.compile on two GPUs: HF's greedy tokens
    (up to ties at the precision in use) under preemption and from the prefix cache; on
    shutdown the communicators tear down, and the worker and its shared memory are gone."""
    # Few graph buckets (max_num_seqs 16, prefill pieces up to 128 tokens) keep capture short on both ranks.
    engine = dict(device="cuda", dtype=dtype, tensor_parallel_size=2, max_num_seqs=16, max_model_len=256,
                  max_prefill_graph_tokens=128, **SMALL_POOL)
    with LLM(str(qwen3_ckpt), **engine) as llm:
        workers = llm.executor.workers
        pids, shm_name = [p.pid for p in workers.processes], workers.shm.name
        assert llm.executor.runner.graph_runner is not None
        for prompts in (mixed_prompts(llm.vocab_size, 16), shared_prefix_prompts(llm.vocab_size, 16)):
            got = generate_twice(llm, prompts)
            assert_differs_only_at_ties(qwen3_ckpt, prompts, got, hf_tokens(qwen3_ckpt, prompts), TIE_TOLERANCE[dtype])
        assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.block_manager.num_prompt_tokens_hit > 0
        assert llm.stats()["graph_replays"] > 0 and llm.stats()["prefill_graph_replays"] > 0
    assert_cleaned_up(pids, shm_name)
    assert "did not tear down" not in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_moe_on_two_gpus_matches_hf(qwen3_moe_ckpt, expert_parallel):
    """Qwen3-MoE on two GPUs, the fused MoE kernels inside CUDA graphs: each rank a slice of
    every expert (tp) or half of the experts whole (ep). In float32: a bf16 router picks
    other experts than the oracle's wherever two are close, which is no logit tie."""
    engine = dict(device="cuda", dtype="float32", tensor_parallel_size=2, max_num_seqs=16, max_model_len=256,
                  enable_expert_parallel=expert_parallel, **SMALL_POOL)
    with LLM(str(qwen3_moe_ckpt), **engine) as llm:
        prompts = mixed_prompts(llm.vocab_size, 16)
        got = generate_twice(llm, prompts)
        assert_differs_only_at_ties(qwen3_moe_ckpt, prompts, got, hf_tokens(qwen3_moe_ckpt, prompts),
                                    TIE_TOLERANCE["float32"])
        assert llm.stats()["graph_replays"] > 0
