"""Tool calling and reasoning through the server, with the official openai client: a
server started with --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3 on a tiny Qwen3 whose template renders tools and thinking (and,
for vLLM's other options on the same server, --max-logprobs -1 --scheduling-policy priority).

The model's weights are random, so what it says is forced where a test needs a call:
tool_choice required and named constrain decoding themselves; for "auto", a grammar
(structured_outputs) makes it write a Hermes <tool_call> block that the parser reads."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from server_helpers import API_KEY, MODEL_NAME, assert_idle, openai_client, post, start_server

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {
    "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# A Hermes call of get_weather, whatever the model would rather say.
HERMES_GRAMMAR = ('root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" city '
                  '"\\", \\"days\\": " [1-7] "}}\\n</tool_call>"\ncity ::= "Paris" | "Oslo" | "Lima"')


@pytest.fixture(scope="module")
def server(qwen3_tools_ckpt, tmp_path_factory):
    srv = start_server(qwen3_tools_ckpt, tmp_path_factory.mktemp("tools") / "server.log", "--api-key", API_KEY,
                       "--served-model-name", MODEL_NAME, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--reasoning-parser", "qwen3", "--max-logprobs", "-1", "--scheduling-policy", "priority")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat(client, stream: bool = False, **kwargs):
    body = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80) | kwargs
    return client.chat.completions.create(stream=stream, **body)


def streamed_calls(stream) -> tuple[list[dict], str | None, str, str]:
    """The calls a stream's tool_call pieces join into, its finish reason, and its
    content and reasoning."""
    calls: dict[int, dict] = {}
    finish, content, reasoning = None, "", ""
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning", None) or ""
            assert getattr(delta, "reasoning_content", None) == getattr(delta, "reasoning", None)  # its older name
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or piece.id
                call["name"] = call["name"] or piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content, reasoning


def as_calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]


def same_calls(a: list[dict], b: list[dict]) -> bool:
    """Equal but for the ids, which are fresh per response (and unique within one)."""
    return ([(c["name"], c["arguments"]) for c in a] == [(c["name"], c["arguments"]) for c in b]
            and len({c["id"] for c in a}) == len(a))


def test_named_function_is_called_with_valid_arguments_stream_and_not(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = chat(client, tool_choice=choice, extra_body=NO_THINKING).choices[0]
    assert whole.finish_reason == "stop" and whole.message.content is None  # OpenAI's finish for a named function
    [call] = as_calls(whole.message)
    assert call["name"] == "get_time" and call["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call["arguments"]), TIME)
    calls, finish, content, _ = streamed_calls(chat(client, True, tool_choice=choice, extra_body=NO_THINKING))
    assert same_calls(calls, [call]) and finish == "stop" and content == ""


def test_required_calls_validate_against_their_tools_stream_and_not(client):
    """A random model never ends its array of calls (it repeats one): parallel_tool_calls
    false bounds it at one call; otherwise max_tokens cuts it, and the calls it completed
    are returned."""
    for parallel, finish in ((False, "tool_calls"), (True, "length")):
        body = dict(tool_choice="required", max_tokens=100, parallel_tool_calls=parallel, extra_body=NO_THINKING)
        whole = chat(client, **body).choices[0]
        assert whole.finish_reason == finish and whole.message.content is None
        calls = as_calls(whole.message)
        assert len(calls) == 1 if not parallel else len(calls) > 1
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        streamed, streamed_finish, content, _ = streamed_calls(chat(client, True, **body))
        assert same_calls(streamed, calls) and streamed_finish == finish and content == ""


def test_auto_reads_hermes_calls_stream_and_not(client):
    body = dict(tool_choice="auto", extra_body={**NO_THINKING, "structured_outputs": {"grammar": HERMES_GRAMMAR}})
    whole = chat(client, **body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = as_calls(whole.message)
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    streamed, finish, content, _ = streamed_calls(chat(client, True, **body))
    assert same_calls(streamed, [call]) and finish == "tool_calls" and content == ""
    plain = chat(client, tool_choice="auto", max_tokens=8, extra_body=NO_THINKING).choices[0]  # no call: text
    assert plain.message.tool_calls == [] and plain.message.content and plain.finish_reason == "length"


def test_a_conversation_with_a_tool_result(server, client):
    call = {"id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call-1", "content": "light snow, -3 C"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=6, temperature=0, extra_body=NO_THINKING)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls == []
    rendered = post(server, "/tokenize", {"model": MODEL_NAME, "messages": history, "tools": TOOLS,
                                          "chat_template_kwargs": NO_THINKING["chat_template_kwargs"]}).json()
    assert rendered["count"] == reply.usage.prompt_tokens
    text = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": rendered["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in text
    assert "<tool_response>\nlight snow, -3 C\n</tool_response>" in text and '"name": "get_time"' in text


def test_reasoning_stream_and_not(client):
    """With thinking on, the template opens <think>: what the model writes is reasoning
    (it never closes it in these few tokens), under vLLM's name and its older one,
    reasoning_content; with it off, content. A response_format does not apply to the
    reasoning: the same reasoning with it."""
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    body = dict(model=MODEL_NAME, messages=ASK, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**body, extra_body=thinking).choices[0]
    assert whole.message.content is None and whole.message.reasoning
    assert whole.message.reasoning_content == whole.message.reasoning
    _, finish, content, reasoning = streamed_calls(client.chat.completions.create(**body, stream=True, extra_body=thinking))
    assert reasoning == whole.message.reasoning and content == "" and finish == "length"
    constrained = client.chat.completions.create(**body, extra_body=thinking, response_format={"type": "json_object"})
    assert constrained.choices[0].message.reasoning == whole.message.reasoning
    off = client.chat.completions.create(**body, extra_body=NO_THINKING).choices[0]
    assert off.message.reasoning is None and off.message.content


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_moon"}}}, "tool_choice", "not in tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
    ({"tools": [{"type": "function"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, "tools", "name"),
])
def test_bad_tool_requests_get_400(server, body, param, message):
    response = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert_idle(server)


def test_without_the_server_flags_auto_is_refused(qwen3_tools_ckpt, tmp_path):
    srv = start_server(qwen3_tools_ckpt, tmp_path / "server.log", "--served-model-name", MODEL_NAME)
    try:
        client = openai_client(srv, api_key="none")
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="auto")
        reply = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=4)
        assert reply.choices[0].message.tool_calls == []  # tool_choice defaults to none there
        assert httpx.get(srv.base_url + "/health").status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_whole_vocabulary_logprobs_and_priorities(client, server, stream):
    """top_logprobs -1 (vLLM's) gives every token's logprob, streamed or not, on an engine
    with max_logprobs -1; a request's priority reaches a priority-scheduling engine (and
    a null one is unset), an integer's only."""
    vocab = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
                      ).json()["data"][0]["vocab_size"]
    body = dict(model=MODEL_NAME, messages=ASK, max_tokens=2, temperature=0, logprobs=True, top_logprobs=-1,
                extra_body={"priority": -2, **NO_THINKING})
    if stream:
        entries = [entry for chunk in client.chat.completions.create(stream=True, **body)
                   for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    else:
        entries = client.chat.completions.create(**body).choices[0].logprobs.content
    assert len(entries) == 2 and all(len(entry.top_logprobs) == vocab for entry in entries)
    assert all(entry.top_logprobs[0].logprob == entry.logprob for entry in entries)  # greedy: the likeliest
    assert post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1,
                                            "priority": None}).status_code == 200
    error = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "priority": "high"}).json()["error"]
    assert error["param"] == "priority"
