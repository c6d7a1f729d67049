"""The hand-written stream events of serving.py against the pydantic models they stand in for."""
from __future__ import annotations

import json

import pytest

from nanovllm.entrypoints.openai.protocol import CompletionStreamResponse
from nanovllm.entrypoints.openai.responses import completion_choice
from nanovllm.entrypoints.openai.responses import completion_event_head, sse, text_completion_event
from nanovllm.outputs import CompletionOutput

TEXTS = ["", " hello", 'quote " backslash \\ slash /', "new\nline\ttab\r\x00\x1f\x7f", "héllo 你好 🙂",
         "\u2028\u2029", "\ufffd"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish_reason", "stop_reason"),
                         [(None, None), ("length", None), ("stop", 151645), ("stop", "</s>"), ("stop", "é\n")])
def test_text_completion_event_matches_pydantic(text, finish_reason, stop_reason):
    request_id, created, model = "cmpl-0123abcd", 1700000000, "Qwen/Qwen3-0.6B é"
    out = CompletionOutput(index=1, text=text, token_ids=[1, 2], finish_reason=finish_reason, stop_reason=stop_reason)
    expected = sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                            choices=[completion_choice(out, index=3)]))
    assert text_completion_event(completion_event_head(request_id, created, model), 3, out) == expected


@pytest.mark.parametrize(("prompt", "ok"), [
    ("text", True), ([1, 2, 3], True), (["a", "b"], True), ([[1, 2], [3]], True), ([], True),
    ([1, "a"], False), ([True, 2], False), ([1.5], False), ([[1], "a"], False), (7, False),
])
def test_completion_prompt_forms(prompt, ok):
    """The prompt's form is told from its value (faster for long token-id lists than
    pydantic's smart mode): every form parses to itself, strictly, and a mix is refused
    with its own form's error only."""
    from pydantic import ValidationError

    from nanovllm.entrypoints.openai.protocol import CompletionRequest

    if ok:
        parsed = CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt
        assert parsed == prompt and type(parsed) is type(prompt)
        assert all(type(a) is type(b) for a, b in zip(parsed, prompt)) if isinstance(prompt, list) else True
    else:
        with pytest.raises(ValidationError) as refused:
            CompletionRequest.model_validate({"model": "m", "prompt": prompt})
        [error] = refused.value.errors()  # one: the form's that the value is meant as
        assert error["loc"][0] == "prompt"


def test_a_queued_grammar_is_never_compiled_once_its_client_left():
    """A schema waiting behind another's compile is dropped when its client disconnects
    (OpenAIServing._compile answers False), so it holds up nobody after it; a client still
    there gets its compile."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from nanovllm.entrypoints.openai.serving import OpenAIServing

    compiled, gate = [], threading.Event()

    def check(schema):
        compiled.append(schema)
        gate.wait(10)

    class Client:
        def __init__(self, gone: bool):
            self.gone = gone

        async def receive(self):
            if not self.gone:
                await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

    serving = object.__new__(OpenAIServing)  # only what _compile reads
    serving.engine = SimpleNamespace(check_structured_outputs=check)
    serving.grammar_pool = ThreadPoolExecutor(max_workers=1)

    async def run():
        first = asyncio.ensure_future(serving._compile("slow", Client(gone=False)))
        while not compiled:  # the slow compile holds the thread
            await asyncio.sleep(0.01)
        left = await serving._compile("queued", Client(gone=True))
        gate.set()
        return left, await first, await serving._compile("after", None)

    assert asyncio.run(run()) == (False, True, True)
    serving.grammar_pool.shutdown(wait=True)
    assert compiled == ["slow", "after"]


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event():
    """A bug of ours while a stream runs (here, building its chunks) reaches the client as an
    error event and [DONE], not as a connection cut short; the engine's stream is closed."""
    import asyncio
    from types import SimpleNamespace

    from nanovllm.entrypoints.openai.serving import OpenAIServing

    closed = []

    async def generate(requests, stream):
        try:
            yield ["delta"]
            yield ["delta"]
        finally:
            closed.append(True)

    def chunks(deltas):
        raise RecursionError("a parser's depth")

    serving = object.__new__(OpenAIServing)  # only what stream_events reads
    serving.engine = SimpleNamespace(generate=generate)

    async def run():
        events = [event async for event in serving.stream_events([], chunks, None)]
        await asyncio.sleep(0)  # the engine stream's finalizer
        return events

    events = asyncio.run(run())
    assert len(events) == 2 and events[-1].strip() == "data: [DONE]"
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "internal server error" in error["message"] and closed == [True]


