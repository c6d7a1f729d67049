"""The OpenAI-compatible server, run as a user would (`python -m nanovllm serve` in a
subprocess, on a loopback port it picks) and driven by the official `openai` client.

Greedy outputs are compared with offline LLM.generate on the same checkpoint and engine
arguments: the server must give the same text, tokens and finish reasons.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

import nanovllm

from nanovllm import LLM, BeamSearchParams, SamplingParams
from nanovllm.testing.checkpoints import make_tiny_checkpoint
from nanovllm.testing.server import ServerProcess, process_gone
from server_helpers import (
    API_KEY, ENGINE_ARGS, LONG_MAX_TOKENS, MODEL_NAME, SERVER_ENV, STARTUP_TIMEOUT_S, assert_idle, cli_flags,
    engine_pid, openai_client, post, read_metrics, start_server,
)

@pytest.fixture(scope="module")
def server(qwen3_ckpt, tmp_path_factory):
    srv = start_server(qwen3_ckpt, tmp_path_factory.mktemp("server") / "server.log",
                       "--api-key", API_KEY, "--served-model-name", MODEL_NAME)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(qwen3_ckpt):
    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def chat_prompt(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


# -- happy paths --------------------------------------------------------------------------


def test_models_health_and_metrics(server, client):
    [model] = client.models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "nanovllm"
    assert httpx.get(server.base_url + "/health").status_code == 200
    metrics = read_metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert "nanovllm:" + name in metrics, name
    assert 0 <= metrics["nanovllm:prefix_cache_hits_total"] <= metrics["nanovllm:prefix_cache_queries_total"]
    phases = {key: value for key, value in metrics.items() if key.startswith("nanovllm:startup_seconds")}
    for phase in ("engine", "load_weights", "sampler_warm_up", "process", "server_ready"):  # on CUDA also compile_warmup...
        assert f'nanovllm:startup_seconds{{phase="{phase}"}}' in phases, phases
    assert all(value >= 0 for value in phases.values())
    phase = {key.split('"')[1]: value for key, value in phases.items()}
    assert phase["engine"] >= phase["load_weights"]
    # The engine process started after this one and was built before this one served.
    assert 0 < phase["process"] and phase["process"] + phase["engine"] < phase["server_ready"]


def test_completion_equals_offline_for_strings_and_token_ids(client, offline):
    prompts = ["The quick brown fox", "def add(a, b):"]
    token_prompt = offline.tokenizer.encode("Hello world! How are you")
    params = greedy(12, ignore_eos=True)
    expected = offline.generate(prompts + [token_prompt], params, use_tqdm=False)
    response = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1]
    for choice, ref in zip(response.choices, expected):
        assert choice.text == ref.outputs[0].text and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in expected[:2])
    assert response.usage.completion_tokens == 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24

    [choice] = client.completions.create(model=MODEL_NAME, prompt=token_prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices
    assert choice.text == expected[2].outputs[0].text


def test_completion_fields_sent_as_null_take_their_defaults(server):
    """As vLLM's /v1/completions: max_tokens left out or null is OpenAI's 16, for sampling
    and for beam search; null stream, echo, n and stop are left out too."""
    body = {"model": MODEL_NAME, "prompt": [7, 8, 9], "temperature": 0, "ignore_eos": True}
    nulls = {"max_tokens": None, "stream": None, "echo": None, "n": None, "stop": None, "logprobs": None}
    for extra in ({}, nulls, {**nulls, "use_beam_search": True, "n": 2}):
        response = post(server, "/v1/completions", {**body, **extra}).json()
        choices = extra.get("n") or 1
        assert [c["finish_reason"] for c in response["choices"]] == ["length"] * choices
        assert response["usage"]["completion_tokens"] == 16 * choices
        assert all(c["logprobs"] is None for c in response["choices"])


def test_chat_fields_sent_as_null_and_top_logprobs_0_without_logprobs(server):
    """Chat's null fields take their defaults too; top_logprobs 0 without logprobs asks
    for nothing (vLLM refuses only a positive one)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi", "name": None}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    for extra in ({"stream": None, "logprobs": None, "n": None, "stop": None, "tools": None}, {"top_logprobs": 0}):
        response = post(server, "/v1/chat/completions", {**body, **extra})
        assert response.status_code == 200, response.text
        [choice] = response.json()["choices"]
        assert choice["logprobs"] is None and response.json()["usage"]["completion_tokens"] == 3


def test_completion_stop_string_and_logprobs(client, offline):
    prompt = "Once upon a time there was"
    full = offline.generate(prompt, greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]  # a string the greedy output is known to contain
    [ref] = offline.generate(prompt, greedy(16, ignore_eos=True, stop=[stop]), use_tqdm=False)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                         logprobs=2, extra_body={"ignore_eos": True})
    [choice] = response.choices
    assert choice.text == ref.outputs[0].text and stop not in choice.text
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        # the chosen token and the 2 most likely (fewer keys when texts coincide, e.g. partial UTF-8 bytes)
        assert top[token] == logprob <= 0 and 1 <= len(top) <= 3


