"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLMEngine, run by uvicorn.

    GET  /health                 200 while the engine answers (a heartbeat), else 503 (HEAD too)
    GET  /metrics                Prometheus text format (see metrics.py)
    GET  /version                nanovllm's version
    GET  /v1/models              the served model name(s); /v1/models/{model} one of them
    POST /v1/completions         prompt: a string, strings, token ids or token-id lists
    POST /v1/chat/completions    messages, rendered with the tokenizer's chat template
    POST /tokenize               vLLM's: a prompt or chat messages -> token ids
    POST /detokenize             vLLM's: token ids -> text

With an API key, /v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY` (and
there is no /openapi.json; without one it describes every route and body).
POST bodies must be JSON (415 otherwise) and within the size limit (413). Every error is
an OpenAI error body: {"error": {"message", "type", "param", "code"}}. If the engine
process dies, running requests fail with 503 and the server exits with status 1, for a
supervisor to restart it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import logging
import os
import re
import signal
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanovllm import __version__
from nanovllm.demo import model_name
from nanovllm.entrypoints.openai import DEFAULT_SHUTDOWN_TIMEOUT_S
from nanovllm.entrypoints.openai.limits import (
    ResponseOptions, ServerLimits, check_access_flags, check_tool_call_parser,
)
from nanovllm.entrypoints.openai.metrics import ServerMetrics, log_stats
from nanovllm.entrypoints.openai.errors import APIError
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from nanovllm.entrypoints.openai.responses import json_body
from nanovllm.entrypoints.openai.serving_chat import ChatServing
from nanovllm.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from nanovllm.entrypoints.openai.transport import BodyGuard, JSONRoute, Server, header_timeout_protocol, listen
from nanovllm.inputs import load_chat_template
from nanovllm.serving.async_engine import AsyncLLMEngine
from nanovllm.serving.engine_client import EngineClient
from nanovllm.serving.replicas import build_replicas
from nanovllm.serving.router import ReplicaRouter
from nanovllm.serving.spawn import EngineProcess
from nanovllm.utils.log import process_age_s
from nanovllm.utils.pickling import freeze_startup_objects

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

# After the shutdown timeout, requests still running are aborted and their clients get
# finish_reason "abort" and a proper end; uvicorn cancels whatever is still running this
# much later.
ABORTED_RESPONSE_GRACE_S = 5.0
# A client that went away before its response: nginx's "client closed request". Nobody
# reads it; it only shows in the access log.
CLIENT_CLOSED_REQUEST = 499


class EngineDied(RuntimeError):
    """The server stopped because its engine process died."""


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status)


# The names pydantic gives the members of a union in an error's location ("list[int]",
# "ContentPart"): our types, not the API's fields, so they are left out of messages.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|[a-z]+\[.*\]|[A-Z]\w*)$")


def validation_error(problems: list[dict]) -> APIError:
    """A 400 naming the first fields that failed to parse (malformed JSON has no field).
    A field that matches none of the forms it may take gets one message, not one per form."""
    if problems[0]["type"] == "json_invalid":
        error = problems[0].get("ctx", {}).get("error", problems[0]["msg"])
        if "hex escape" in error:  # the parser's words for a \ud800-\udfff escape that is not half of a pair
            error += " (an escape in \\ud800-\\udfff must be one half of a surrogate pair, high then low)"
        return APIError(400, f"the body is not valid JSON: {error}")
    by_field: dict[str, list[str]] = {}
    for problem in problems:
        loc = problem["loc"][1:] if problem["loc"][:1] == ("body",) else problem["loc"]
        place = ".".join(str(x) for x in loc if not (isinstance(x, str) and _UNION_MEMBER.match(x)))
        by_field.setdefault(place or "body", []).append(problem["msg"])
    parts = [f"{place}: {messages[0] if len(messages) == 1 else 'matches none of the forms this field may take'}"
             for place, messages in list(by_field.items())[:3]]
    first = next(iter(by_field))
    return APIError(400, "; ".join(parts), param=first.split(".")[0] if first != "body" else None)


async def require_json(request: Request) -> None:
    """POST bodies are JSON: a form or text/plain body (what a web page can send to a
    loopback server without asking) is refused before anything runs."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, "the request body must be JSON, sent with `Content-Type: application/json`")


@dataclass(frozen=True)
class HTTPOptions:
    """How the server meets HTTP, with vLLM's flags: root_path (behind a proxy that serves it
    under a path prefix), TLS from a key and a certificate file, and CORS for browsers on
    other origins (allowed_origins; none unless given, where vLLM allows any)."""

    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def create_app(engine: EngineClient, served_model_names: list[str], api_key: str | None = None,
               limits: ServerLimits = ServerLimits(), responses: ResponseOptions = ResponseOptions(),
               log_stats_interval: float = 0.0, http: HTTPOptions = HTTPOptions()) -> FastAPI:
    """The app; it starts reading the engine's outputs at start-up and shuts the engine down at exit."""
    serving = ChatServing(engine, served_model_names, limits, responses)
    metrics = ServerMetrics(engine, served_model_names[0])
    engine.on_finished = metrics.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        metrics.server_ready_s = process_age_s()
        logger.info("serving %.1f s after this process started", metrics.server_ready_s)
        freeze_startup_objects()
        stats = asyncio.ensure_future(log_stats(engine, log_stats_interval)) if log_stats_interval else None
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            engine.shutdown()

    # No interactive docs (they load from a CDN); the schema only when no key guards the API.
    app = FastAPI(title="nanovllm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None if api_key else "/openapi.json")
    if http.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(http.allowed_origins),
                           allow_methods=list(http.allowed_methods), allow_headers=list(http.allowed_headers),
                           allow_credentials=http.allow_credentials)

    _install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that send it
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    app.include_router(_api_router(serving, served_model_names, api_key))
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body: ours (APIError), a body that fails validation,
    Starlette's (unknown route, wrong method, 408, 413) and anything unexpected (500)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc.__cause__, ClientDisconnect):  # gone while sending its body: nobody to answer
            logger.debug("%s %s: the client went away while sending the body", request.method, request.url.path)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return error_response(APIError(exc.status_code, str(exc.detail)))  # unknown route, wrong method, 408, 413

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:  # uvicorn logs the traceback
        response = error_response(APIError(500, "internal server error (the server's log has the details)"))
        response.headers["Connection"] = "close"  # uvicorn closes it after an exception: the client must know
        return response


def _api_router(serving: ChatServing, served_model_names: list[str], api_key: str | None) -> APIRouter:
    """The OpenAI-compatible routes, each behind the API key where one is set."""

    def check_api_key(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not _same_key(token, api_key):
            raise APIError(401, "invalid or missing API key: send the header `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    class KeyedRoute(JSONRoute):  # the key checked before the body is read (vLLM's order)
        guard = staticmethod(check_api_key) if api_key is not None else None

    keyed = APIRouter(route_class=KeyedRoute)
    posted = [Depends(require_json)]

    def card(name: str) -> ModelCard:  # root: the name, not the checkpoint's path (vLLM's): no paths in answers
        return ModelCard(id=name, root=name, max_model_len=serving.max_model_len, vocab_size=serving.vocab_size)

    @keyed.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in served_model_names])

    @keyed.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        serving.check_model(model)
        return card(model)

    async def respond(result) -> Response:
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(result, BaseModel):
            return Response(await json_body(result), media_type="application/json")
        return StreamingResponse(result, media_type="text/event-stream")

    @keyed.post("/v1/completions", dependencies=posted, response_model=CompletionResponse)
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await respond(await serving.create_completion(request, raw_request))

    @keyed.post("/v1/chat/completions", dependencies=posted, response_model=ChatCompletionResponse)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await respond(await serving.create_chat_completion(request, raw_request))

    @keyed.post("/tokenize", dependencies=posted)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(request)

    @keyed.post("/detokenize", dependencies=posted)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(request)

    return keyed


