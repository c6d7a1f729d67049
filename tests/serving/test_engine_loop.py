"""The engine process's loop, run in a thread over a real pipe: the commands it takes and
the messages it sends back."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import struct
import subprocess
import sys
import threading
import time

import pytest
from multiprocessing.reduction import ForkingPickler

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import StreamText
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import CompletionOutput
from nanovllm.serving.engine_process import HEARTBEAT_INTERVAL_S, EngineLoop
from nanovllm.serving.loop_stats import LoopIteration, trace_summary
from nanovllm.serving.messages import AbortRequests, EngineFailed, EngineRequest, RequestOutputDelta, StepOutputs

ENGINE_ARGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(qwen3_ckpt):
    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        return [out.outputs[0] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


class LoopUnderTest:
    """An EngineLoop in a thread; the test plays the API process at the other end."""

    def __init__(self, ckpt, **engine_args):
        self.engine = LLMEngine(str(ckpt), **{**ENGINE_ARGS, **engine_args})
        self.conn, theirs = multiprocessing.Pipe()
        self.thread = threading.Thread(target=EngineLoop(self.engine, theirs).run, daemon=True)
        self.thread.start()

    def send(self, command) -> None:
        self.conn.send(command)

    def steps(self, until) -> list[StepOutputs]:
        """StepOutputs as they come, until `until(steps so far)` holds."""
        steps = []
        while not until(steps):
            assert self.conn.poll(30), "the loop sent nothing for 30 s"
            messages = self.conn.recv()
            assert all(isinstance(m, StepOutputs) for m in messages), messages
            steps += messages
        return steps

    def close(self) -> None:
        self.send(None)
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.engine.shutdown()


def deltas(step: StepOutputs) -> list[RequestOutputDelta]:
    """The step's RequestOutputDeltas, plain streams' columns turned into them as the API
    process does."""
    columns = step.streams
    if columns is None:
        return step.deltas
    plain = [RequestOutputDelta(rid, [CompletionOutput(0, text, ids, finish, stop)], finish is not None)
             for rid, text, ids, finish, stop in zip(columns.request_ids, columns.texts, columns.token_ids,
                                                     columns.finish_reasons, columns.stop_reasons)]
    return step.deltas + plain


def finished_ids(steps: list[StepOutputs]) -> set[str]:
    return {d.request_id for step in steps for d in deltas(step) if d.finished}


def force_deltas(monkeypatch) -> None:
    """Send requests whose id starts with "d-" as deltas, even plain streams."""
    add = EngineLoop._add

    def add_forcing_deltas(self, new):
        add(self, new)
        if new.request_id.startswith("d-"):
            self.active[new.request_id].plain_stream = False

    monkeypatch.setattr(EngineLoop, "_add", add_forcing_deltas)


def stop_kinds(expected: list[CompletionOutput]) -> dict[str, SamplingParams]:
    """A stop string (text held back), a stop token (its text dropped, or kept), the length limit."""
    text, tokens = expected[0].text, expected[0].token_ids
    return {
        "stop-string": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[text[len(text) // 2:][:2]]),
        "stop-token": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[tokens[3]]),
        "stop-token-kept": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[tokens[3]],
                                          include_stop_str_in_output=True),
        "length": GREEDY,
    }


def test_requests_carry_their_priority_to_the_scheduler(qwen3_ckpt):
    """Under scheduling_policy "priority", requests arriving together run lowest value first
    (one at a time here): each EngineRequest's priority reaches its sequences."""
    loop = LoopUnderTest(qwen3_ckpt, scheduling_policy="priority", max_num_seqs=1)
    try:
        loop.send([EngineRequest(name, PROMPTS[0], GREEDY, stream=False, priority=priority)
                   for name, priority in (("late", 3), ("first", -1), ("second", 2))])
        steps = loop.steps(lambda steps: len(finished_ids(steps)) == 3)
        order = [d.request_id for step in steps for d in deltas(step) if d.finished]
        assert order == ["first", "second", "late"]
    finally:
        loop.close()