def test_completion_stream_equals_non_stream_with_usage(client):
    kwargs = dict(model=MODEL_NAME, prompt="Paged attention stores the cache", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1]) and all(c.usage is None for c in content)
    assert last.choices == [] and last.usage == whole.usage


def test_chat_equals_offline_stream_and_not(client, offline):
    messages = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "def softmax(x):"}]
    [ref] = offline.generate([chat_prompt(offline, messages)], greedy(16), use_tqdm=False)
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert response.usage.completion_tokens == len(ref.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage == response.usage


def assert_prompt_logprobs_body(body: list, expected: list) -> None:
    """vLLM's prompt_logprobs as JSON (token ids as string keys) against offline's."""
    assert body[0] is None and expected[0] is None and len(body) == len(expected)
    for got, ref in zip(body[1:], expected[1:]):
        assert {int(t): (lp["logprob"], lp["rank"], lp["decoded_token"]) for t, lp in got.items()} == \
            {t: (pytest.approx(lp.logprob, abs=1e-5), lp.rank, lp.decoded_token) for t, lp in ref.items()}


def test_beam_search_equals_offline(server, client, offline):
    """vLLM's use_beam_search: n beams a prompt, best first, as LLM.beam_search finds them
    (the choices' texts are the beams' own tokens)."""
    prompts = ["The weather in Oslo", "Paged attention stores the cache"]
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    expected = offline.beam_search(prompts, params)
    response = client.completions.create(model=MODEL_NAME, prompt=prompts[1], max_tokens=5, n=3,
                                         extra_body={"use_beam_search": True, "ignore_eos": True})
    beams = expected[1].sequences
    assert [c.text for c in response.choices] == [offline.tokenizer.decode(b.tokens[-5:]) for b in beams]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert {c.finish_reason for c in response.choices} == {"length"}
    assert response.usage.completion_tokens == 15 and response.usage.prompt_tokens == len(beams[0].tokens) - 5
    # Sampling fields at the values that change nothing are let through (a 400 for others),
    # and a seed at temperature 0, or -1 (no seed) at any.
    assert post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "n": 2,
                                            "use_beam_search": True, "temperature": 0.5, "seed": -1}).status_code == 200
    both = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, n=3, top_p=1.0, seed=3,
                                     presence_penalty=0.0, extra_body={"use_beam_search": True, "ignore_eos": True,
                                                                       "top_k": -1, "repetition_penalty": 1.0})
    assert [c.text for c in both.choices] == [offline.tokenizer.decode(b.tokens[-5:])
                                              for result in expected for b in result.sequences]
    conversation = [{"role": "user", "content": "Tell me about paged attention"}]
    ids = post(server, "/tokenize", {"model": MODEL_NAME, "messages": conversation}).json()["tokens"]
    [chat_expected] = offline.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=conversation, max_tokens=4, n=2,
                                          extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.message.content for c in chat.choices] == [offline.tokenizer.decode(b.tokens[-4:])
                                                         for b in chat_expected.sequences]
    assert all(c.message.role == "assistant" for c in chat.choices)

    # Streamed, as vLLM streams beams: each choice whole once the search ends, usage where asked.
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompts[1], max_tokens=5, n=3, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"use_beam_search": True, "ignore_eos": True}))
    assert [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks[:-1]] == \
        [(c.index, c.text, c.finish_reason) for c in response.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == response.usage
    streamed = list(client.chat.completions.create(
        model=MODEL_NAME, messages=conversation, max_tokens=4, n=2, stream=True,
        extra_body={"use_beam_search": True, "ignore_eos": True}))
    texts = ["", ""]
    for piece in streamed:
        [choice] = piece.choices
        texts[choice.index] += choice.delta.content
        assert choice.delta.role in (None, "assistant")
    assert texts == [c.message.content for c in chat.choices]
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == ["length", "length"]


def test_prompt_logprobs_and_echo_equal_offline(client, offline):
    """vLLM's prompt_logprobs on both endpoints; completions' echo of the prompt's text, and
    with logprobs of its tokens' logprobs before the completion's (the scoring that
    evaluation harnesses ask for), streamed too."""
    prompt = "Paged attention stores the cache"
    [ref] = offline.generate(prompt, greedy(4, prompt_logprobs=2, logprobs=1), use_tqdm=False)
    ids, completion = ref.prompt_token_ids, ref.outputs[0]
    response = client.completions.create(model=MODEL_NAME, prompt=[prompt, prompt], max_tokens=4, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    for choice in response.choices:
        assert choice.text == completion.text and choice.logprobs is None
        assert_prompt_logprobs_body(choice.model_extra["prompt_logprobs"], ref.prompt_logprobs)

    [echoed] = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                         logprobs=1).choices
    assert echoed.text == prompt + completion.text
    logprobs = echoed.logprobs
    assert len(logprobs.tokens) == len(ids) + len(completion.token_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[0] == offline.tokenizer.decode(ids[:1])
    entries = ref.prompt_logprobs[1:] + completion.logprobs
    for token_id, entry, text, logprob, top in zip(ids[1:] + completion.token_ids, entries, logprobs.tokens[1:],
                                                  logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert text == entry[token_id].decoded_token and logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert 1 <= len(top) <= 2 and top[text] == logprob
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[len(ids)] == len(prompt)
    assert echoed.model_extra["prompt_logprobs"] is not None  # echo's logprobs came as prompt logprobs

    # max_tokens 0 (a loglikelihood scorer's call): the prompt and its logprobs alone, streamed or not
    [scored] = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1).choices
    assert scored.text == prompt and scored.logprobs.tokens == logprobs.tokens[:len(ids)]
    assert scored.logprobs.token_logprobs == logprobs.token_logprobs[:len(ids)] and scored.finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)

    [plain] = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, echo=True).choices
    assert plain.text == offline.tokenizer.decode(ids) + completion.text and plain.logprobs is None
    for logprobs in (None, 1):
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                                echo=True, logprobs=logprobs, stream=True))
        assert chunks[0].choices[0].text.startswith(prompt)
        assert "".join(c.choices[0].text for c in chunks) == prompt + completion.text
        if logprobs:
            tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
            assert len(tokens) == len(ids) + len(completion.token_ids)

    # Several prompts, n = 2, streamed: each choice's pieces join into the whole response's
    # choice, text offsets included, which never go back (a prompt whose characters span tokens).
    prompts = [prompt, "Paged 日本語 cache ü"]
    kwargs = dict(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=2, echo=True,
                  logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    pieces: dict[int, dict[str, list]] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            into = pieces.setdefault(choice.index, dict(text=[], tokens=[], text_offset=[]))
            into["text"].append(choice.text)
            into["tokens"] += choice.logprobs.tokens
            into["text_offset"] += choice.logprobs.text_offset
    assert sorted(pieces) == [0, 1, 2, 3]
    for choice in whole.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
        assert "".join(pieces[choice.index]["text"]) == choice.text
        assert pieces[choice.index]["tokens"] == choice.logprobs.tokens
        assert pieces[choice.index]["text_offset"] == choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)

    messages = [{"role": "user", "content": "Hello"}]
    [chat_ref] = offline.generate([chat_prompt(offline, messages)], greedy(3, prompt_logprobs=0), use_tqdm=False)
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
                                              extra_body={"prompt_logprobs": 0})
    assert response.choices[0].message.content == chat_ref.outputs[0].text
    assert_prompt_logprobs_body(response.model_extra["prompt_logprobs"], chat_ref.prompt_logprobs)