def _same_key(token: str, api_key: str) -> bool:
    import secrets

    return secrets.compare_digest(token.encode(), api_key.encode())


def dump_stacks_on_sigusr1(engine_pids: list[int]) -> None:
    """`kill -USR1 <server pid>` prints every thread's stack of this process and of the
    engine processes to stderr: what a stalled server is doing, without stopping it."""
    if threading.current_thread() is not threading.main_thread():
        return

    def forward(*_) -> None:
        for pid in engine_pids:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:  # an engine process that has ended
                pass

    signal.signal(signal.SIGUSR1, forward)
    # At once, from C, even while the event loop is stuck; then the Python handler above.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)


# The engine's messages are read by a thread that must take the interpreter lock from the
# event loop, which is busy with the streams; at Python's default interval (5 ms) every read
# of the pipe could wait that long while the engine process waits to send its next step.
GIL_SWITCH_INTERVAL_S = 0.0005


@contextlib.contextmanager
def _killed_on_failure(engine_process: EngineProcess | None):
    """Kill engine_process if what the block does raises before an AsyncLLMEngine took it
    over (that one stops its process itself, and closes the pipe)."""
    try:
        yield
    except BaseException:
        if engine_process is not None and not engine_process.conn.closed:
            engine_process.kill()
        raise


