"""Helpers for the server tests: start `nanovllm serve` on a tiny checkpoint, talk to it."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai

from nanovllm.testing.server import ServerProcess, launch_server

API_KEY = "sk-test-key"
MODEL_NAME = "tiny-qwen3"
# Small KV blocks, so that one short request holds a few of them; 128 blocks hold the
# 32 concurrent requests below without preemption.
ENGINE_ARGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=128)
STARTUP_TIMEOUT_S = 120
# One torch thread per process: the server's engine thread, its event loop and the
# test process share two cores, and OpenMP's spinning threads would starve the others.
SERVER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# A request long enough (tokens) to be still running while the test looks at it.
LONG_MAX_TOKENS = 480


def cli_flags(engine_args: dict) -> list[str]:
    return [item for name, value in engine_args.items() for item in ("--" + name.replace("_", "-"), str(value))]


def openai_client(server: ServerProcess, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0)


def read_metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics as {name: value}, with the model_name label dropped and any other label
    kept: name{label="value"}."""
    text = httpx.get(server.base_url + "/metrics").text
    metrics = {}
    for m in re.finditer(r"^(nanovllm:\w+)(?:\{([^}]*)\})? (\S+)$", text, re.MULTILINE):
        labels = ",".join(label for label in (m[2] or "").split(",") if label and not label.startswith("model_name="))
        metrics[m[1] + (f"{{{labels}}}" if labels else "")] = float(m[3])
    return metrics


def engine_pid(server: ServerProcess) -> int:
    """The server's engine process, from its start-up log."""
    return int(re.search(r"engine process (\d+) ready", server.log.read_text())[1])


def start_server(ckpt: Path, log: Path, *flags: str, own_process_group: bool = False,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """A server on the checkpoint, ready to serve (env: more environment variables)."""
    server = launch_server(str(ckpt), [*cli_flags(ENGINE_ARGS), "--log-level", "warning", *flags], log=log,
                           env={**SERVER_ENV, **(env or {})}, own_process_group=own_process_group)
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def assert_idle(server: ServerProcess) -> None:
    """No request running or waiting and every KV block back (the engine thread publishes
    its statistics after each step, so give it a moment)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = read_metrics(server)
        idle = (metrics["nanovllm:num_requests_running"], metrics["nanovllm:num_requests_waiting"],
                metrics["nanovllm:kv_cache_blocks_used"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, metrics



def post(server: ServerProcess, path: str, body: bytes | dict, api_key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers={**headers, "Content-Type": "application/json"})
