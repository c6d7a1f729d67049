"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLMEngine, run by uvicorn.

    GET  /health                 200 while the engine process runs, else 503
    GET  /metrics                Prometheus text format (see metrics.py)
    GET  /v1/models              the served model name(s)
    POST /v1/completions         prompt: a string, strings, token ids or token-id lists
    POST /v1/chat/completions    messages, rendered with the tokenizer's chat template

With an API key, /v1/* needs `Authorization: Bearer KEY`. Every error is an OpenAI error
body: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import secrets
import signal
import sys
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.serving.async_engine import AsyncLLMEngine
from nanovllm.entrypoints.openai import DEFAULT_SHUTDOWN_TIMEOUT_S
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from nanovllm.entrypoints.openai.serving import APIError, OpenAIServing
from nanovllm.utils.pickling import freeze_startup_objects

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

# On SIGINT / SIGTERM the server stops accepting connections and lets running requests
# finish for shutdown_timeout seconds (DEFAULT_SHUTDOWN_TIMEOUT_S); then it aborts them,
# and their clients get finish_reason "abort" and a proper end. uvicorn cancels whatever
# is still running this much later.
ABORTED_RESPONSE_GRACE_S = 5.0
# A client that went away before its response: nginx's "client closed request". Nobody
# reads it; it only shows in the access log.
CLIENT_CLOSED_REQUEST = 499


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status)


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first fields that failed to parse (malformed JSON has no field)."""
    problems = exc.errors(include_url=False)
    if problems[0]["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {problems[0]['msg']}")
    parts = [f"{'.'.join(map(str, p['loc'])) or 'body'}: {p['msg']}" for p in problems[:3]]
    loc = problems[0]["loc"]
    return APIError(400, "; ".join(parts), param=str(loc[0]) if loc else None)


async def parse_body(raw_request: Request, model: type[T]) -> T:
    try:
        return model.model_validate_json(await raw_request.body())
    except ValidationError as exc:
        raise validation_error(exc) from None


def create_app(engine: AsyncLLMEngine, served_model_names: list[str], api_key: str | None = None) -> FastAPI:
    """The app; it starts reading the engine's outputs at start-up and shuts the engine down at exit."""
    serving = OpenAIServing(engine, served_model_names)
    metrics = ServerMetrics(engine, served_model_names[0])
    engine.on_finished = metrics.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        freeze_startup_objects()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="nanovllm", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, wrong method
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))

    async def check_api_key(request: Request) -> None:  # async: FastAPI runs a plain def in a thread pool
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send the header `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.config.model, max_model_len=serving.max_model_len)
                               for name in served_model_names])

    def respond(result) -> Response:
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json")
        return StreamingResponse(result, media_type="text/event-stream")

    @v1.post("/completions")
    async def completions(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return respond(await serving.create_completion(request, raw_request))

    @v1.post("/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        return respond(await serving.create_chat_completion(request, raw_request))

    app.include_router(v1)
    return app


class Server(uvicorn.Server):
    """uvicorn's server with a clean stop on SIGINT / SIGTERM: requests still running
    shutdown_timeout seconds after the signal are aborted through the engine rather than
    cancelled mid-response, and the signal is not raised again once the server has shut
    down, so the process exits with status 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in self.servers:  # the bound address: with port 0, the only place to learn the port
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                logger.info("serving on http://%s:%d", host, port)

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    @contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def dump_stacks_on_sigusr1(engine_pid: int) -> None:
    """`kill -USR1 <server pid>` prints every thread's stack of this process and of the
    engine process to stderr: what a stalled server is doing, without stopping it."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGUSR1, lambda *_: os.kill(engine_pid, signal.SIGUSR1))
    # At once, from C, even while the event loop is stuck; then the Python handler above.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)


# The engine's messages are read by a thread that must take the interpreter lock from the
# event loop, which is busy with the streams; at Python's default interval (5 ms) every read
# of the pipe could wait that long while the engine process waits to send its next step.
GIL_SWITCH_INTERVAL_S = 0.0005


def serve(model: str, engine_args: dict, host: str, port: int, api_key: str | None = None,
          served_model_names: list[str] | None = None, log_level: str = "info",
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
    """Serve LLM(model, **engine_args), built in an engine process, until SIGINT or SIGTERM,
    then shut down cleanly (exit status 0). The engine's start-up errors raise here."""
    names = served_model_names or [model]
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    engine = AsyncLLMEngine(model, engine_args)
    dump_stacks_on_sigusr1(engine.pid)
    try:
        app = create_app(engine, names, api_key)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=shutdown_timeout + ABORTED_RESPONSE_GRACE_S)
        logger.info("model %s served as %s", model, ", ".join(names))
        Server(config, engine, shutdown_timeout).run()
    finally:
        engine.shutdown()  # already done by the app's lifespan, unless uvicorn failed to start