def serve(model: str, engine_args: dict, host: str, port: int, api_key: str | None = None,
          served_model_names: list[str] | None = None, log_level: str = "info",
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, limits: ServerLimits = ServerLimits(),
          responses: ResponseOptions = ResponseOptions(), access_log: bool = True, log_stats_interval: float = 5.0,
          tool_call_parser: str | None = None,
          dp_routing: str = "prefix-affinity", engine_process: EngineProcess | None = None,
          http: HTTPOptions = HTTPOptions()) -> None:
    """Serve LLMEngine(model, **engine_args), built in an engine process, until SIGINT or
    SIGTERM, then shut down cleanly (exit status 0). Start-up errors raise here: the port
    is taken before waiting for the model. Raises EngineDied if the engine process dies.

    responses: what answers hold (ResponseOptions), its chat_template a template or a file
    holding one. tool_call_parser: the format (hermes) in which the model's tool calls are
    read, which responses.enable_auto_tool_choice needs.
    access_log: uvicorn's line per request. log_stats_interval: seconds between the
    statistics lines while busy (0: none). dp_routing: how requests are spread over the
    replicas of data_parallel_size > 1 (serving/router.py). engine_process: the engine
    process for (model, engine_args), already started (one replica only); stopped here if
    the server cannot start. http: root path, TLS and CORS (HTTPOptions)."""
    with _killed_on_failure(engine_process):
        check_access_flags(http.ssl_keyfile, http.ssl_certfile, api_key)
        check_tool_call_parser(responses, tool_call_parser)
        responses = dataclasses.replace(responses, chat_template=load_chat_template(responses.chat_template))
        names = served_model_names or [model_name(model)]
        sock = listen(host, port)
        try:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            engine_args = dict(engine_args)  # the caller's stays as given
            data_parallel_size = engine_args.pop("data_parallel_size", 1)
            if data_parallel_size > 1:
                if engine_process is not None:
                    raise ValueError("an engine process started beforehand serves one replica, "
                                     "not data_parallel_size > 1")
                replicas = build_replicas(model, engine_args, data_parallel_size)
                engine = ReplicaRouter(replicas, replicas[0].config.kvcache_block_size, dp_routing)
            else:
                replicas = [engine := AsyncLLMEngine(model, engine_args, process=engine_process)]
            dump_stacks_on_sigusr1([replica.pid for replica in replicas])
            try:
                app = create_app(engine, names, api_key, limits, responses, log_stats_interval, http)
                # log_config=None: uvicorn's lines go to the root logger, in nanovllm's format.
                config = uvicorn.Config(BodyGuard(app, limits.max_request_body_bytes, limits.request_body_timeout),
                                        log_config=None, log_level=log_level, access_log=access_log,
                                        http=header_timeout_protocol(limits.request_header_timeout),
                                        timeout_graceful_shutdown=shutdown_timeout + ABORTED_RESPONSE_GRACE_S,
                                        root_path=http.root_path, ssl_keyfile=http.ssl_keyfile,
                                        ssl_certfile=http.ssl_certfile)
                server = Server(config, engine.abort_all, shutdown_timeout)
                engine.on_stopped = lambda reason: server.stop(reason)
                logger.info("model %s served as %s", model, ", ".join(names))
                server.run(sockets=[sock])
            finally:
                engine.shutdown()  # already done by the app's lifespan, unless uvicorn failed to start
        finally:
            sock.close()
        if server.stopped_because is not None:
            raise EngineDied(f"{server.stopped_because}; the server has exited so that a supervisor can restart it")


if __name__ == "__main__":  # vLLM's older spelling of `serve`: python -m nanovllm.entrypoints.openai.api_server ...
    import runpy

    sys.argv[1:1] = ["serve"]
    # The `nanovllm` command, as __main__ (alter_sys): the engine process, spawned, then
    # imports no main module again (multiprocessing skips a package's __main__).
    runpy.run_module("nanovllm", run_name="__main__", alter_sys=True)