def test_a_large_response_is_written_off_the_event_loop(monkeypatch):
    """A whole response carrying LARGE_RESPONSE_ENTRIES logprob entries or more (here prompt
    logprobs of several choices) is written as JSON by a worker thread, a choice at a time;
    a smaller one on the loop; both hold what pydantic writes."""
    import asyncio

    from nanovllm.entrypoints.openai import responses
    from nanovllm.entrypoints.openai.protocol import CompletionResponse, UsageInfo
    from nanovllm.outputs import Logprob

    def response(prompt_tokens: int) -> CompletionResponse:
        entries = [None] + [{7: Logprob(-0.5, 1, "a"), 8: Logprob(-1.5, 2, "b")}] * (prompt_tokens - 1)
        choices = [completion_choice(CompletionOutput(i, "x", [7], finish_reason="length"), i,
                                     prompt_logprobs=entries) for i in range(2)]
        return CompletionResponse(id="cmpl-1", model="m", choices=choices,
                                  usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=2,
                                                  total_tokens=prompt_tokens + 2))

    threads = []

    async def to_thread(function, *args):
        threads.append(function)
        return function(*args)

    monkeypatch.setattr(responses.asyncio, "to_thread", to_thread)
    small, large = response(16), response(responses.LARGE_RESPONSE_ENTRIES // 4 + 1)
    assert responses.logprob_entries(small) == 2 * 15 * 2
    assert responses.logprob_entries(large) >= responses.LARGE_RESPONSE_ENTRIES
    assert asyncio.run(responses.json_body(small)) == small.model_dump_json() and not threads
    assert json.loads(asyncio.run(responses.json_body(large))) == json.loads(large.model_dump_json())
    assert len(threads) == 1


def test_a_long_prompt_holds_up_only_the_long_prompts_lane(qwen3_ckpt):
    """Texts of LONG_TEXT_CHARS or more are tokenized in a second thread with a tokenizer of
    its own: while that thread is busy (held here, as a multi-megabyte prompt would hold
    it), a short prompt is still made into a request; the long one then gets the tokens the
    engine's own tokenizer gives."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from nanovllm import SamplingParams
    from nanovllm.engine.request import RequestChecker
    from nanovllm.entrypoints.openai.chat import ChatRenderer
    from nanovllm.entrypoints.openai.lanes import LONG_TEXT_CHARS, make_lanes
    from nanovllm.entrypoints.openai.serving import OpenAIServing

    tokenizer = AutoTokenizer.from_pretrained(qwen3_ckpt)
    checker = RequestChecker(tokenizer, len(tokenizer), max_model_len=512, block_size=16, num_blocks=64,
                             max_logprobs=20)
    serving = object.__new__(OpenAIServing)  # only what make_requests reads
    serving.lanes = make_lanes(checker, ChatRenderer(tokenizer, False))
    short, long = serving.lanes
    assert long.tokenizer is not short.tokenizer and long.pool is not short.pool
    assert long.chat.tokenizer is long.tokenizer and long.checker.tokenizer is long.tokenizer
    serving.engine = SimpleNamespace(make_request=lambda prompt, params, stream, request_id, checker, priority,
                                     copy_params: checker.check(prompt, params)[0])
    text = "The scheduler admits what fits. " * (LONG_TEXT_CHARS // 16)
    params = SamplingParams(max_tokens=4, truncate_prompt_tokens=100)
    gate = threading.Event()

    async def run():
        held = long.pool.submit(gate.wait, 10)
        request = SimpleNamespace(stream=False, priority=0)
        made_short = await serving.make_requests(request, ["short prompt"], params, "a")
        pending = asyncio.ensure_future(serving.make_requests(request, [text], params, "b"))
        await asyncio.sleep(0.05)
        waited = not pending.done()
        gate.set()
        held.result()
        return made_short, waited, await pending

    made_short, waited, [made_long] = asyncio.run(run())  # each a request's token ids here
    assert made_short == [tokenizer.encode("short prompt")] and waited
    assert made_long == tokenizer.encode(text)[-100:]
    for lane in serving.lanes:
        lane.pool.shutdown(wait=True)


def test_unknown_keys_inside_stream_options_and_response_format_are_named():
    """A typo inside a nested object is as silent a change as one at the top: the server logs
    those it ignores with their paths (vLLM warns of every ignored field)."""
    from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stream": True, "typo": 1,
                                                "stream_options": {"include_usuage": True}})
    assert request.ignored_fields() == ["stream_options.include_usuage", "typo"]
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "schema": {"type": "integer"},
                            "json_schema": {"name": "n", "schema": {"type": "integer"}, "strictly": True}}})
    assert chat.ignored_fields() == ["response_format.json_schema.strictly", "response_format.schema"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).ignored_fields() == []
