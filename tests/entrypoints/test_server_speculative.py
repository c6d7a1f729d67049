"""A server with speculative decoding (`--speculative-config`: n-gram lookup, or a draft
model, here the model itself): streamed and whole answers equal offline decoding without
it, several tokens may come in one chunk, and /metrics counts the drafts."""
from __future__ import annotations

import json

import pytest

from nanovllm import LLM, SamplingParams
from server_helpers import API_KEY, ENGINE_ARGS, MODEL_NAME, assert_idle, openai_client, read_metrics, start_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def server(qwen3_ckpt, tmp_path_factory, request):
    config = NGRAM if request.param == "ngram" else {"model": str(qwen3_ckpt), "num_speculative_tokens": 3}
    srv = start_server(qwen3_ckpt, tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY,
                       "--served-model-name", MODEL_NAME, "--speculative-config", json.dumps(config))
    yield srv
    srv.stop()


def test_speculating_server_answers_as_plain_decoding(server, qwen3_ckpt):
    client = openai_client(server)
    with LLM(str(qwen3_ckpt), **ENGINE_ARGS) as llm:
        prompt = llm.tokenizer.decode(([50, 61, 72, 83] * 8))  # a loop: drafts to find
        expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.usage.completion_tokens == 40
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
    metrics = read_metrics(server)
    drafted = metrics["nanovllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["nanovllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and 0 < accepted <= drafted
    per_pos = [metrics.get(f'nanovllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}', 0)
               for j in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert metrics["nanovllm:generation_tokens_total"] == 80
    assert_idle(server)