def test_streamed_and_whole_outputs_equal_offline(qwen3_ckpt, expected):
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        with_logprobs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        loop.send([EngineRequest("s", PROMPTS[0], GREEDY, stream=True, arrival_time=1.0),
                   EngineRequest("w", PROMPTS[1], GREEDY, stream=False, arrival_time=1.0),
                   EngineRequest("l", PROMPTS[0], with_logprobs, stream=True, arrival_time=1.0)])
        steps = loop.steps(until=lambda steps: finished_ids(steps) == {"s", "w", "l"})
        # A plain stream (one completion, no logprobs) goes as columns, the others as deltas.
        assert {rid for step in steps if step.streams for rid in step.streams.request_ids} == {"s"}
        assert {d.request_id for step in steps for d in step.deltas} == {"w", "l"}
        for request_id in ("s", "l"):
            streamed = [d for step in steps for d in deltas(step) if d.request_id == request_id]
            assert len(streamed) > 1  # a piece per step
            assert "".join(out.text for d in streamed for out in d.outputs) == expected[0].text
            assert sum((out.token_ids for d in streamed for out in d.outputs), []) == expected[0].token_ids
            assert [out.finish_reason for d in streamed for out in d.outputs][-1] == "length"
        [whole] = [d for step in steps for d in step.deltas if d.request_id == "w"]
        assert whole.finished and whole.outputs[0].text == expected[1].text
        assert whole.outputs[0].finish_reason == "length"
        metrics = {m.num_prompt_tokens: m for step in steps for m in step.finished}
        assert sorted(m.num_prompt_tokens for step in steps for m in step.finished) == [3, 4, 4]
        assert all(m.num_generation_tokens == 6 for m in metrics.values())
        assert all(m.first_token_time <= m.finished_time for m in metrics.values())
        last = steps[-1].stats
        assert last["generation_tokens_total"] == 18 and last["prompt_tokens_total"] == 11
        assert last["num_requests_running"] == 0 and last["kv_blocks_used"] == 0
    finally:
        loop.close()


def test_plain_streams_as_columns_equal_deltas(qwen3_ckpt, expected, monkeypatch):
    """Each plain stream runs twice, once sent as columns and once forced into deltas: the
    same text, tokens and finish at every step, for a stop string (text held back), a stop
    token (its text dropped, or kept), and the length limit."""
    force_deltas(monkeypatch)
    kinds = stop_kinds(expected)
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        loop.send([EngineRequest(f"{copy}-{kind}", PROMPTS[0], params, stream=True)
                   for kind, params in kinds.items() for copy in ("c", "d")])
        ids = {f"{copy}-{kind}" for kind in kinds for copy in ("c", "d")}
        steps = loop.steps(until=lambda steps: finished_ids(steps) == ids)
        columns = {rid for step in steps if step.streams for rid in step.streams.request_ids}
        assert columns == {rid for rid in ids if rid.startswith("c-")}
        for kind in kinds:
            per_step = [[(out.text, out.token_ids, out.finish_reason, out.stop_reason)
                         for d in deltas(step) if d.request_id == f"{copy}-{kind}" for out in d.outputs]
                        for copy in ("c", "d") for step in steps]
            half = len(per_step) // 2
            assert per_step[:half] == per_step[half:], kind
    finally:
        loop.close()


