"""nanovllm on Ray (integrations/ray.py): Serve, Data and run-batch --ray on one local Ray
instance, with the demo model on CPU."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("ray.data")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from nanovllm import LLM, SamplingParams
from nanovllm.demo import DEMO_MODEL_DIR
from nanovllm.entrypoints.openai.run_batch import run_batch
from nanovllm.integrations.ray import NanoVLLMPredictor, build_app

# Small KV blocks, so that a prompt of a few lines fills one and is routed by its prefix.
ENGINE_ARGS = {"device": "cpu", "dtype": "float32", "kvcache_block_size": 16, "num_kvcache_blocks": 256}
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
OPENAI_GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}  # the same, for openai
ONE_ACTOR = ray.data.ActorPoolStrategy(size=1)


@pytest.fixture(scope="module")
def ray_address():
    """One small local Ray instance for every test here: logical CPUs for Serve's and
    Data's actors (they mostly wait), a small object store, no dashboard. Serve's proxy gets
    30 s, not 5, to answer its readiness and health checks: on a busy 2-core machine its
    start can take longer, and Serve then kills it and serve.start fails."""
    patience = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
    os.environ.update({name: os.environ.get(name, value) for name, value in patience.items()})  # the local raylet's
    context = ray.init(num_cpus=8, object_store_memory=128 * 2**20, include_dashboard=False,
                       runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **patience}})
    yield context.address_info["address"]
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def offline():
    with LLM(DEMO_MODEL_DIR, **ENGINE_ARGS) as llm:
        yield llm


def texts(llm: LLM, prompts: list, **params) -> list[str]:
    return [out.outputs[0].text for out in llm.generate(prompts, SamplingParams(**{**GREEDY, **params}),
                                                        use_tqdm=False)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replica_tokens(base_url: str) -> dict[str, float]:
    """Prompt tokens of each engine replica, from the ingress's /metrics."""
    text = httpx.get(base_url + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r'^nanovllm:prompt_tokens_total\{.*replica="(\d+)"\} (\S+)$',
                                                   text, re.MULTILINE)}


def test_serve_two_replicas_answer_the_openai_client(ray_address, offline):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(DEMO_MODEL_DIR, num_replicas=2, served_model_name="demo", api_key="sk-ray", **ENGINE_ARGS),
              route_prefix="/")
    base_url = f"http://127.0.0.1:{port}"
    try:
        prompts = [f"def function_{i}(" for i in range(8)]
        expected = texts(offline, prompts)

        async def ask_all() -> list[str]:
            client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="sk-ray", max_retries=0)
            answers = await asyncio.gather(*(client.completions.create(model="demo", prompt=p, **OPENAI_GREEDY)
                                             for p in prompts))
            await client.close()
            return [a.choices[0].text for a in answers]

        assert asyncio.run(ask_all()) == expected
        for _ in range(4):  # the less busy of two: on a slow machine one round can all go to one replica
            if len(replica_tokens(base_url)) == 2:
                break
            asyncio.run(ask_all())
        assert all(n > 0 for n in replica_tokens(base_url).values()) and len(replica_tokens(base_url)) == 2

        client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-ray", max_retries=0)
        messages = [{"role": "user", "content": "def add(a, b):"}]
        reply = client.chat.completions.create(model="demo", messages=messages, **OPENAI_GREEDY)
        assert reply.choices[0].message.content == offline.chat(messages, SamplingParams(**GREEDY),
                                                                use_tqdm=False)[0].outputs[0].text
        stream = client.completions.create(model="demo", prompt=prompts[0], stream=True, **OPENAI_GREEDY)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == expected[0]
        assert chunks[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="temperature"):  # the server's own checks and errors
            client.completions.create(model="demo", prompt="x", temperature=-1)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0).models.list()

        # A prompt of several KV blocks goes back to the replica that has its prefix cached.
        shared = "import os\nimport sys\nimport json\n\ndef main(argv):\n    parser = make_parser()\n" * 2
        before = replica_tokens(base_url)
        for i in range(4):
            client.completions.create(model="demo", prompt=shared + f"    step_{i} =", max_tokens=2)
        grown = [name for name, n in replica_tokens(base_url).items() if n > before[name]]
        assert len(grown) == 1, (before, replica_tokens(base_url))
    finally:
        serve.delete("default")