def test_chat_n_seed_and_top_logprobs(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=1.0,
                  n=2, seed=7, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    first, again = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 16
    for choice in first.choices:
        assert len(choice.logprobs.content) == 8
        for entry in choice.logprobs.content:
            ranked = [alt.logprob for alt in entry.top_logprobs]
            assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True) and entry.logprob <= ranked[0]


def test_32_concurrent_streams_equal_offline(server, offline):
    words = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Numbers: 0 1 2", "for step in range(10):",
             "A language model reads", "Hello world!", "class BlockManager:"]
    prompts = [f"{words[i % len(words)]} {i}" for i in range(32)]
    max_tokens = [8 + 4 * (i % 5) for i in range(32)]
    expected = offline.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str, limit: int) -> tuple[str, str, int]:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=limit, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, max_tokens)))

    results = asyncio.run(run_all())
    for (text, finish, tokens), ref in zip(results, expected):
        out = ref.outputs[0]
        assert (text, finish, tokens) == (out.text, out.finish_reason, len(out.token_ids))
    assert_idle(server)


def test_client_disconnect_frees_kv_blocks(server, client):
    stream = client.completions.create(model=MODEL_NAME, prompt="The scheduler decides", max_tokens=LONG_MAX_TOKENS,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    metrics = read_metrics(server)
    assert metrics["nanovllm:num_requests_running"] == 1 and metrics["nanovllm:kv_cache_blocks_used"] > 0
    stream.close()
    assert_idle(server)
    [choice] = client.completions.create(model=MODEL_NAME, prompt="still serving", max_tokens=2).choices
    assert choice.finish_reason in ("stop", "length")


def test_bounded_load_with_cancellations_and_the_largest_n(server):
    """256 concurrent streams, 30% of them cancelled mid-stream, and one request with the
    largest n the server allows (128), at once. Afterwards nothing runs or waits and every
    KV block is back; every stream that was not cancelled got all its tokens, each within
    LOAD_LATENCY_BOUND_S (generous: two CI cores run the test, the server and its engine)."""

    async def run() -> tuple[int, list[float | None]]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def stream(i: int) -> float | None:
            start = time.monotonic()
            chunks = await client.completions.create(model=MODEL_NAME, prompt=f"Request {i}:", max_tokens=12,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in chunks:
                # These leave mid-stream, at their first text. A slow reader may get its deltas
                # coalesced, all of them in the last chunk: that stream simply finishes.
                if i % 10 < 3 and chunk.choices[0].text and chunk.choices[0].finish_reason is None:
                    await chunks.close()
                    return None
            assert chunk.choices[0].finish_reason == "length"
            return time.monotonic() - start

        async def fan_out() -> int:
            answer = await client.completions.create(model=MODEL_NAME, prompt="Fan out", n=128, max_tokens=4,
                                                     extra_body={"ignore_eos": True})
            return sum(choice.finish_reason == "length" for choice in answer.choices)

        fanned, *latencies = await asyncio.gather(fan_out(), *(stream(i) for i in range(256)))
        await client.close()
        return fanned, latencies

    fanned, latencies = asyncio.run(run())
    finished = [t for t in latencies if t is not None]
    assert fanned == 128 and all(t is not None for i, t in enumerate(latencies) if i % 10 >= 3)
    assert len(latencies) - len(finished) > sum(i % 10 < 3 for i in range(256)) // 2  # most did leave
    assert max(finished) < LOAD_LATENCY_BOUND_S, max(finished)
    assert_idle(server)


LOAD_LATENCY_BOUND_S = 120.0


def test_tokenize_detokenize_version_and_one_model(server, offline):
    """vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize
    round trip; /version; /v1/models/{model}. They need the API key like /v1/*."""
    text = "The quick brown fox"
    tokens = post(server, "/tokenize", {"prompt": text}).json()
    assert tokens["tokens"] == offline.tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == offline.config.max_model_len and tokens["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/tokenize", {"messages": messages, "return_token_strs": True}).json()
    assert chat["tokens"] == chat_prompt(offline, messages)
    assert chat["token_strs"] == offline.tokenizer.convert_ids_to_tokens(chat["tokens"])
    assert post(server, "/detokenize", {"tokens": [10**7]}).status_code == 400
    # Any length, as vLLM's: a client counts a document's tokens against max_model_len.
    long_text = "The quick brown fox. " * 5000  # 105,000 characters: the long texts' tokenizer thread
    long = post(server, "/tokenize", {"prompt": long_text}).json()
    assert long["tokens"] == offline.tokenizer.encode(long_text) and long["count"] > offline.config.max_model_len
    assert post(server, "/detokenize", {"tokens": long["tokens"]}).json() == {"prompt": long_text}
    assert post(server, "/tokenize", {"prompt": text}, api_key=None).status_code == 401
    assert post(server, "/tokenize", {"prompt": text, "messages": None}).json()["tokens"] == tokens["tokens"]
    both = post(server, "/tokenize", {"prompt": text, "messages": messages})  # which would it count?
    assert both.status_code == 400 and "one of `prompt`" in both.json()["error"]["message"]
    # A bad body's errors are its own form's only (not the other form's missing field).
    for body, param, other in [({"prompt": text, "add_special_tokens": "yes"}, "add_special_tokens", "messages"),
                               ({"messages": messages, "tools": [{"type": "function"}]}, "tools", "prompt")]:
        error = post(server, "/tokenize", body).json()["error"]
        assert error["param"] == param and param in error["message"] and other not in error["message"], error
    assert httpx.get(server.base_url + "/version").json() == {"version": nanovllm.__version__}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    card = httpx.get(f"{server.base_url}/v1/models/{MODEL_NAME}", headers=headers).json()
    assert card["id"] == MODEL_NAME and card["max_model_len"] == offline.config.max_model_len
    assert card["vocab_size"] == offline.config.hf_config.vocab_size
    assert httpx.get(f"{server.base_url}/v1/models/other", headers=headers).status_code == 404
    long = httpx.get(f"{server.base_url}/v1/models/{'m' * 5000}", headers=headers)
    assert long.status_code == 404 and len(long.text) < 500


def test_finish_reasons_and_preemptions_are_counted(server, client):
    before = read_metrics(server)
    client.completions.create(model=MODEL_NAME, prompt="Count me", max_tokens=3, n=2, extra_body={"ignore_eos": True})
    after = read_metrics(server)
    assert after['nanovllm:request_success_total{finished_reason="length"}'] == \
        before.get('nanovllm:request_success_total{finished_reason="length"}', 0) + 2
    assert "nanovllm:num_preemptions_total" in after


# -- errors -------------------------------------------------------------------------------


COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/v1/completions", b'{"prompt": "Hello", "max_tokens": ', 400, None, "JSON"),
        ("/v1/completions", b'["a list"]', 400, None, "object"),
        ("/v1/completions", {"model": MODEL_NAME, "max_tokens": 4}, 400, "prompt", "required"),
        ("/v1/completions", {**COMPLETION, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
        ("/v1/completions", {**COMPLETION, "stream": "yes"}, 400, "stream", "boolean"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens",
         "max_tokens must be an integer >= 1 (0 with echo"),  # null is 16 here, not the context's end
        ("/v1/completions", {**COMPLETION, "max_tokens": -3}, 400, "max_tokens", "max_tokens"),
        ("/v1/completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature", "temperature"),
        ("/v1/completions", {**COMPLETION, "prompt": [7] * 600}, 400, "prompt", "max_model_len"),
        ("/v1/completions", {**COMPLETION, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "lower max_tokens"),
        ("/v1/completions", {**COMPLETION, "prompt": "x" * 50_000}, 400, "prompt", "shorten the prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**6]}, 400, "prompt", "vocabulary"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt", "empty"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt", "empty"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"five": 10}}, 400, "logit_bias", "must be token ids"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"999999": 10}}, 400, "logit_bias", "outside the vocabulary"),
        ("/v1/chat/completions", {**CHAT, "echo": True}, 400, "echo", "not supported"),
        ("/v1/completions", {**COMPLETION, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
         "not available when stream is true"),
        ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, 400, "prompt_logprobs", "exceeds max_logprobs"),
        ("/v1/completions", {**COMPLETION, "bad_words": ["w"] * 301}, 400, "bad_words", "--max-token-list"),
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "top_p": 0.5}, 400, "top_p",
         "does not go with use_beam_search"),
        ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "logprobs": True}, 400, "logprobs",
         "does not go with use_beam_search"),
        ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "n": 11}, 400, "n", "max_logprobs=20"),
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "n": 0}, 400, "n", "n must be"),
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "temperature": 0.8, "seed": 7}, 400, "seed",
         "does not go with use_beam_search"),  # its draws are not seeded
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "temperature": 0.8, "seed": 0}, 400, "seed",
         "does not go with use_beam_search"),  # 0 as well, though 0 == False
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "logprobs": 0}, 400, "logprobs",
         "does not go with use_beam_search"),
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "n": 2, "max_tokens": 0}, 400, "max_tokens",
         "max_tokens"),  # 0 is not null
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
         "top_logprobs (21) exceeds max_logprobs (20), the most alternatives this engine returns per token (its "
         "max_logprobs / --max-logprobs sets it"),  # the engine's logprobs, named as chat names it (not the flag)
        ("/v1/completions", {**COMPLETION, "seed": 1 << 64}, 400, "seed", "64-bit"),
        ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "-1"),
        ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": {}, "whitespace_pattern": " "}}, 400,
         "structured_outputs", "structured_outputs.whitespace_pattern is not supported"),
        ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": '{"items":' * 3000 + "{}" + "}" * 3000}},
         400, "structured_outputs", "not valid JSON"),
        ("/tokenize", {"model": MODEL_NAME}, 400, None, "give one of `prompt` (a text) or `messages` (a chat)"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages", "text parts"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens",
         "max_completion_tokens must be"),
        ("/v1/completions", {**COMPLETION, "priority": 3}, 400, "priority", "needs scheduling_policy='priority'"),
        ("/v1/chat/completions", {**CHAT, "priority": 1.5}, 400, "priority", "integer"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2, "a"]}, 400, "prompt", "prompt.2: Input should be a valid "
         "integer"),  # the token-id form's error alone
        ("/v1/completions", {**COMPLETION, "prompt": 7}, 400, "prompt", "a prompt is a string, a list of token ids"),
        ("/v1/completions", {**COMPLETION, "best_of": True}, 400, "best_of", "not supported"),  # strict as n
        ("/v1/completions", {**COMPLETION, "best_of": 1.0}, 400, "best_of", "not supported"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": -2}, 400, "top_logprobs", "top_logprobs must be"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": -1}, 400, "top_logprobs", "needs logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs",
         "top_logprobs (-1, the whole vocabulary of"),  # vLLM's -1, past the server's max_logprobs
        ("/v1/completions", {**COMPLETION, "logprobs": -1}, 400, "logprobs", "exceeds max_logprobs (20)"),
        ("/v1/chat/completions", {**CHAT, "continue_final_message": True, "add_generation_prompt": True}, 400,
         "continue_final_message", "cannot be true too"),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
        ("/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "model", "does not exist"),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model", "does not exist"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least one"),
        ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages", "required"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, 400, "messages", "required"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature", "temperature"),
        ("/v1/nowhere", COMPLETION, 404, None, "Not Found"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format",
         "json_schema.schema"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "json_schema"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}}, 400, "response_format", "JSON schema cannot be compiled"),
        ("/v1/completions", {**COMPLETION, "guided_regex": "(a"}, 400, "guided_regex", "regex cannot be compiled"),
        ("/v1/completions", {**COMPLETION, "structured_outputs": {"grammar": "root ::= ("}}, 400, "structured_outputs",
         "grammar cannot be compiled"),
        ("/v1/completions", {**COMPLETION, "structured_outputs": {"grammar": "root ::= root"}}, 400,
         "structured_outputs", "grammar matches no text"),
        ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
         "structured_outputs", "exactly one of"),
        ("/v1/completions", {**COMPLETION, "guided_choice": ["a"], "guided_regex": "a"}, 400, "guided_regex",
         "set one of guided_regex, guided_choice, not several"),
        ("/v1/completions", {**COMPLETION, "guided_choice": []}, 400, "guided_choice", "non-empty strings"),
        ("/v1/completions", {**COMPLETION, "guided_regex": ""}, 400, "guided_regex",
         "guided_regex must be a non-empty string"),
        ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens",
         "exceeds max_model_len"),
        ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "^([a-z]{1,100}){1,100}$"}}}}, 400, "response_format",
         "too large to build"),
    ],
)
def test_bad_input_gets_an_openai_error(server, path, body, status, param, message):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message.lower() in error["message"].lower()


