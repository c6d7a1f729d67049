"""`nanovllm run-batch -i requests.jsonl -o results.jsonl`: OpenAI's batch file format on the
local engine.

Each input line is one request, `{"custom_id": ..., "method": "POST", "url":
"/v1/completions" | "/v1/chat/completions", "body": {...}}`. Each output line, in input
order, is `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`:
a request the server answered has its response (a 400 too, with the server's error body);
a line that is not such a request has `response` null and `error` saying why. The requests
go through the very app `nanovllm serve` runs (in this process, without a socket), so
checks, errors and outputs are the server's; with -dp N, over its N replicas. With --ray
(integrations/ray.py) Ray Data hands batches of lines to BatchAnswerers on a cluster.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import uuid
from typing import Any

import httpx
from tqdm import tqdm

from nanovllm.entrypoints.openai.api_server import create_app
from nanovllm.entrypoints.openai.limits import ResponseOptions
from nanovllm.serving.async_engine import AsyncLLMEngine
from nanovllm.serving.loop_call import call_in_loop
from nanovllm.serving.replicas import build_replicas
from nanovllm.serving.router import ReplicaRouter

URLS = ("/v1/completions", "/v1/chat/completions")
# Requests handed to the engine at once; the engine's own scheduler batches them.
MAX_IN_FLIGHT = 512


def parse_line(line: str, number: int) -> tuple[Any, str, dict]:
    """(custom_id, url, body) of one input line; ValueError naming what is wrong."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number} is not JSON: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"line {number} is nested too deeply") from None
    if not isinstance(item, dict):
        raise ValueError(f"line {number} is not a JSON object")  # noqa: TRY004 (a bad line, told as every other)
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if item.get("method", "POST") != "POST":
        raise ValueError(f"line {number}: method must be POST, got {item.get('method')!r}")
    if url not in URLS:
        raise ValueError(f"line {number}: url must be one of {', '.join(URLS)}, got {url!r}")
    if not isinstance(body, dict):
        raise ValueError(f"line {number}: body must be a JSON object")  # noqa: TRY004
    if body.get("stream"):
        raise ValueError(f"line {number}: a batch request cannot stream")
    return custom_id, url, body


def result(custom_id: Any, response: dict | None = None, error: str | None = None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": None if error is None else {"code": "invalid_request", "message": error}}


async def answer_all(app, lines: list[tuple[int, str]], model_name: str, progress: tqdm | None = None) -> list[dict]:
    """The result of every (line number, line), in order."""
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:

        async def answer(number: int, line: str) -> dict:
            try:
                custom_id, url, body = parse_line(line, number)
            except ValueError as exc:
                _advance(progress)
                return result(_custom_id_of(line), error=str(exc))
            body.setdefault("model", model_name)
            async with gate:
                response = await client.post(url, json=body)
            _advance(progress)
            return result(custom_id, {"status_code": response.status_code, "request_id": f"req_{uuid.uuid4().hex}",
                                      "body": response.json()})

        return await asyncio.gather(*(answer(i, line) for i, line in lines))


def _advance(progress: tqdm | None) -> None:
    if progress is not None:
        progress.update()


def _custom_id_of(line: str) -> Any:
    """The custom_id of a line that is not a valid request, where one can be read."""
    try:
        item = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    return item.get("custom_id") if isinstance(item, dict) else None


class BatchAnswerer:
    """The server's app over an engine (or -dp N replicas), running on an event loop of its
    own between calls, so that it answers one list of lines after another: run_batch's
    whole file here, or each batch of Ray Data's under --ray (integrations/ray.py)."""

    def __init__(self, model: str, engine_args: dict, served_model_name: str,
                 responses: ResponseOptions = ResponseOptions()):
        engine_args = dict(engine_args)
        data_parallel_size = engine_args.pop("data_parallel_size", 1)
        if data_parallel_size > 1:  # the server's replicas and router, in this process
            replicas = build_replicas(model, engine_args, data_parallel_size)
            self.engine = ReplicaRouter(replicas, replicas[0].config.kvcache_block_size)
        else:
            self.engine = AsyncLLMEngine(model, engine_args)
        self.served_model_name = served_model_name
        self.app = create_app(self.engine, [served_model_name], responses=responses)
        self._lifespan = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nanovllm-run-batch", daemon=True)
        self._thread.start()
        try:
            lifespan = self.app.router.lifespan_context(self.app)  # starts the engine's output reader
            self._call(lifespan.__aenter__())
            self._lifespan = lifespan
        except BaseException:
            self.shutdown()
            raise

    def _call(self, coroutine):
        return call_in_loop(self._loop, coroutine)

    def answer(self, lines: list[tuple[int, str]], progress: tqdm | None = None) -> list[dict]:
        """The result of every (line number, line), in order."""
        return self._call(answer_all(self.app, lines, self.served_model_name, progress))

    def shutdown(self) -> None:
        """Stop the engine and the event loop. Safe to call twice."""
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            self._call(lifespan.__aexit__(None, None, None))  # stops the engine
        self.engine.shutdown()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()


def open_utf8(path: str, mode: str = "r"):
    """A file opened as UTF-8 text, as JSON Lines are, whatever the locale says; "-" is
    standard input (mode "r") or output, left open (and, where a caller has replaced it
    with a stream of its own, that stream as it is)."""
    if path == "-":
        stream = sys.stdin if mode == "r" else sys.stdout
        try:
            descriptor = stream.fileno()
        except (AttributeError, OSError):  # io.UnsupportedOperation too
            return contextlib.nullcontext(stream)
        stream.flush()
        return open(descriptor, mode, encoding="utf-8", closefd=False)
    return open(path, mode, encoding="utf-8")


def read_lines(input_path: str) -> list[tuple[int, str]]:
    """The input's lines that are not blank, with their line numbers in it."""
    try:
        with open_utf8(input_path) as f:
            return [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as exc:
        raise ValueError(f"the input file {input_path!r} is not UTF-8 text: {exc}") from None


def write_results(output_path: str, results: list[dict]) -> tuple[int, int]:
    """Write one result per line; returns (lines, lines with an error or a non-200 response)."""
    with open_utf8(output_path, "w") as f:
        f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in results)
    failed = sum(item["error"] is not None or item["response"]["status_code"] != 200 for item in results)
    return len(results), failed


def run_batch(model: str, engine_args: dict, input_path: str, output_path: str, served_model_name: str,
              responses: ResponseOptions = ResponseOptions(), use_tqdm: bool = True) -> tuple[int, int]:
    """Answer every request of `input_path` into `output_path`; returns (lines, lines with
    an error or a non-200 response). responses: what answers hold, as `nanovllm serve`'s."""
    lines = read_lines(input_path)
    answerer = BatchAnswerer(model, engine_args, served_model_name, responses)
    try:
        with tqdm(total=len(lines), desc="requests", disable=not use_tqdm) as progress:
            results = answerer.answer(lines, progress)
    finally:
        answerer.shutdown()
    return write_results(output_path, results)
