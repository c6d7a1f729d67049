"""AsyncLLMEngine with its engine process: outputs equal offline generate, start-up
errors raise in the caller, a dead engine fails requests instead of hanging them, and
nothing is left running after shutdown."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.serving.async_engine import AsyncLLMEngine, EngineDeadError
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

    async def both() -> tuple[list[str], list[str]]:
        streamed = await collect(engine, prompts, params, stream=True)
        changing = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        requests = [engine.make_request(p, changing, request_id=f"c{i}") for i, p in enumerate(prompts)]
        changing.max_tokens, changing.temperature = 1, 1.0  # the requests run on their own copies
        texts = [""] * len(prompts)
        async for deltas in engine.generate(requests):
            for delta in deltas:
                texts[delta.index] = delta.outputs[0].text
        return streamed, texts

    try:
        streamed, made_before_the_change = asyncio.run(both())
        assert streamed == expected and made_before_the_change == expected
        assert engine.num_generation_tokens == 72
    finally:
        engine.shutdown()
    assert not engine.is_running and process_gone(engine.pid) and not multiprocessing.active_children()


def test_reset_prefix_cache_is_answered_by_the_engine_process(qwen3_ckpt):
    """True while idle, False while a request runs there; EngineDeadError once it is gone."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine = AsyncLLMEngine(str(qwen3_ckpt), ENGINE_ARGS)

    async def run() -> tuple[bool, bool, bool]:
        engine.start()
        idle = await engine.reset_prefix_cache()
        stream = engine.generate([engine.make_request("The quick brown fox", params, stream=True)], stream=True)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the request is sent: the engine takes it before the reset
        running = await engine.reset_prefix_cache()
        await first
        async for _ in stream:
            pass
        after = await engine.reset_prefix_cache()
        os.kill(engine.pid, signal.SIGKILL)
        while engine.is_running:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            await engine.reset_prefix_cache()
        return idle, running, after

    try:
        assert asyncio.run(run()) == (True, False, True)
    finally:
        engine.shutdown()


def test_plain_streams_are_decoded_here_the_others_by_the_engine(qwen3_ckpt):
    """A stream of one completion without logprobs or stop strings is decoded in this
    process from the engine's tokens; stop strings, logprobs and n > 1 keep the engine's
    decoding. Every text equals offline's, and the decoders go with their requests."""
    prompt = "The quick brown fox"
    base = dict(temperature=0, max_tokens=10, ignore_eos=True)
    kinds = {"plain": (SamplingParams(**base), False), "stop": (SamplingParams(**base, stop=["zzz"]), True),
             "logprobs": (SamplingParams(**base, logprobs=1), True), "n2": (SamplingParams(**base, n=2), True)}
    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        expected = {kind: [o.text for o in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
                    for kind, (params, _) in kinds.items()}

    async def run(engine: AsyncLLMEngine) -> dict[str, list[str]]:
        engine.start()
        requests = {kind: engine.make_request(prompt, params, stream=True, request_id=kind)
                    for kind, (params, _) in kinds.items()}
        texts = {kind: [""] * params.n for kind, (params, _) in kinds.items()}
        async for deltas in engine.generate(list(requests.values()), stream=True):
            for delta in deltas:
                kind = list(kinds)[delta.index]
                for out in delta.outputs:
                    texts[kind][out.index] += out.text
        assert {kind: r.engine_decodes for kind, r in requests.items()} == {k: d for k, (_, d) in kinds.items()}
        assert not engine._consumers
        return texts

    engine = AsyncLLMEngine(str(qwen3_ckpt), ENGINE_ARGS)
    try:
        assert asyncio.run(run(engine)) == expected
    finally:
        engine.shutdown()


def test_a_burst_that_overfills_the_pipe_completes_on_uvloop(qwen3_ckpt):
    """Hundreds of requests at once, more bytes than the pipe to the engine holds while it
    steps, on uvloop (uvicorn's loop wherever it is installed): all complete. uvloop makes
    a descriptor it watches non-blocking; when the event loop watched the pipe, the first
    send to a full pipe failed, the sender stopped, and every later request hung (the H200
    serving benchmark stopped at 87 of 1,000 requests)."""
    import uvloop

    args = dict(ENGINE_ARGS, num_kvcache_blocks=1024)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(240)] for i in range(400)]  # ~330 kB of requests
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run_all(engine: AsyncLLMEngine) -> list[int]:
        engine.start()

        async def one(i: int) -> int:
            request = engine.make_request(prompts[i], params, request_id=str(i))
            async for deltas in engine.generate([request]):
                return len(deltas[0].outputs[0].token_ids)

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), timeout=240)

    engine = AsyncLLMEngine(str(qwen3_ckpt), args)
    try:
        assert uvloop.run(run_all(engine)) == [2] * len(prompts)
    finally:
        engine.shutdown()