def test_errors_through_the_client_leave_the_server_serving(server, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="Hello " * 300, max_tokens=300)
    assert "max_model_len" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["code"] == "model_not_found"
    assert client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3).usage.completion_tokens > 0
    assert_idle(server)


def test_token_constraints_that_forbid_the_grammars_first_tokens_get_a_400(server, offline):
    """guided_choice with allowed_token_ids that allow none of its first tokens was a 200 of
    empty text; now a 400 naming the constraint, from the API process's check."""
    x = offline.tokenizer.convert_tokens_to_ids("x")
    response = post(server, "/v1/completions", {**COMPLETION, "guided_choice": ["yes", "no"], "allowed_token_ids": [x]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "allowed_token_ids" and "forbid every token" in error["message"]
    assert_idle(server)


def test_vllm_token_fields_equal_offline_and_unknown_fields_are_logged(server, client, offline):
    """allowed_token_ids, logit_bias (OpenAI's string keys), bad_words and
    truncate_prompt_tokens reach the engine: the same tokens as offline; a field no API
    has is ignored with a line in the log, as vLLM does."""
    prompt = [5, 9, 13, 21, 34, 55, 89, 144]
    fields = dict(allowed_token_ids=[3, 5, 7, 11, 13], logit_bias={13: -100.0, 7: 2.5}, truncate_prompt_tokens=6)
    [expected] = offline.generate([prompt], greedy(6, **fields), use_tqdm=False)
    body = {**fields, "logit_bias": {"13": -100, "7": 2.5}, "max_tokens_typo": 3, "z" * 500: 1}
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, extra_body=body)
    assert reply.choices[0].text == expected.outputs[0].text and reply.usage.prompt_tokens == 6
    deadline = time.monotonic() + 10
    while "max_tokens_typo" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log.read_text()  # each name cut at 64 characters
    assert "this server does not know, ignored: 'max_tokens_typo', '" + "z" * 64 + "'..." in log and "z" * 65 not in log
    free = offline.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0]
    words = [offline.tokenizer.decode(free.token_ids[:1]).strip()]
    [expected] = offline.generate([prompt], greedy(6, bad_words=words), use_tqdm=False)
    assert expected.outputs[0].token_ids != free.token_ids  # the word would be generated
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"bad_words": words})
    assert reply.choices[0].text == expected.outputs[0].text


