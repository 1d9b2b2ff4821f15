"""HTTP plumbing shared by the workers and the router (torch-free): OpenAI-shaped error handlers,
the body-size limit, a bounded pool for a request's CPU work, client-disconnect detection, the
``X-Request-Id`` header, uvicorn start-up (its client connections guarded by
:mod:`.connections`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from helixserve.config import ConnectionsConfig
from helixserve.protocol import (InternalServerError, InvalidRequestError, NotFoundError,
                                 OpenAIError, PayloadTooLargeError, RequestCancelledError)
from helixserve.serving.connections import (ACCEPT_BACKLOG, ConnectionGuard, GuardedH11Protocol, GuardedServer,
                                            fd_allowed_connections)

logger = logging.getLogger(__name__)

T = TypeVar("T")
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# bodies up to this size are parsed (and their prompts tokenized) on the event loop; larger ones
# in the :class:`OffLoop` pool, so one large request does not stall /health and everyone else
OFF_LOOP_BYTES = 16 * 1024


class ClientDisconnected(RequestCancelledError):
    """The HTTP client went away before the answer was ready."""


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers or None)


class BodyLimit:
    """ASGI middleware: a request body over ``max_body_bytes`` is refused with a 413 before it is
    parsed. A declared ``Content-Length`` over the limit fails the app's first read of the body
    (before any of it is kept); a chunked body fails the read that crosses the limit. A client
    gone before its body is complete fails the read with :class:`ClientDisconnected` (499). The
    error rises in the route, so its handler and the request metrics see it like any other 4xx."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        num_declared = int(declared) if declared is not None and declared.isdigit() else None
        num_received = 0
        is_body_complete = False

        def too_large(size: str) -> PayloadTooLargeError:
            return PayloadTooLargeError(f"The request body is {size} bytes; this server accepts at "
                                        f"most {limit} bytes (limits.max_body_bytes).")

        async def limited_receive() -> dict:
            nonlocal num_received, is_body_complete
            if num_declared is not None and num_declared > limit:
                raise too_large(str(num_declared))
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                is_body_complete = not message.get("more_body", False)
                if num_received > limit:
                    raise too_large(f"more than {limit}")
            elif message["type"] == "http.disconnect" and not is_body_complete:
                raise ClientDisconnected(f"the client went away after {num_received} bytes of its request body")
            return message

        await self.app(scope, limited_receive, send)


class InternalErrors:
    """ASGI middleware: an unexpected exception before the answer started becomes a logged 500
    with OpenAI's body on a connection that stays open (Starlette's outermost handler would
    re-raise it after answering, and uvicorn would then drop the keep-alive connection). One
    raised mid-stream still ends that stream's connection: there is no other way to end it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def tracking_send(message: dict) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            if is_started:
                raise
            logger.exception("unhandled error")
            response = error_response(InternalServerError(
                f"internal error: {type(err).__name__}: {err}"))
            await response(scope, receive, send)


class OffLoop:
    """A bounded thread pool for the CPU work a request brings (parsing a large body, tokenizing,
    rendering a chat), so the event loop keeps answering ``/health`` and other requests."""

    def __init__(self, name: str, max_workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix=f"{name}-offloop")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args))

    async def run_if(self, is_large: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool when ``is_large``, else here (a thread hop costs more than
        small work)."""
        return await self.run(fn, *args) if is_large else fn(*args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def install_error_handlers(app: FastAPI) -> None:
    """Every error a client sees has OpenAI's body shape; an unexpected exception is a 500 and the
    server goes on."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, err: OpenAIError) -> Response:
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> Response:
        if err.status_code == 404:
            return error_response(NotFoundError(f"no route {err.detail!s}" if err.detail != "Not Found"
                                                else "Not found: no such route", code="not_found"))
        kind = InvalidRequestError if err.status_code < 500 else InternalServerError
        out = kind(str(err.detail), headers=err.headers)  # e.g. 405's Allow
        out.status_code = err.status_code
        return error_response(out)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(InternalServerError(f"internal error: {type(err).__name__}: {err}"))


def request_id_from(request: Request, default: str) -> str:
    """The caller's ``X-Request-Id`` (the router sets it), else ``default``; 400 if malformed."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return default
    if not _REQUEST_ID.match(value):
        raise InvalidRequestError(f"header {REQUEST_ID_HEADER} must match {_REQUEST_ID.pattern}",
                                  param=REQUEST_ID_HEADER)
    return value


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    :class:`ClientDisconnected`. Read the request body before calling this."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected("the client disconnected before the answer was ready")


def build_server(app: FastAPI, host: str, port: int, log_level: str, connections_grace_s: float,
                 connections: ConnectionsConfig) -> uvicorn.Server:
    """A ``uvicorn.Server`` for ``app`` whose client connections ``connections`` bounds (its
    :class:`~.connections.ConnectionGuard` is ``app.state.connection_guard``). SIGINT/SIGTERM run
    its shutdown; open connections get ``connections_grace_s`` (``shutdown.connections_grace_s``)."""
    guard = ConnectionGuard(connections, fd_allowed_connections(connections.max_connections))
    app.state.connection_guard = guard
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=connections_grace_s, access_log=False,
                            timeout_keep_alive=connections.timeout_keep_alive,
                            http=functools.partial(GuardedH11Protocol, guard=guard), backlog=ACCEPT_BACKLOG)
    return GuardedServer(config, guard)


def serve(app: FastAPI, host: str, port: int, log_level: str, connections_grace_s: float,
          connections: ConnectionsConfig) -> None:
    """Run ``app`` (:func:`build_server`) until SIGINT/SIGTERM."""
    build_server(app, host, port, log_level, connections_grace_s, connections).run()