def test_bad_requests_are_refused_with_the_engines_messages(qwen3_ckpt):
    engine = AsyncLLMEngine(str(qwen3_ckpt), ENGINE_ARGS)
    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        for prompt, params in (([], SamplingParams()), ([1] * 1000, SamplingParams()),
                               ([1, 10**6], SamplingParams()), ("Hi", SamplingParams(stop_token_ids=[10**6])),
                               ("Hi", SamplingParams(allowed_token_ids=[1, 10**6])),
                               ("Hi", SamplingParams(logit_bias={10**6: 1.0}))):
            with pytest.raises(ValueError) as offline:
                llm.make_request(prompt, params)
            with pytest.raises(ValueError) as served:
                engine.make_request(prompt, params)
            assert str(served.value) == str(offline.value)
        # max_tokens past the context: offline the output stops there, a server refuses it
        most = llm.checker.most_tokens
        request = llm.make_request([1] * 10, SamplingParams(max_tokens=most, min_tokens=most))
        assert (request.params.max_tokens, request.params.min_tokens) == (most - 10, most - 10)
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            engine.make_request([1] * 10, SamplingParams(max_tokens=most))
        assert engine.make_request([1] * 10, SamplingParams(max_tokens=most), fit=True).params.max_tokens == most - 10
        assert engine.make_request([1] * 10, SamplingParams(max_tokens=None)).params.max_tokens == most - 10
    engine.shutdown()


@pytest.mark.parametrize("broken", ["engine_args", "weights", "tokenizer"])
def test_startup_errors_raise_in_the_caller_with_the_same_message(qwen3_ckpt, tmp_path, broken, caplog):
    """The tokenizer fails in the API process (which loads it for the engine process): the
    engine process, still building, is stopped at once rather than waited for."""
    if broken == "engine_args":
        model, args = str(qwen3_ckpt), {**ENGINE_ARGS, "max_num_seqs": 0}
    else:  # fails while loading, well past the argument checks
        model, args = str(tmp_path / "ckpt"), ENGINE_ARGS
        shutil.copytree(qwen3_ckpt, model)
        for name in os.listdir(model):
            if name.endswith(".safetensors" if broken == "weights" else "tokenizer.json"):
                with open(os.path.join(model, name), "wb") as f:
                    f.write(b"not a safetensors file" if broken == "weights" else b"{not json")
    with pytest.raises(Exception) as offline:
        LLM(model, **args)
    with pytest.raises(Exception) as served:
        AsyncLLMEngine(model, args)
    assert (type(served.value), str(served.value)) == (type(offline.value), str(offline.value))
    assert not multiprocessing.active_children()
    assert "did not exit" not in caplog.text


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


def test_step_messages_pickle_as_constructor_arguments():
    """What crosses the pipe every step comes back equal, logprobs and errors included,
    through each class's own constructor (pickle_as_arguments)."""
    import pickle
    from dataclasses import dataclass, field

    from nanovllm.serving.messages import EngineRequest, RequestMetrics, RequestOutputDelta, StepOutputs, StreamColumns
    from nanovllm.outputs import CompletionOutput, Logprob
    from nanovllm.utils.pickling import pickle_as_arguments

    output = CompletionOutput(1, " café", [17, 4], "stop", "\n", [{17: Logprob(-0.25, 1, " caf")}, {4: Logprob(-2.0, 3)}],
                              -2.25)
    streams = StreamColumns()
    streams.add("10", " a", [5], None, None)
    streams.add("11", "", [], "stop", 2)
    step = StepOutputs([RequestOutputDelta("7", [output], True)], [("8", ValueError("too long"))],
                       [RequestMetrics(1.0, 5, 1.5, 2.0, 2, 2)], {"kv_cache_usage": 0.5}, streams)
    loaded = pickle.loads(pickle.dumps(step))
    assert loaded.deltas == step.deltas and loaded.finished == step.finished and loaded.stats == step.stats
    assert loaded.streams == streams
    assert loaded.errors[0][0] == "8" and str(loaded.errors[0][1]) == "too long"
    request = EngineRequest("9", [1, 2, 3], SamplingParams(stop="\n", max_tokens=3), True, 4.0)
    assert pickle.loads(pickle.dumps(request)) == request
    assert CompletionOutput.__reduce__(output)[0] is CompletionOutput

    @dataclass
    class WithDerivedField:
        a: int
        b: list = field(init=False, default_factory=list)

    with pytest.raises(TypeError, match="all set by __init__"):
        pickle_as_arguments(WithDerivedField)


