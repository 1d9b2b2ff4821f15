"""The one place where the engine's errors (:mod:`helixserve.engine.errors`) become OpenAI/HTTP
errors (:mod:`helixserve.protocol.errors`).

============================  ======  ==============================================
engine error                  status  OpenAI error (``code`` unless the error has one)
============================  ======  ==============================================
``RequestRejectedError``      400     ``InvalidRequestError`` (``duplicate_request_id``
                                      for ``DuplicateRequestIdError``)
``RequestAbortedError``       499     ``RequestCancelledError`` (``request_cancelled``)
``EngineQueueFullError``      429     ``QueueFullError`` (``queue_full``, ``Retry-After``)
``RequestFailedError``        500     ``InternalServerError`` (``internal_error``;
                                      ``engine_error`` for ``StepFailedError``)
``EngineUnavailableError``    503     ``ServiceUnavailableError`` (``service_unavailable``,
                                      or the core's, e.g. ``gen_world_failed``)
``KVTransferError``           503     ``ServiceUnavailableError`` (``kv_transfer_failed``)
``KVTransferTimeoutError``    504     ``GatewayTimeoutError`` (``kv_transfer_timeout``)
============================  ======  ==============================================

Message, ``code`` and ``param`` pass through unchanged. :func:`openai_outputs` wraps an
``AsyncEngine.generate`` stream so that its reader (the HTTP handlers, SSE) only sees
:class:`OpenAIError` s; :func:`install_engine_error_handler` answers any other engine error that
reaches a route (e.g. from ``AsyncEngine.call``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from helixserve.engine.errors import (EngineError, EngineQueueFullError, EngineUnavailableError,
                                      KVTransferError, KVTransferTimeoutError, RequestAbortedError,
                                      RequestFailedError, RequestRejectedError)
from helixserve.protocol.errors import (GatewayTimeoutError, InternalServerError, InvalidRequestError,
                                        OpenAIError, QueueFullError, RequestCancelledError,
                                        ServiceUnavailableError)
from helixserve.serving.http import error_response

T = TypeVar("T")

# most specific first: the first class an error is an instance of picks its OpenAI class
_OPENAI_CLASS: tuple[tuple[type[EngineError], type[OpenAIError]], ...] = (
    (RequestRejectedError, InvalidRequestError),
    (RequestAbortedError, RequestCancelledError),
    (EngineQueueFullError, QueueFullError),
    (KVTransferTimeoutError, GatewayTimeoutError),
    (KVTransferError, ServiceUnavailableError),
    (EngineUnavailableError, ServiceUnavailableError),
    (RequestFailedError, InternalServerError),
)


def to_openai_error(err: EngineError) -> OpenAIError:
    """The OpenAI error a client sees for ``err`` (table in the module docstring); an engine
    error of no listed kind is a 500."""
    cls = next((o for e, o in _OPENAI_CLASS if isinstance(err, e)), InternalServerError)
    return cls(err.message, param=err.param, code=err.code)


async def openai_outputs(outputs: AsyncIterator[T]) -> AsyncIterator[T]:
    """``outputs`` with every :class:`EngineError` re-raised as its :class:`OpenAIError`; closing
    this closes ``outputs`` (so a reader that leaves still aborts the request)."""
    async with contextlib.aclosing(outputs):  # type: ignore[type-var]
        try:
            async for out in outputs:
                yield out
        except EngineError as err:
            raise to_openai_error(err) from err


def install_engine_error_handler(app: FastAPI) -> None:
    """Answer an :class:`EngineError` that reaches a route with its OpenAI error."""

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, err: EngineError) -> Response:
        return error_response(to_openai_error(err))
