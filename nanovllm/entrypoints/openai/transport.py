"""The HTTP server's guards below the routes: the listening socket, a body-size limit,
time limits for slow clients, and uvicorn's run with a clean stop on signals.

- The socket is bound before the engine is built, so a port in use fails at once.
- A body over the limit gets 413 without being read: at once when Content-Length says
  so, else as soon as what has arrived passes the limit.
- A connection must deliver a request's headers within a time limit of its start, or it
  is closed, and its body within another, or it gets 408: half-open connections do not
  pile up. Both are ServerLimits.
- JSON bodies are parsed by pydantic's parser (JSONRoute), faster than json.loads on long
  token-id prompts: a burst of requests reaches the engine sooner.
- A handler's waits (a grammar's compile, a request's run) end when its client leaves
  (unless_client_leaves).
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
from collections.abc import Callable, Coroutine
from contextlib import contextmanager
from typing import Any

import pydantic_core
import uvicorn
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from nanovllm.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), for uvicorn to serve on."""
    if not 0 <= port <= 65535:
        raise ValueError(f"the port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:  # a host name that does not resolve
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class JSONRequest(Request):
    """Starlette's Request with its JSON body parsed by pydantic_core (Rust). Bodies in
    UTF-16 or UTF-32, or after a UTF-8 byte-order mark, are read as json.loads reads them.
    A body that does not parse (nested over 200 levels deep, too) raises
    json.JSONDecodeError, as json.loads would, so FastAPI answers it as before: a 400
    through the app's validation handler."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                encoding = json.detect_encoding(body)
                self._json = pydantic_core.from_json(body if encoding == "utf-8" else body.decode(encoding))
            except ValueError as exc:  # UnicodeDecodeError included
                raise json.JSONDecodeError(str(exc), body.decode(errors="replace"), 0) from None
        return self._json


class JSONRoute(APIRoute):
    """A route whose handler reads its request as a JSONRequest, after `guard` (where a
    subclass sets one) has seen the request's headers: a check that raises (the API key's)
    answers before the body is read or parsed."""

    guard: Callable[[Request], None] | None = None

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_with_pydantic(request: Request) -> Response:
            if self.guard is not None:
                self.guard(request)
            return await handler(JSONRequest(request.scope, request.receive))

        return parse_with_pydantic


class BodyGuard:
    """ASGI middleware: 413 for request bodies over max_bytes, 408 for bodies that take
    longer than timeout seconds to arrive. Raised as HTTPExceptions from the body's read,
    which the framework passes on to the app's error handler."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            status = 413 if length.isdigit() else 400
            return await _send_error(send, status, f"the request body ({length.decode(errors='replace')} bytes) "
                                     f"exceeds this server's max_request_body_bytes of {self.max_bytes} "
                                     f"(--max-request-body-bytes)" if status == 413 else "bad Content-Length")
        received = 0
        deadline: float | None = None  # while the body is arriving
        done = False

        async def guarded_receive():
            nonlocal received, deadline, done
            if done:  # the body is in: what follows is the wait for a disconnect
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.timeout:g} s "
                                         f"(--request-body-timeout)") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, f"the request body exceeds this server's max_request_body_bytes of "
                                             f"{self.max_bytes} (--max-request-body-bytes)")
                done = not message.get("more_body", False)
            return message

        await self.app(scope, guarded_receive, send)


async def _send_error(send, status: int, message: str) -> None:
    """An OpenAI error body, sent straight through ASGI (before any route runs)."""
    body = APIError(status, message).body().model_dump_json().encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(timeout: float) -> type | str:
    """uvicorn's httptools protocol, closing connections whose request headers take
    longer than `timeout` seconds; "auto" (no header limit) without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        logger.warning("httptools is missing: slow clients' headers are not timed out (pip install httptools)")
        return "auto"

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = asyncio.get_running_loop().call_later(timeout, self.transport.close)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:  # each request of a kept-alive connection
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class Server(uvicorn.Server):
    """uvicorn's server with a clean stop on SIGINT / SIGTERM: requests still running
    shutdown_timeout seconds after the signal are aborted (`abort_all`) rather than
    cancelled mid-response, and the signal is not raised again once the server has shut
    down, so the process exits with status 0. stop(reason) ends it from inside."""

    def __init__(self, config: uvicorn.Config, abort_all, shutdown_timeout: float):
        super().__init__(config)
        self.abort_all = abort_all
        self.shutdown_timeout = shutdown_timeout
        self.stopped_because: str | None = None

    def stop(self, reason: str) -> None:
        """Shut down as on SIGTERM, remembering why (the engine died)."""
        self.stopped_because = reason
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in self.servers:  # the bound address: with port 0, the only place to learn the port
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                logger.info("serving on http://%s:%d", host, port)

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.abort_all)
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


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the request body must have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(future: asyncio.Future, raw_request: Request) -> bool:
    """Wait for future: True once it is done; False if raw_request's client left first. Either
    way (or if this wait is cancelled) the future is cancelled unless done."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait((future, disconnect), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        future.cancel()  # a no-op once done
    return future in done