def test_truncate_prompt_tokens_lets_any_prompt_fit_and_usage_counts_what_ran(client, offline):
    """A text prompt far past max_model_len is served when truncate_prompt_tokens makes it fit
    (as vLLM's), and chat's usage, like completions', counts the prompt as truncated."""
    long_text = "a b " * 50_000  # ~100k characters, past any context's reach
    reply = client.completions.create(model=MODEL_NAME, prompt=long_text, max_tokens=2, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 8})
    assert reply.usage.prompt_tokens == 8
    messages = [{"role": "user", "content": long_text}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"truncate_prompt_tokens": 8})
    assert reply.usage.prompt_tokens == 8
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"truncate_prompt_tokens": 8})
    assert [chunk.usage for chunk in stream if chunk.usage][-1].prompt_tokens == 8


def test_logit_bias_is_clipped_as_openais_and_its_keys_are_token_ids():
    from nanovllm.entrypoints.openai.errors import APIError
    from nanovllm.entrypoints.openai.serving import logit_bias

    assert logit_bias({"5": 500, "6": -1e9, "7": 1.5}) == {5: 100.0, 6: -100.0, 7: 1.5}
    with pytest.raises(APIError, match=r"token ids, got \['x', '-1'\]"):
        logit_bias({"5": 1, "x": 1, "-1": 2})
    # digits outside ASCII: str.isdigit takes them, int() takes some of them as other ids
    with pytest.raises(APIError, match="must be token ids"):
        logit_bias({"\u00b2": 1, "\u0661": 1, "\uff11": 1})
    with pytest.raises(APIError, match="NaN"):
        logit_bias({"5": float("nan")})


