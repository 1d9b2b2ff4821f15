"""HTTP plumbing shared by the workers and the router (torch-free): OpenAI-shaped error handlers,
client-disconnect detection, the ``X-Request-Id`` header, uvicorn start-up."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from helixserve.protocol import (InternalServerError, InvalidRequestError, NotFoundError,
                                 OpenAIError, RequestCancelledError)

logger = logging.getLogger(__name__)

T = TypeVar("T")
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ClientDisconnected(RequestCancelledError):
    """The HTTP client went away before the answer was ready."""


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code)


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
        out = kind(str(err.detail))
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


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """Run ``app`` with uvicorn until SIGINT/SIGTERM (which run its shutdown)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=10, access_log=False)
    uvicorn.Server(config).run()