def test_the_engine_sends_without_waiting_and_joins_messages_that_pile_up():
    """The engine loop only queues its messages; while the API process is not reading (a
    message larger than the pipe holds is in the way), the messages that follow go as one
    list, in order. A closed pipe marks the API process gone."""
    from nanovllm.outputs import CompletionOutput
    from nanovllm.serving.engine_process import Outbox
    from nanovllm.serving.messages import EngineFailed, RequestOutputDelta, StepOutputs

    ours, theirs = multiprocessing.Pipe()
    outbox = Outbox(ours)
    large = StepOutputs([], [], [], {"large": 1.0, "padding": "x" * (8 << 20)})
    outbox.put(large)
    time.sleep(0.5)  # the sender takes it and blocks in send: the pipe holds far less
    steps = [StepOutputs([RequestOutputDelta(str(i), [CompletionOutput(0, f" t{i}", [i], None)], i == 2)], [], [],
                         {"step": float(i)}) for i in range(3)]
    for step in steps:
        outbox.put(step)
    outbox.put(EngineFailed("boom"))
    assert theirs.recv() == [large]
    joined = theirs.recv()
    assert joined[:3] == steps and joined[3] == EngineFailed("boom")
    assert [step.deltas[0].outputs[0].text for step in joined[:3]] == [" t0", " t1", " t2"]
    outbox.close(timeout=5)
    assert outbox.messages == 2 and not outbox.gone.is_set()

    outbox = Outbox(ours)
    theirs.close()
    outbox.put(steps[0])
    assert outbox.gone.wait(timeout=5)
    outbox.close(timeout=5)
    ours.close()


def test_freezing_start_up_objects_takes_them_out_of_collections():
    import gc

    from nanovllm.utils.pickling import freeze_startup_objects

    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 1000  # at least what importing torch left behind
    finally:
        gc.unfreeze()  # this test process goes on building and dropping engines


def test_a_stream_whose_tokens_cannot_be_decoded_fails_alone(qwen3_ckpt, monkeypatch):
    """Decoding a plain stream's tokens here raising fails that request with one clear
    error; the other stream in the same steps completes, and the engine serves on."""

    class Undecodable:
        def add(self, token_ids, finish_reason, stop_reason):
            raise KeyError("no such token")

    decoder = AsyncLLMEngine._stream_decoder
    monkeypatch.setattr(AsyncLLMEngine, "_stream_decoder", lambda self, request, stream: (
        Undecodable() if request.request_id == "bad" else decoder(self, request, stream)))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run(engine: AsyncLLMEngine) -> tuple[list[str], str]:
        engine.start()

        async def one(request_id: str) -> str:
            request = engine.make_request("The quick brown fox", params, stream=True, request_id=request_id)
            text = ""
            try:
                async for deltas in engine.generate([request], stream=True):
                    text += "".join(out.text for d in deltas for out in d.outputs)
            except RuntimeError as exc:
                return str(exc)
            return text

        results = await asyncio.gather(one("bad"), one("good"))
        assert not engine._consumers
        return results, await one("again")

    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        expected = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLMEngine(str(qwen3_ckpt), ENGINE_ARGS)
    try:
        (bad, good), again = asyncio.run(run(engine))
        assert engine.is_running
    finally:
        engine.shutdown()
    assert bad.startswith("decoding the output failed") and good == again == expected
