"""The server against requests that try to freeze, starve or crash it, and against faults.

Each bad request is sent while /health is asked every 50 ms (each answer must come within
a second), and a fixed greedy request afterwards must return the same text as before."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

from server_helpers import SERVER_ENV, assert_idle, engine_pid, openai_client, post, start_server

MAX_N = 4
LIMIT_FLAGS = [
    "--max-n", str(MAX_N), "--max-prompts-per-request", "3", "--max-stop-strings", "2",
    "--max-stop-string-length", "8", "--max-request-body-bytes", str(64 * 1024), "--max-logprobs", "3",
    "--request-header-timeout", "2", "--request-body-timeout", "2",
    "--max-num-seqs", "2",  # two sequences at a time: the fairness test needs a queue
]
REFERENCE = {"prompt": "The scheduler", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(qwen3_ckpt, tmp_path_factory):
    """A server with small limits and no API key; yields (server, its greedy reference text)."""
    srv = start_server(qwen3_ckpt, tmp_path_factory.mktemp("guarded") / "server.log", *LIMIT_FLAGS)
    reference = post(srv, "/v1/completions", REFERENCE, api_key=None).json()["choices"][0]["text"]
    yield srv, reference
    srv.stop()


def model_name(ckpt) -> str:
    return ckpt.name  # the default served name: the model folder's name


def send_bad(guarded, send):
    """send() in a thread while /health must answer 200 within 1 s every 50 ms; afterwards
    the reference request must give its reference text. Returns what send returned."""
    srv, reference = guarded
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(send)
        checks = 0
        while not future.done() or checks == 0:
            assert httpx.get(srv.base_url + "/health", timeout=1.0).status_code == 200
            checks += 1
            time.sleep(0.05)
        result = future.result()
    after = post(srv, "/v1/completions", REFERENCE, api_key=None)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == reference
    return result


def assert_error(response: httpx.Response, status: int, param: str | None, *fragments: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


def raw(srv, path: str, body: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(srv.base_url + path, content=body, headers=headers, timeout=30)


# -- 1: size -------------------------------------------------------------------------------


def test_an_oversized_body_gets_413_before_it_is_read(guarded):
    srv, _ = guarded
    body = json.dumps({"prompt": "x" * (100 * 1024), "max_tokens": 2}).encode()
    response = send_bad(guarded, lambda: raw(srv, "/v1/completions", body))
    assert_error(response, 413, None, "max_request_body_bytes", "--max-request-body-bytes")

    def chunked():  # no Content-Length: the limit applies as the body arrives
        for _ in range(100):
            yield b" " * 1024

    response = send_bad(guarded, lambda: httpx.post(srv.base_url + "/v1/completions", content=chunked(),
                                                    headers={"Content-Type": "application/json"}))
    assert_error(response, 413, None, "max_request_body_bytes")


def test_a_prompt_too_long_by_its_length_alone_is_refused_untokenized(guarded, qwen3_ckpt):
    srv, _ = guarded
    response = send_bad(guarded, lambda: post(srv, "/v1/completions", {"prompt": "ab " * 20_000, "max_tokens": 2},
                                              api_key=None))
    assert_error(response, 400, "prompt", "at least", "max_model_len")
    # A prompt that fits on its own: max_tokens is what to lower.
    response = send_bad(guarded, lambda: post(srv, "/v1/completions", {"prompt": "ab", "max_tokens": 100_000},
                                              api_key=None))
    assert_error(response, 400, "max_tokens", "at least", "max_model_len")
    chat = {"messages": [{"role": "user", "content": "ab " * 20_000}]}
    assert_error(send_bad(guarded, lambda: post(srv, "/v1/chat/completions", chat, api_key=None)), 400, "messages",
                 "max_model_len")
    # Each error names the field the client sent: chat's max_completion_tokens, before and
    # after tokenizing (a short prompt passes the length check, then its tokens are counted).
    for max_tokens in (100_000, 510):
        response = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}],
                                                      "max_completion_tokens": max_tokens}, api_key=None)
        assert_error(response, 400, "max_completion_tokens", f"max_completion_tokens ({max_tokens})", "max_model_len",
                     "lower max_completion_tokens")
    response = post(srv, "/v1/completions", {"prompt": "ab", "max_tokens": 511}, api_key=None)  # 2 tokens
    assert_error(response, 400, "max_tokens", "max_tokens (511) + the prompt's 2 tokens", "lower max_tokens")


# -- 2: chat templates ---------------------------------------------------------------------


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"chat_template": "{{ 'x' }}"}, "chat_template", "--trust-request-chat-template"),
    ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template", "--trust-request-chat-template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ({"chat_template_kwargs": {"deep": {"a": [1]}}}, "chat_template_kwargs", "deep"),
    ({"chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs", "may not set `messages`"),
    ({"chat_template_kwargs": {"return_dict": True}}, "chat_template_kwargs", "may not set `return_dict`"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages", "a text part needs its `text`"),
])
def test_request_chat_templates_are_refused(guarded, extra, param, fragment):
    srv, _ = guarded
    response = send_bad(guarded, lambda: post(srv, "/v1/chat/completions", {**CHAT, **extra}, api_key=None))
    assert_error(response, 400, param, fragment)


def test_plain_template_variables_pass(guarded):
    srv, _ = guarded
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False, "name": "x", "n": 1.5, "none": None}}
    assert post(srv, "/v1/chat/completions", body, api_key=None).status_code == 200


def test_a_trusted_slow_template_renders_off_the_event_loop(qwen3_ckpt, tmp_path):
    slow = ("{% for i in range(100000) %}{% for j in range(30) %}{% endfor %}{% endfor %}"
            "{{ messages[0]['content'] }}")
    srv = start_server(qwen3_ckpt, tmp_path / "server.log", "--trust-request-chat-template")
    try:
        reference = post(srv, "/v1/completions", REFERENCE, api_key=None).json()["choices"][0]["text"]
        response = send_bad((srv, reference),
                            lambda: post(srv, "/v1/chat/completions", {**CHAT, "chat_template": slow}, api_key=None))
        assert response.status_code == 200, response.text
    finally:
        assert srv.stop() == 0


def test_a_grammar_past_its_fill_budget_gets_400_and_others_run_on(qwen3_ckpt, tmp_path):
    """A grammar whose bitmask takes longer than NANOVLLM_GRAMMAR_FILL_BUDGET_US to fill
    (here 1 us: every grammar) ends its request with a 400 saying why, streamed or not;
    other requests get their answers, and nothing is left held."""
    srv = start_server(qwen3_ckpt, tmp_path / "server.log", env={"NANOVLLM_GRAMMAR_FILL_BUDGET_US": "1"})
    try:
        reference = post(srv, "/v1/completions", REFERENCE, api_key=None).json()["choices"][0]["text"]
        body = {**REFERENCE, "guided_choice": ["yes", "no"]}
        response = send_bad((srv, reference), lambda: post(srv, "/v1/completions", body, api_key=None))
        assert_error(response, 400, None, "its grammar took", "NANOVLLM_GRAMMAR_FILL_BUDGET_US")
        events = httpx.post(srv.base_url + "/v1/completions", json={**body, "stream": True}, timeout=30).text
        error = json.loads(next(line[6:] for line in events.splitlines() if line.startswith('data: {"error"')))
        assert "an ambiguous grammar?" in error["error"]["message"] and events.rstrip().endswith("data: [DONE]")
        assert_idle(srv)
        assert "Traceback" not in srv.log.read_text()
    finally:
        assert srv.stop() == 0


# -- 3: budgets and fairness -----------------------------------------------------------------


@pytest.mark.parametrize(("path", "extra", "param", "limit"), [
    ("/v1/completions", {"n": MAX_N + 1}, "n", "max_n"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "max_prompts_per_request"),
    ("/v1/completions", {"stop": ["a", "b", "c"]}, "stop", "max_stop_strings"),
    ("/v1/completions", {"stop": "123456789"}, "stop", "max_stop_string_length"),
    ("/v1/completions", {"logprobs": 4}, "logprobs", "max_logprobs"),
    ("/v1/chat/completions", {"n": MAX_N + 1}, "n", "max_n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 4}, "top_logprobs", "max_logprobs"),
])
def test_request_budgets(guarded, path, extra, param, limit):
    srv, _ = guarded
    base = {"prompt": "Hi", "max_tokens": 2} if path == "/v1/completions" else CHAT
    response = send_bad(guarded, lambda: post(srv, path, {**base, **extra}, api_key=None))
    assert_error(response, 400, param, limit)


def test_the_largest_n_does_not_starve_a_later_request(guarded, qwen3_ckpt):
    """Two sequences run at a time. A request with the largest n takes both slots and
    queues its other completions; a request that arrives later runs before them, so it
    ends while the big request is still running."""
    srv, _ = guarded
    client = openai_client(srv, api_key="unused")
    events: list[str] = []
    big = client.completions.create(model=model_name(qwen3_ckpt), prompt="Once", n=MAX_N, max_tokens=40,
                                    temperature=0.8, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(big)
    next(chunks)  # the big request is running

    def small() -> None:
        client.completions.create(model=model_name(qwen3_ckpt), prompt="Hi", max_tokens=2)
        events.append("small done")

    thread = threading.Thread(target=small)
    thread.start()
    finished = 0
    for chunk in chunks:
        finished += sum(choice.finish_reason is not None for choice in chunk.choices)
    events.append("big done")
    thread.join(60)
    assert finished == MAX_N and events == ["small done", "big done"]
    assert_idle(srv)


# -- 4: numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "literal"), [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "1e999"), ("temperature", "1e308"),
    ("top_p", "NaN"),
    ("repetition_penalty", "NaN"), ("repetition_penalty", "Infinity"), ("presence_penalty", "-Infinity"),
    ("min_p", "NaN"), ("length_penalty", "NaN"),
])
def test_nan_and_infinity_are_refused(guarded, field, literal):
    srv, _ = guarded
    body = f'{{"prompt": "Hi", "max_tokens": 2, "{field}": {literal}}}'.encode()
    assert_error(send_bad(guarded, lambda: raw(srv, "/v1/completions", body)), 400, field, field)


# -- 8, 11: clients that go away or never finish ---------------------------------------------------


def connect(srv) -> socket.socket:
    url = urlparse(srv.base_url)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def test_clients_that_leave_mid_body_cost_one_debug_line(guarded):
    srv, _ = guarded
    before = len(srv.log.read_text())
    for _ in range(5):
        with connect(srv) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\":")
    time.sleep(1)
    assert post(srv, "/v1/completions", REFERENCE, api_key=None).status_code == 200
    log = srv.log.read_text()[before:]
    assert "Traceback" not in log and "ERROR" not in log, log


def test_slow_headers_are_cut_off_and_slow_bodies_get_408(guarded):
    srv, _ = guarded
    with connect(srv) as sock:  # headers that never end: closed after the header timeout (2 s)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert sock.recv(1024) == b""
    with connect(srv) as sock:  # a body that never ends: 408 after the body timeout (2 s)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer


# -- 9: what the server does not do yet --------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "paths"), [
    ("best_of", 2, "both"), ("reasoning_effort", "low", "both"), ("echo", True, "chat"),
    ("return_tokens_as_token_ids", True, "both"),
    ("tool_choice", "auto", "completions"), ("parallel_tool_calls", False, "completions"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "completions"),
])
def test_fields_not_implemented_get_400_naming_them(guarded, field, value, paths):
    srv, _ = guarded
    bases = ([("/v1/completions", {"prompt": "Hi", "max_tokens": 2})] if paths != "chat" else []) + (
        [("/v1/chat/completions", CHAT)] if paths != "completions" else [])
    for path, base in bases:
        response = post(srv, path, {**base, field: value}, api_key=None)
        assert_error(response, 400, field, field, f"not supported on {path}")
        other = {"/v1/completions": "/v1/chat/completions", "/v1/chat/completions": "/v1/completions"}[path]
        assert (f"{other} takes it" in response.json()["error"]["message"]) == (paths != "both")


def test_neutral_values_of_those_fields_are_accepted(guarded):
    srv, _ = guarded
    neutral = {"best_of": 1, "response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": True}
    assert post(srv, "/v1/chat/completions", {**CHAT, **neutral}, api_key=None).status_code == 200


# -- 10: exposure ------------------------------------------------------------------------------


def test_no_paths_in_answers_and_the_schema_without_a_key(guarded, qwen3_ckpt):
    srv, _ = guarded
    [card] = httpx.get(srv.base_url + "/v1/models").json()["data"]
    assert card["id"] == card["root"] == model_name(qwen3_ckpt)
    answer = post(srv, "/v1/completions", REFERENCE, api_key=None).json()
    assert answer["model"] == model_name(qwen3_ckpt)
    assert str(qwen3_ckpt) not in httpx.get(srv.base_url + "/metrics").text
    missing = post(srv, "/v1/completions", {**REFERENCE, "model": "other"}, api_key=None).json()["error"]["message"]
    assert str(qwen3_ckpt) not in missing
    schema = httpx.get(srv.base_url + "/openapi.json")
    assert schema.status_code == 200 and {"/v1/chat/completions", "/tokenize"} <= set(schema.json()["paths"])
    assert {"CompletionRequest", "ChatCompletionRequest"} <= set(schema.json()["components"]["schemas"])
    assert httpx.get(srv.base_url + "/docs").status_code == 404  # no page that loads scripts from a CDN


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_declared_json_gets_415(guarded, content_type):
    srv, _ = guarded
    response = raw(srv, "/v1/completions", json.dumps(REFERENCE).encode(), content_type)
    assert_error(response, 415, None, "application/json")


@pytest.mark.parametrize("body", [b'{"prompt": "Hi",', b"{not json", b'{"prompt": "Hi"} trailing', b"\xff\xfe"])
def test_a_body_that_is_not_json_gets_400(guarded, body):
    """Bodies are parsed by pydantic's JSON parser (transport.JSONRoute); what it refuses
    is answered as json.loads' refusals were."""
    srv, _ = guarded
    assert_error(send_bad(guarded, lambda: raw(srv, "/v1/completions", body)), 400, None, "the body is not valid JSON")