def test_continuous_usage_stats_count_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk has the counts so far (chat's
    role chunks, before any token, included)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, body in ((client.completions.create, dict(prompt="Hello")),
                         (client.chat.completions.create, dict(messages=[{"role": "user", "content": "Hi"}]))):
        chunks = list(create(model=MODEL_NAME, max_tokens=5, temperature=0, stream=True, stream_options=options,
                             extra_body={"ignore_eos": True}, **body))
        assert all(c.usage is not None for c in chunks)
        counted = [c.usage.completion_tokens for c in chunks if c.choices]
        assert counted and counted == sorted(counted) and counted[-1] == 5 == chunks[-1].usage.completion_tokens
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in chunks if c.usage is not None)


def test_chat_continues_the_final_message(client, offline):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    [expected] = offline.chat(messages, greedy(5), use_tqdm=False, add_generation_prompt=False,
                              continue_final_message=True)
    assert expected.prompt.endswith("Hello, I am")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"continue_final_message": True})
    assert reply.choices[0].message.content == expected.outputs[0].text


# -- structured outputs --------------------------------------------------------------------

# Every value bounded, so that even a random model's output ends.
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
                "required": ["ok", "color"], "additionalProperties": False}


def test_response_format_json_schema_equals_offline_stream_and_not(client, offline):
    from nanovllm.sampling_params import StructuredOutputsParams

    messages = [{"role": "user", "content": "A color, as JSON"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "color", "schema": SMALL_SCHEMA, "strict": True}}
    [expected] = offline.generate([chat_prompt(offline, messages)], greedy(
        200, structured_outputs=StructuredOutputsParams(json=SMALL_SCHEMA)), use_tqdm=False)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=200,
                                           response_format=response_format)
    choice = whole.choices[0]
    assert choice.message.content == expected.outputs[0].text and choice.finish_reason == "stop"
    assert json.loads(choice.message.content) in [{"ok": ok, "color": c} for ok in (True, False) for c in ("red", "green")]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=200,
                                            response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content


