"""AsyncLLMEngine with its engine process: outputs equal offline generate, start-up
errors raise in the caller, a dead engine fails requests instead of hanging them, and
nothing is left running after shutdown."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from nanovllm.testing.server import process_gone

ENGINE_ARGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)


async def collect(engine: AsyncLLMEngine, prompts: list[str], params: SamplingParams, stream: bool) -> list[str]:
    engine.start()
    requests = [engine.make_request(p, params, stream=stream, request_id=str(i)) for i, p in enumerate(prompts)]
    texts = [""] * len(prompts)
    async for deltas in engine.generate(requests, stream=stream):
        for delta in deltas:
            texts[delta.index] += "".join(out.text for out in delta.outputs)
    return texts


def test_stream_equals_offline_and_shutdown_leaves_no_process(qwen3_ckpt):
    prompts = ["The quick brown fox", "def add(a, b):", "Hello"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        expected = [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]
    engine = AsyncLLMEngine(str(qwen3_ckpt), ENGINE_ARGS)
    try:
        assert asyncio.run(collect(engine, prompts, params, stream=True)) == expected
        assert engine.num_generation_tokens == 36
    finally:
        engine.shutdown()
    assert not engine.is_running and process_gone(engine.pid) and not multiprocessing.active_children()


def test_bad_requests_are_refused_with_the_engines_messages(qwen3_ckpt):
    engine = AsyncLLMEngine(str(qwen3_ckpt), ENGINE_ARGS)
    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        for prompt, params in (([], SamplingParams()), ("Hi", SamplingParams(max_tokens=300)),
                               ([1, 10**6], SamplingParams()), ("Hi", SamplingParams(stop_token_ids=[10**6]))):
            with pytest.raises(ValueError) as offline:
                llm.make_request(prompt, params)
            with pytest.raises(ValueError) as served:
                engine.make_request(prompt, params)
            assert str(served.value) == str(offline.value)
    engine.shutdown()


@pytest.mark.parametrize("broken", ["engine_args", "weights"])
def test_startup_errors_raise_in_the_caller_with_the_same_message(qwen3_ckpt, tmp_path, broken):
    if broken == "engine_args":
        model, args = str(qwen3_ckpt), {**ENGINE_ARGS, "max_num_seqs": 0}
    else:  # fails while loading, well past the argument checks
        model, args = str(tmp_path / "ckpt"), ENGINE_ARGS
        shutil.copytree(qwen3_ckpt, model)
        for name in os.listdir(model):
            if name.endswith(".safetensors"):
                with open(os.path.join(model, name), "wb") as f:
                    f.write(b"not a safetensors file")
    with pytest.raises(Exception) as offline:
        LLM(model, **args)
    with pytest.raises(Exception) as served:
        AsyncLLMEngine(model, args)
    assert (type(served.value), str(served.value)) == (type(offline.value), str(offline.value))
    assert not multiprocessing.active_children()


def test_a_killed_engine_fails_running_and_new_requests(qwen3_ckpt):
    engine = AsyncLLMEngine(str(qwen3_ckpt), ENGINE_ARGS)

    async def run() -> None:
        engine.start()
        request = engine.make_request("Hello", SamplingParams(max_tokens=200, ignore_eos=True), stream=True)
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            async for _ in engine.generate([request], stream=True):
                os.kill(engine.pid, signal.SIGKILL)
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([engine.make_request("Hi", SamplingParams(max_tokens=2))]):
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=60))
    finally:
        engine.shutdown()
    assert process_gone(engine.pid)