def test_refusals_aborts_and_abort_all(qwen3_ckpt):
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        loop.send([EngineRequest("a", PROMPTS[0], long, stream=True), EngineRequest("a", PROMPTS[1], long, stream=True),
                   EngineRequest("big", [1] * 256, long, stream=True)])
        steps = loop.steps(until=lambda steps: any(s.errors for s in steps))
        assert sorted((rid, str(exc)) for s in steps for rid, exc in s.errors) == sorted([
            ("a", "request id 'a' is already running"),
            ("big", "prompt (256 tokens) leaves no room for output within max_model_len (256); "
                    "shorten it (or set truncate_prompt_tokens)")])
        # Aborting one request drops it: nothing more is sent for it, and its blocks are free.
        loop.send(AbortRequests(["a"]))
        loop.send([EngineRequest("b", PROMPTS[1], long, stream=True), EngineRequest("c", PROMPTS[0], long, stream=True)])
        # (The commands are applied in order: once b or c has output, a's abort has been.)
        steps = loop.steps(until=lambda steps: {"b", "c"} <= {d.request_id for s in steps for d in deltas(s)})
        first_new = next(i for i, s in enumerate(steps) if {"b", "c"} & {d.request_id for d in deltas(s)})
        later = [d.request_id for s in steps[first_new:] for d in deltas(s)]
        assert "a" not in later
        # ... but its metrics once, with finish_reason "abort": /metrics counts a client that left
        assert [metrics.finish_reasons for s in steps for metrics in s.finished] == [["abort"]]
        # Abort all: every running request is reported ended, with finish_reason "abort".
        loop.send(AbortRequests(None))
        steps = loop.steps(until=lambda steps: {"b", "c"} <= finished_ids(steps))
        ends = [out.finish_reason for s in steps for d in deltas(s) if d.finished for out in d.outputs]
        assert ends == ["abort", "abort"]
        assert steps[-1].stats["kv_blocks_used"] == 0 and steps[-1].stats["num_requests_running"] == 0
    finally:
        loop.close()