def test_structured_outputs_guided_fields_and_json_object(server, client):
    """vLLM's structured_outputs and guided_* fields (through extra_body, as vLLM's docs
    show) and OpenAI's json_object, sampled with n = 3."""
    choices = ["apple", "banana split", "cherry"]
    out = client.completions.create(model=MODEL_NAME, prompt="Fruit:", max_tokens=20, n=3, seed=1, temperature=1.0,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=20, n=3, seed=2, temperature=1.0,
                                    extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"})
    assert all(re.fullmatch(r"[A-Z]{3}-\d{2}", c.text) for c in out.choices), [c.text for c in out.choices]
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "JSON please"}],
                                         max_tokens=60, n=3, seed=3, temperature=1.0,
                                         response_format={"type": "json_object"})
    for c in out.choices:  # any JSON object: done ones parse, cut ones are at least one under way
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.message.content.lstrip().startswith("{")
    assert_idle(server)


def test_api_key(server):
    for key in (None, "sk-wrong"):
        response = post(server, "/v1/completions", COMPLETION, api_key=key)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    # The key before the body: a wrong key learns nothing of how its body parses (vLLM's order).
    assert post(server, "/v1/completions", b"{", api_key="sk-wrong").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, api_key="sk-wrong").models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200  # probes need no key
    assert httpx.head(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


# -- separate servers -----------------------------------------------------------------------


def test_vllm_serving_flags(qwen3_ckpt, tmp_path):
    """--generation-config defaults for unset fields (max_new_tokens a cap), --chat-template from a file, several
    --served-model-name (the first reported), CORS for the origins given and a root path
    behind a proxy, the engine's --enable-chunked-prefill, and the log: one format with
    timestamps for the server's and uvicorn's lines, and a statistics line while busy."""
    defaults = tmp_path / "defaults"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 30}))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}=")
    srv = start_server(qwen3_ckpt, tmp_path / "server.log", "--generation-config", str(defaults), "--chat-template",
                       str(template), "--served-model-name", "first", "second", "--log-level", "info",
                       "--log-stats-interval", "0.5", "--allowed-origins", '["http://ui.example"]',
                       "--root-path", "/llm", "--enable-chunked-prefill")
    try:
        client = openai_client(srv)
        assert [m.id for m in client.models.list().data] == ["first", "second"]
        preflight = httpx.options(srv.base_url + "/v1/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.get(srv.base_url + "/health", headers={"Origin": "http://other.example"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
        # The proxy strips the prefix; the schema tells clients where the API is.
        assert httpx.get(srv.base_url + "/openapi.json").json()["servers"] == [{"url": "/llm"}]
        with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
            greedy_text = llm.generate(["Once upon"], greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
            chat_text = llm.generate([llm.tokenizer.encode("Hi=", add_special_tokens=False)], greedy(4),
                                     use_tqdm=False)[0].outputs[0].text
        # No temperature in the request: the defaults folder's 0, so greedy.
        answer = client.completions.create(model="second", prompt="Once upon", max_tokens=24,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == greedy_text and answer.model == "second"
        chat = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.content == chat_text
        # max_new_tokens caps what a request asks (chat's default: the context's end), as vLLM's.
        capped = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "Hi"}],
                                                extra_body={"ignore_eos": True})
        assert capped.usage.completion_tokens == 30
        beams = client.completions.create(model="first", prompt="Once upon", max_tokens=40, n=2,
                                          extra_body={"ignore_eos": True, "use_beam_search": True})
        assert beams.usage.completion_tokens == 2 * 30  # beam search under the cap too
        beams = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "Hi"}], n=2,
                                               top_logprobs=0, extra_body={"ignore_eos": True, "use_beam_search": True})
        assert beams.usage.completion_tokens == 2 * 30  # and top_logprobs 0 asks for nothing there either
        deadline = time.monotonic() + 10
        while "prompt throughput" not in srv.log.read_text() and time.monotonic() < deadline:
            client.completions.create(model="first", prompt="Busy", max_tokens=64, extra_body={"ignore_eos": True})
    finally:
        assert srv.stop() == 0
    lines = srv.log.read_text().splitlines()
    stats = [line for line in lines if "prompt throughput" in line]
    assert stats and "running" in stats[0] and "KV cache usage" in stats[0]
    stamped = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR|DEBUG) \S+: ")
    assert any("uvicorn" in line for line in lines) and all(stamped.match(line) for line in lines if "uvicorn" in line)