def test_data_predictor_equals_offline_greedy(ray_address, offline):
    prompts = [f"def function_{i}(" for i in range(64)]
    dataset = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    kwargs = {"model": DEMO_MODEL_DIR, "sampling_params": GREEDY, **ENGINE_ARGS}
    rows = dataset.map_batches(NanoVLLMPredictor, fn_constructor_kwargs=kwargs, compute=ONE_ACTOR,
                               batch_size=32).take_all()
    rows.sort(key=lambda row: row["id"])
    assert [row["generated_text"] for row in rows] == texts(offline, prompts)
    assert {(row["num_generated_tokens"], row["finish_reason"]) for row in rows} == {(8, "length")}
    assert [row["num_input_tokens"] for row in rows] == [len(offline.tokenizer.encode(p)) for p in prompts]

    chats = [[{"role": "user", "content": f"def f{i}(x):"}] for i in range(3)]
    token_ids = [offline.tokenizer.encode(p) for p in prompts[:3]]
    other = ray.data.from_items([{"id": i, "messages": c, "prompt_token_ids": t}
                                 for i, (c, t) in enumerate(zip(chats, token_ids))])
    by_ids = other.drop_columns(["messages"]).map_batches(NanoVLLMPredictor, fn_constructor_kwargs=kwargs,
                                                          compute=ONE_ACTOR)
    by_chat = other.drop_columns(["prompt_token_ids"]).map_batches(NanoVLLMPredictor, fn_constructor_kwargs=kwargs,
                                                                   compute=ONE_ACTOR)

    def in_order(dataset) -> list[str]:  # Ray Data keeps no row order across blocks
        return [row["generated_text"] for row in sorted(dataset.take_all(), key=lambda row: row["id"])]

    assert in_order(by_ids) == texts(offline, prompts[:3])
    assert in_order(by_chat) == [out.outputs[0].text
                                 for out in offline.chat(chats, SamplingParams(**GREEDY), use_tqdm=False)]


def request(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.slow  # its parts are the Data test's predictor and test_run_batch's answering
def test_run_batch_on_ray_equals_the_local_run_batch(ray_address, tmp_path):
    lines = [request("completion", "/v1/completions", {"prompt": "def add(", **GREEDY}),
             request("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **GREEDY}),
             "{not json",
             request("refused", "/v1/completions", {"prompt": "x", "temperature": -1}),
             request("two", "/v1/completions", {"prompt": ["import os", "class A:"], **GREEDY})]
    source, local, on_ray = tmp_path / "in.jsonl", tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert run_batch(DEMO_MODEL_DIR, ENGINE_ARGS, str(source), str(local), "demo", use_tqdm=False) == (5, 2)
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_ARGS.items()]
    done = subprocess.run([sys.executable, "-m", "nanovllm", "run-batch", "--ray", "-i", str(source), "-o", str(on_ray),
                           *flags], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_ADDRESS": ray_address})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith(f"5 requests, 3 answered with 200, 2 with an error: {on_ray}")

    def comparable(line: str) -> tuple:  # what does not depend on ids and clocks
        result = json.loads(line)
        body = (result["response"] or {}).get("body", {})
        return (result["custom_id"], result["error"], (result["response"] or {}).get("status_code"),
                [c.get("text") or c.get("message") for c in body.get("choices", [])])

    expected = list(map(comparable, local.read_text().splitlines()))
    assert list(map(comparable, on_ray.read_text().splitlines())) == expected
    assert [e[:3] for e in expected] == [("completion", None, 200), ("chat", None, 200), (None, expected[2][1], None),
                                         ("refused", None, 400), ("two", None, 200)]
    assert "line 3 is not JSON" in expected[2][1]["message"]
