"""`nanovllm serve -dp 2`: two engine replicas behind one API process (serving/router.py)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
from types import SimpleNamespace

import openai
import pytest
from server_helpers import API_KEY, ENGINE_ARGS, MODEL_NAME, openai_client, read_metrics, start_server

from nanovllm import LLM, SamplingParams
from nanovllm.serving.messages import EngineRequest
from nanovllm.serving.router import AFFINITY_SLACK_TOKENS, OUTPUT_COST_CAP, ReplicaRouter


def test_two_replicas_answer_as_one_engine_and_a_dead_one_stops_the_server(qwen3_ckpt, tmp_path):
    srv = start_server(qwen3_ckpt, tmp_path / "server.log", "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
                       "-dp", "2", "--response-role", "bot", "--enable-prompt-tokens-details")
    try:
        pids = [int(pid) for pid in re.findall(r"engine process (\d+) ready", srv.log.read_text())]
        assert len(set(pids)) == 2
        prompts = [f"Request number {i} says" for i in range(8)]
        with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as one:
            expected = [o.outputs[0].text for o in one.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                                     ignore_eos=True), use_tqdm=False)]

        async def ask_all() -> list[str]:
            client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
            answers = await asyncio.gather(*(client.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))
            await client.close()
            return [a.choices[0].text for a in answers]

        assert asyncio.run(ask_all()) == expected
        # a structured request: its grammar compiles through the router, in the server's grammar thread
        choice = openai_client(srv).completions.create(model=MODEL_NAME, prompt="Pick", max_tokens=8,
                                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert choice.choices[0].text in ("yes", "no")
        answers_in_roles_with_cached_tokens(openai_client(srv))
        metrics = read_metrics(srv)
        per_replica = [metrics[f'nanovllm:generation_tokens_total{{replica="{i}"}}'] for i in range(2)]
        assert all(n > 0 for n in per_replica), per_replica  # both replicas served
        assert metrics['nanovllm:generation_tokens_total{replica="total"}'] == sum(per_replica)
        assert all(metrics[f'nanovllm:startup_seconds{{phase="engine",replica="{i}"}}'] > 0 for i in range(2))

        stream = openai_client(srv).completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=400,
                                                       stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        os.kill(pids[0], signal.SIGKILL)  # one replica dies; the stream may run on either
        try:  # on the dead one it fails; on the other it ends as the server drains and stops
            finish = [chunk.choices[0].finish_reason for chunk in chunks][-1]
            assert finish in ("length", "abort")
        except openai.APIError:
            pass
        assert srv.process.wait(timeout=60) == 1
    finally:
        srv.stop(signal.SIGKILL)
    # The log's pids come in the order the replicas got ready, not by index: either may have died.
    assert re.search(r"nanovllm: error: replica [01]: the engine stopped: the engine process exited unexpectedly",
                     srv.log.read_text())


def answers_in_roles_with_cached_tokens(client: openai.OpenAI) -> None:
    """--response-role and --enable-prompt-tokens-details (vLLM's): one conversation three
    times, the later ones served from the prefix cache that the first filled (on its
    replica: prefix affinity), which usage reports, streamed (a plain stream) or not."""
    block = ENGINE_ARGS["kvcache_block_size"]
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me about the weather. " * 8}],
               max_tokens=2)
    first = client.chat.completions.create(**ask)
    assert first.choices[0].message.role == "bot"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    held = (first.usage.prompt_tokens - 1) // block * block  # the full blocks before the last prompt token
    assert held > 0
    again = client.chat.completions.create(**ask)
    assert again.usage.prompt_tokens_details.cached_tokens == held
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "bot"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == held
    # without a generation prompt the answer goes on with the last message, in its role
    going_on = client.chat.completions.create(**ask, extra_body={"add_generation_prompt": False})
    assert going_on.choices[0].message.role == "user"
    # beam search's usage counts its prompt's cached tokens too, streamed or not, in its role
    beams = client.chat.completions.create(**ask, n=2, extra_body={"use_beam_search": True})
    assert beams.usage.prompt_tokens_details.cached_tokens == held and beams.choices[1].message.role == "bot"
    chunks = list(client.chat.completions.create(**ask, n=2, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"use_beam_search": True}))
    assert chunks[0].choices[0].delta.role == "bot" and chunks[-1].usage == beams.usage


def fake_router(replicas: int = 2, block_size: int = 4) -> ReplicaRouter:
    replica = SimpleNamespace(config=None, tokenizer=None, checker=None, eos_token_ids=set(), generation_defaults={})
    return ReplicaRouter([replica] * replicas, block_size)


def test_the_least_busy_replica_unless_a_prefix_is_held_and_not_much_busier():
    router = fake_router()
    shared = list(range(100, 108))  # two full blocks of 4
    assert router.choose([1, 2, 3]) == 0  # no full block: by load alone
    router.outstanding = [0, 10]
    assert router.choose(shared + [1]) == 0  # first seen: the least busy, remembered
    router.outstanding = [50, 0]
    assert router.choose(shared + [2, 3]) == 0  # same prefix: where it is cached, 50 tokens busier
    router.outstanding = [AFFINITY_SLACK_TOKENS + 1, 0]
    assert router.choose(shared + [4]) == 1  # much busier: moved, and remembered there
    router.outstanding = [0, 100]
    assert router.choose(shared) == 1
    assert router.choose(list(range(200, 208))) == 0  # another prefix: the least busy


def test_an_open_ended_request_weighs_at_most_the_output_cap():
    """A request's load counts its max_tokens up to OUTPUT_COST_CAP: chat's default reaches
    the context's end, which would outweigh the affinity slack on its own."""
    seen = []

    async def generate(requests, stream):
        seen.append(list(router.outstanding))
        yield []

    replica = SimpleNamespace(config=None, tokenizer=None, checker=None, eos_token_ids=set(), generation_defaults={},
                              generate=generate)
    router = ReplicaRouter([replica, replica], 4)
    request = EngineRequest("r", [7] * 10, SamplingParams(max_tokens=40_000, n=2), stream=False)

    async def run() -> None:
        async for _ in router.generate([request]):
            pass

    asyncio.run(run())
    assert seen == [[10 + 2 * OUTPUT_COST_CAP, 0]] and router.outstanding == [0, 0]


def test_least_loaded_and_round_robin_routing_ignore_prefixes():
    shared = list(range(100, 108))
    router = fake_router(3)
    router.routing = "least-loaded"
    router.outstanding = [5, 0, 9]
    assert [router.choose(shared) for _ in range(2)] == [1, 1]
    router = fake_router(3)
    router.routing = "round-robin"
    router.outstanding = [0, 100, 100]
    assert [router.choose(shared) for _ in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="routing must be one of"):
        ReplicaRouter([], 4, "random")


@pytest.mark.parametrize("stats,expected", [
    ([dict(kv_blocks_used=10, kv_blocks_total=100, prefix_cache_queries=300, prefix_cache_hits=150,
           generation_tokens_total=7),
      dict(kv_blocks_used=30, kv_blocks_total=100, prefix_cache_queries=100, prefix_cache_hits=10,
           generation_tokens_total=5)],
     dict(kv_cache_usage=0.2, prefix_cache_hit_rate=0.4, prefix_cache_hits=160, generation_tokens_total=12,
          kv_blocks_used=40)),
])
def test_statistics_add_up_over_replicas(stats, expected):
    router = fake_router()
    router.replicas = [SimpleNamespace(latest_stats=s) for s in stats]
    total = router.latest_stats
    for key, value in expected.items():
        assert total[key] == pytest.approx(value), key