def test_model_without_chat_template_gets_a_clear_400(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    srv = start_server(ckpt, tmp_path / "server.log")
    try:
        response = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, api_key=None)
        assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
        assert post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, api_key=None).status_code == 200
    finally:
        returncode = srv.stop()
    assert returncode == 0


@pytest.mark.parametrize(("sig", "to_group"), [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
                         ids=["SIGINT", "SIGTERM", "SIGTERM to the process group"])
def test_signal_mid_stream_exits_cleanly(qwen3_ckpt, tmp_path, sig, to_group):
    """The running request is aborted after the shutdown timeout and its stream ends
    properly; exit status 0. A SIGTERM to the whole process group (what systemd and
    container runtimes send) reaches the engine process too, which leaves it to the server."""
    srv = start_server(qwen3_ckpt, tmp_path / "server.log", "--shutdown-timeout", "0", own_process_group=to_group)
    try:
        stream = openai_client(srv).completions.create(model=qwen3_ckpt.name, prompt="The quick brown fox",  # default name
                                                 max_tokens=LONG_MAX_TOKENS, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        if to_group:
            os.killpg(srv.process.pid, sig)
        else:
            srv.process.send_signal(sig)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "abort"
        assert srv.process.wait(timeout=30) == 0
    finally:
        srv.stop(signal.SIGKILL)
    log = srv.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert process_gone(engine_pid(srv))


def test_a_dead_engine_fails_running_requests_and_the_server_exits_for_a_restart(qwen3_ckpt, tmp_path):
    """As vLLM: a server whose engine died is no use, so it fails what runs and exits
    non-zero for its supervisor to restart it, with one line saying why."""
    srv = start_server(qwen3_ckpt, tmp_path / "server.log")
    try:
        stream = openai_client(srv).completions.create(model=qwen3_ckpt.name, prompt="The quick brown fox",
                                                       max_tokens=LONG_MAX_TOKENS, stream=True,
                                                       extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        os.kill(engine_pid(srv), signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine"):  # the stream's error event
            list(chunks)
        assert srv.process.wait(timeout=30) == 1
    finally:
        srv.stop(signal.SIGKILL)
    log = srv.log.read_text()
    assert "nanovllm: error: the engine stopped: the engine process exited unexpectedly" in log
    assert "Traceback" not in log


def test_sigusr1_dumps_both_processes_stacks_and_the_server_keeps_serving(server, client):
    """What a stalled server is doing: SIGUSR1 to it prints its threads' stacks and the
    engine process's (the engine loop waiting on the pipe), and changes nothing else."""
    before = len(server.log.read_text())
    server.process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "engine_process.py" not in server.log.read_text()[before:]:
        time.sleep(0.1)
    dumped = server.log.read_text()[before:]
    assert "engine_process.py" in dumped and "api_server.py" in dumped
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0)
    assert completion.choices[0].finish_reason == "length"


def test_without_the_serve_extra_the_package_imports_and_serve_says_what_to_install():
    # A finder that hides fastapi, as on a machine without the `serve` extra.
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'fastapi': raise ModuleNotFoundError(name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import nanovllm, nanovllm.serving.async_engine\n"
        "from nanovllm.entrypoints.cli import main\n"
        "main(['serve', '--device', 'cpu'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "pip install 'nanovllm[serve]'" in result.stderr, result.stderr


def test_vllms_older_server_module_serves(qwen3_ckpt, tmp_path):
    """`python -m nanovllm.entrypoints.openai.api_server --model ...`, vLLM's older spelling of
    `serve`, serves the same way."""
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "nanovllm.entrypoints.openai.api_server", "--model", str(qwen3_ckpt),
               "--port", "0", "--served-model-name", MODEL_NAME, *cli_flags(ENGINE_ARGS)]
    with open(log, "w") as out:
        srv = ServerProcess(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=SERVER_ENV), None, log)
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        answer = post(srv, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}, api_key=None)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    finally:
        assert srv.stop() == 0