def test_a_message_still_being_written_holds_up_no_step(qwen3_ckpt, expected):
    """The API process's sender can stall halfway through a message (its thread waiting
    for the interpreter lock while a burst arrives): the loop steps the running requests
    meanwhile, and takes the message once it is whole."""
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        slow = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        loop.send([EngineRequest("running", PROMPTS[0], slow, stream=True)])
        loop.steps(until=lambda steps: any(deltas(s) for s in steps))
        payload = ForkingPickler.dumps([EngineRequest("late", PROMPTS[1], GREEDY, stream=False)])
        message = struct.pack("!i", len(payload)) + bytes(payload)
        os.write(loop.conn.fileno(), message[:len(message) // 2])
        steps = loop.steps(until=lambda steps: sum(1 for s in steps for d in deltas(s) if d.request_id == "running") >= 5)
        assert "late" not in {d.request_id for s in steps for d in deltas(s)}
        os.write(loop.conn.fileno(), message[len(message) // 2:])
        steps = loop.steps(until=lambda steps: {"running", "late"} <= finished_ids(steps))
        [late] = [d for s in steps for d in s.deltas if d.request_id == "late"]
        assert late.outputs[0].token_ids == expected[1].token_ids
    finally:
        loop.close()


def test_a_command_that_cannot_be_read_fails_the_engine_loudly(qwen3_ckpt):
    """A message that does not unpickle ends the loop with EngineFailed (the API process
    then fails every request) instead of leaving it deaf to every later command."""
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        payload = b"not a pickle"
        os.write(loop.conn.fileno(), struct.pack("!i", len(payload)) + payload)
        deadline = time.monotonic() + 30
        failed = []
        while not failed and time.monotonic() < deadline:
            assert loop.conn.poll(30), "the loop sent nothing for 30 s"
            failed = [m for m in loop.conn.recv() if isinstance(m, EngineFailed)]
        assert failed, "no EngineFailed"
        loop.thread.join(30)
        assert not loop.thread.is_alive()
    finally:
        loop.engine.shutdown()


def test_an_idle_loop_still_sends_a_heartbeat(qwen3_ckpt):
    """With nothing to do the loop sends empty StepOutputs every HEARTBEAT_INTERVAL_S: the
    API process's /health hears that the loop is alive, and /metrics stays current."""
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        start = time.monotonic()
        steps = loop.steps(until=lambda steps: len(steps) >= 2)
        assert time.monotonic() - start < 10 * HEARTBEAT_INTERVAL_S
        assert all(not deltas(s) and not s.errors and not s.finished for s in steps)
        assert steps[-1].stats["kv_blocks_used"] == 0 and "generation_tokens_total" in steps[-1].stats
    finally:
        loop.close()


def test_a_grammar_that_does_not_compile_is_refused_and_the_rest_run(qwen3_ckpt, expected):
    """Refused when make_request finds it compiled already, or after the step that finds it
    failed (take_failed): either way an error for that request, and the others run on."""
    pytest.importorskip("xgrammar")
    from nanovllm.sampling_params import StructuredOutputsParams

    loop = LoopUnderTest(qwen3_ckpt)
    try:
        bad = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(grammar='root ::= "a" | ('))
        loop.send([EngineRequest("bad", PROMPTS[0], bad, stream=False), EngineRequest("ok", PROMPTS[0], GREEDY, stream=False)])
        steps = loop.steps(until=lambda steps: "ok" in finished_ids(steps))
        [(request_id, error)] = [e for step in steps for e in step.errors]
        assert request_id == "bad" and str(error).startswith("the grammar cannot be compiled")
        assert "bad" not in {d.request_id for step in steps for d in step.deltas}
        [ok] = [d for step in steps for d in step.deltas if d.request_id == "ok"]
        assert ok.outputs[0].token_ids == expected[0].token_ids
        assert steps[-1].stats["kv_blocks_used"] == 0
    finally:
        loop.close()

def test_a_grammar_past_its_fill_budget_fails_its_request_or_ends_its_completion(qwen3_ckpt, expected, monkeypatch):
    """A grammar past its fill budget (here a nanosecond: every one) fails a server's
    request (GrammarOverran, no delta) or, where the request says so (data parallelism
    offline), ends its completion with "abort"; the others run on, and every block is freed."""
    pytest.importorskip("xgrammar")
    from nanovllm.engine.structured import GrammarOverran
    from nanovllm.sampling import logits_processors
    from nanovllm.sampling_params import StructuredOutputsParams

    monkeypatch.setattr(logits_processors, "FILL_BUDGET_S", 1e-9)
    constrained = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        loop.send([EngineRequest("fails", PROMPTS[1], constrained, stream=False),
                   EngineRequest("ends", PROMPTS[1], constrained, stream=False, overrun_fails=False),
                   EngineRequest("ok", PROMPTS[0], GREEDY, stream=False)])
        steps = loop.steps(until=lambda steps: {"ok", "ends"} <= finished_ids(steps) and any(s.errors for s in steps))
        [(request_id, error)] = [e for step in steps for e in step.errors]
        assert request_id == "fails" and isinstance(error, GrammarOverran) and "ambiguous grammar?" in str(error)
        by_id = {d.request_id: d for step in steps for d in step.deltas}
        assert "fails" not in by_id and by_id["ends"].outputs[0].finish_reason == "abort"
        assert by_id["ok"].outputs[0].token_ids == expected[0].token_ids
        assert loop.steps(until=lambda steps: steps and steps[-1].stats["kv_blocks_used"] == 0)
    finally:
        loop.close()


def test_a_completion_its_grammar_finished_is_not_failed_by_a_slow_last_accept(qwen3_ckpt, monkeypatch):
    """A token's accept past the budget ends the completion at its next token; where that
    token finished it already (its grammar complete), the request keeps its output."""
    pytest.importorskip("xgrammar")
    from nanovllm.engine import structured
    from nanovllm.sampling_params import StructuredOutputsParams

    accept = structured.SequenceGrammar.accept

    def slow_last(grammar, token_id):  # the accept that completes the grammar "took" a second
        accepted = accept(grammar, token_id)
        if grammar.is_terminated():
            grammar.overran = 1.0
        return accepted

    monkeypatch.setattr(structured.SequenceGrammar, "accept", slow_last)
    constrained = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        loop.send([EngineRequest("done", PROMPTS[1], constrained, stream=False)])
        steps = loop.steps(until=lambda steps: "done" in finished_ids(steps) or any(s.errors for s in steps))
        assert not any(step.errors for step in steps)
        [done] = [d for step in steps for d in step.deltas if d.request_id == "done"]
        assert done.outputs[0].finish_reason == "stop" and done.outputs[0].text in ("yes", "no")
    finally:
        loop.close()


def test_trace_summary_names_the_slowest_iterations_by_kind():
    trace = [LoopIteration(0.0005, 0.003, 0.0002, 12, False)] * 98 + [
        LoopIteration(0.002, 0.031, 0.001, 1036, True), LoopIteration(0.0004, 0.002, 0.0001, 0, False)]
    line = trace_summary(trace)
    assert line.startswith("last 100 iterations: decode steps (98) p50 3.0 / p99 3.0 / max 3.0 ms")
    assert "prefill steps (1) p50 31.0 / p99 31.0 / max 31.0 ms" in line  # an idle iteration (0 tokens) is neither
    assert line.split("slowest (requests/step/outputs ms, tokens, kind): ")[1].startswith("2.0/31.0/1.0 1036 prefill, ")


def test_streams_decoded_by_the_api_process_equal_deltas(qwen3_ckpt, expected, monkeypatch):
    """A plain stream without stop strings that the API process decodes (engine_decodes=False)
    gets tokens alone (text None); decoded there with StreamText, step by step, it equals
    the engine's own deltas, for a stop token (its text dropped, or kept) and the length
    limit. A stream with stop strings still gets its text from the engine."""
    force_deltas(monkeypatch)
    kinds = stop_kinds(expected)
    stop_string = kinds.pop("stop-string")
    loop = LoopUnderTest(qwen3_ckpt)
    try:
        loop.send([EngineRequest(f"{copy}-{kind}", PROMPTS[0], params, stream=True, engine_decodes=copy == "d")
                   for kind, params in kinds.items() for copy in ("a", "d")]
                  + [EngineRequest("a-stop-string", PROMPTS[0], stop_string, stream=True, engine_decodes=False)])
        ids = {f"{copy}-{kind}" for kind in kinds for copy in ("a", "d")} | {"a-stop-string"}
        steps = loop.steps(until=lambda steps: finished_ids(steps) == ids)
        decoders = {f"a-{kind}": StreamText(loop.engine.tokenizer, PROMPTS[0], True, params.include_stop_str_in_output)
                    for kind, params in kinds.items()}
        for kind in kinds:
            per_step = {"a": [], "d": []}
            for step in steps:
                step_deltas = deltas(step)
                for copy, outputs in per_step.items():
                    outputs.append([(out.text, out.token_ids, out.finish_reason, out.stop_reason)
                                    for d in step_deltas if d.request_id == f"{copy}-{kind}" for out in d.outputs])
                for i, (text, token_ids, finish, stop) in enumerate(per_step["a"][-1]):
                    assert text is None
                    text = decoders[f"a-{kind}"].add(token_ids, finish, stop)
                    per_step["a"][-1][i] = (text, token_ids, finish, stop)
            assert per_step["a"] == per_step["d"], kind
        stop_string_texts = [out.text for step in steps for d in deltas(step) if d.request_id == "a-stop-string"
                             for out in d.outputs]
        assert None not in stop_string_texts and "".join(stop_string_texts)
    finally:
        loop.close()


def test_the_engine_process_takes_the_api_process_tokenizer(qwen3_ckpt):
    """The API process's tokenizer, pickled, is the engine process's (it never imports
    AutoTokenizer); where it does not pickle or unpickle, the engine loads its own."""
    from nanovllm.config import Config
    from nanovllm.engine.model_files import load_tokenizer
    from nanovllm.serving.engine_process import _receive_tokenizer
    from nanovllm.serving.messages import EngineTokenizer

    theirs = load_tokenizer(Config.from_kwargs(str(qwen3_ckpt), **ENGINE_ARGS))
    ours, api = multiprocessing.Pipe()
    text = "def f(x):\n    return x  # 日本 <|im_end|>"
    api.send(EngineTokenizer(pickle.dumps(theirs)))
    engine = LLMEngine(str(qwen3_ckpt), tokenizer_source=lambda: _receive_tokenizer(ours), **ENGINE_ARGS)
    try:
        assert engine.tokenizer is not theirs and type(engine.tokenizer) is type(theirs)
        assert engine.tokenizer.encode(text) == theirs.encode(text)
        assert engine.tokenizer.chat_template == theirs.chat_template
        assert theirs.eos_token_id in engine.eos_token_ids
        assert engine.executor.runner.sampling.min_tokens.eos_token_ids == frozenset(engine.eos_token_ids)
        assert "tokenizer_s" in engine.startup_timings
    finally:
        engine.shutdown()
    for message in (EngineTokenizer(None), EngineTokenizer(b"not a pickle")):
        api.send(message)
        assert _receive_tokenizer(ours) is None  # LLMEngine then loads its own
    api.send(GREEDY)
    with pytest.raises(RuntimeError, match="not its tokenizer"):
        _receive_tokenizer(ours)


def test_the_engine_process_does_not_import_auto_tokenizer():
    """AutoTokenizer pulls in transformers' generation code: seconds of the engine
    process's start-up on a GPU machine's image, for a tokenizer it is sent."""
    code = ("import sys, nanovllm.serving.engine_process; "
            "print(sorted(m for m in sys.modules if m.endswith(('tokenization_auto', 'auto_factory'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]"


def test_offline_a_broken_tokenizer_fails_before_the_model_is_built(qwen3_ckpt, tmp_path, monkeypatch):
    from nanovllm.executor.executor import Executor

    model = tmp_path / "ckpt"
    shutil.copytree(qwen3_ckpt, model)
    (model / "tokenizer.json").write_text("{not json")

    def built(*_):
        raise AssertionError("the model was built before the tokenizer loaded")

    monkeypatch.setattr(Executor, "create", built)
    with pytest.raises(Exception) as failed:
        LLMEngine(str(model), **ENGINE_ARGS)
    assert not isinstance(failed.value, AssertionError), failed.value


def test_the_step_trace_has_a_line_per_step_and_survives_a_second_shutdown(qwen3_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_STEP_TRACE", str(tmp_path / "trace"))
    engine = LLMEngine(str(qwen3_ckpt), **ENGINE_ARGS)
    header_terms = (engine.executor.kv_bytes_per_token(), engine.executor.weights()[1], *engine.executor.experts()[1:])
    for prompt in PROMPTS:
        engine.add_request(engine.make_request(prompt, GREEDY))
    steps = 0
    while not engine.is_finished():
        steps += engine.step().num_tokens > 0
    engine.shutdown()
    engine.shutdown()
    header, *lines = (tmp_path / f"trace.{os.getpid()}").read_text().splitlines()
    words = header.split()
    assert words[0] == "#" and words[1::2] == ["kv_bytes_per_token", "weight_bytes", "expert_bytes", "expert_share"]
    assert tuple(float(value) for value in words[2::2]) == header_terms and header_terms[2:] == (0, 0.0)  # dense
    assert len(lines) == steps
    kinds = [line.split()[1] for line in lines]
    assert kinds[0] == "p" and kinds[-1] == "d"  # both prompts in the first step, then decodes
    assert [int(line.split()[4]) for line in lines[:1]] == [len(PROMPTS)]
    # The K/V tokens each step's attention reads: the prompts, then one more per sequence a step.
    contexts = [int(line.split()[6]) for line in lines]
    assert contexts[0] == sum(map(len, PROMPTS))
    assert contexts[1] == sum(map(len, PROMPTS)) + len(PROMPTS)


def test_an_moe_engines_trace_header_names_its_experts(qwen3_moe_ckpt, tmp_path, monkeypatch):
    """The floor of an MoE model's step reads only the experts its batch routes to: the
    header gives their bytes and the share of them a token routes to (8 experts, top 2)."""
    monkeypatch.setenv("NANOVLLM_STEP_TRACE", str(tmp_path / "trace"))
    engine = LLMEngine(str(qwen3_moe_ckpt), **ENGINE_ARGS)
    _, weight_bytes = engine.executor.weights()
    engine.shutdown()
    words = (tmp_path / f"trace.{os.getpid()}").read_text().split()
    terms = dict(zip(words[1::2], map(float, words[2::2])))
    assert 0 < terms["expert_bytes"] < weight_bytes == terms["weight_bytes"]
    assert terms["expert_share"] == 2 / 8