@pytest.mark.parametrize("escape", [rb"\ud800", rb"\udc00", rb"\ud800\u0041"])
def test_a_lone_surrogate_escape_is_named(guarded, escape):
    srv, _ = guarded
    response = raw(srv, "/v1/completions", b'{"prompt": "a' + escape + b'", "max_tokens": 1}')
    assert_error(response, 400, None, "the body is not valid JSON", "one half of a surrogate pair")


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32-le"])
def test_a_json_body_in_another_unicode_encoding_is_read(guarded, encoding):
    """As json.loads reads bytes: UTF-16 and UTF-32 bodies, and UTF-8 after a byte-order mark."""
    srv, _ = guarded
    response = raw(srv, "/v1/completions", json.dumps(REFERENCE).encode(encoding))
    assert response.status_code == 200, response.text


# -- 6: a stuck engine (5, signals, and engine death: test_server.py) ------------------------------------------------------------


def test_health_follows_the_engine_loops_heartbeat(guarded):
    srv, reference = guarded
    # One CI run found the port closed here and no engine at SIGCONT: the server had gone before.
    assert srv.process.poll() is None, "the server exited before this test:\n" + srv.log.read_text()[-4000:]
    pid = engine_pid(srv)
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while httpx.get(srv.base_url + "/health", timeout=1.0).status_code == 200:
            assert time.monotonic() < deadline, "/health still says 200 with the engine stopped"
            time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while httpx.get(srv.base_url + "/health", timeout=1.0).status_code != 200:
        assert time.monotonic() < deadline, "/health did not recover after SIGCONT"
        time.sleep(0.2)
    assert post(srv, "/v1/completions", REFERENCE, api_key=None).json()["choices"][0]["text"] == reference


# -- 7: start-up errors --------------------------------------------------------------------------


def serve_fails(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm", "serve", "--device", "cpu", *args], capture_output=True,
                          text=True, timeout=120, env=env or SERVER_ENV)


def assert_one_line(result: subprocess.CompletedProcess, status: int, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status and lines and lines[-1].startswith("nanovllm: error: "), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def test_a_host_that_does_not_resolve_is_named():
    from nanovllm.entrypoints.openai.transport import listen

    with pytest.raises(OSError, match="^cannot listen on no-such-host.invalid:8000: "):
        listen("no-such-host.invalid", 8000)


def test_start_up_errors_are_one_line(qwen3_ckpt, tmp_path):
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((qwen3_ckpt / name).read_bytes())
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in qwen3_ckpt.iterdir():
        (truncated / f.name).write_bytes(f.read_bytes()[:100] if f.suffix == ".safetensors" else f.read_bytes())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        with ThreadPoolExecutor(2) as pool:
            runs = {name: pool.submit(serve_fails, *args) for name, args in {
                "no tokenizer": (str(no_tokenizer), "--port", "0"),
                "truncated": (str(truncated), "--port", "0"),
                "port": (str(qwen3_ckpt), "--port", port),
                "empty key": (str(qwen3_ckpt), "--port", "0", "--api-key", ""),
                "no folder": (str(tmp_path / "nowhere"), "--port", "0"),
            }.items()}
            runs["empty key variable"] = pool.submit(serve_fails, str(qwen3_ckpt), "--port", "0",
                                                     env={**SERVER_ENV, "NANOVLLM_API_KEY": ""})
            results = {name: run.result() for name, run in runs.items()}
    assert_one_line(results["no tokenizer"], 2, "no tokenizer files", "tokenizer.json")
    assert_one_line(results["truncated"], 2, "cannot read the weights in", "truncated/model.safetensors")
    assert_one_line(results["port"], 1, f"127.0.0.1:{port}", "in use")
    assert "engine" not in results["port"].stderr  # refused before the model was loaded
    assert_one_line(results["empty key"], 2, "API key is empty")
    assert_one_line(results["empty key variable"], 2, "API key is empty")  # not an open server
    assert_one_line(results["no folder"], 2, "config.json")
