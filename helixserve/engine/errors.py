"""The engine's own errors: what :class:`~helixserve.engine.async_engine.AsyncEngine` raises to a
request's reader, and what a core (``EngineCoreLike``) or a start function may raise to refuse or
fail a request with a cause of its own.

The engine knows nothing of HTTP: each class names *what* went wrong and carries the offending
value; the servers map them to OpenAI's errors in one place
(:func:`helixserve.serving.engine_errors.to_openai_error`). Every error carries ``message`` and
an optional machine-readable ``code`` (e.g. ``"gen_world_failed"``) and ``param`` that the
mapping keeps. Refusals of the request as asked subclass ``ValueError`` (callers that catch
``ValueError`` from ``add_request`` keep working).
"""

from __future__ import annotations

from typing import ClassVar


class EngineError(Exception):
    """Base of every error the engine hands to a request's reader."""

    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param

    def __repr__(self) -> str:
        return f"{type(self).__name__}(message={self.message!r}, code={self.code!r}, param={self.param!r})"


class RequestRejectedError(EngineError, ValueError):
    """The request cannot run as asked (too long for the cache, bad ids, ...): the caller's fault."""


class DuplicateRequestIdError(RequestRejectedError):
    """A request with this id is already live here."""

    default_code = "duplicate_request_id"

    def __init__(self, message: str, *, request_id: str, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.request_id = request_id


class EngineQueueFullError(EngineError):
    """Admission refused: ``num_live`` requests are running or waiting, ``capacity`` allowed."""

    default_code = "queue_full"

    def __init__(self, num_live: int, capacity: int) -> None:
        super().__init__(f"the engine queue is full ({num_live} requests running or waiting, "
                         f"capacity {capacity}); retry later")
        self.num_live = num_live
        self.capacity = capacity


class EngineUnavailableError(EngineError):
    """The engine cannot serve: not running, shutting down, or its world failed (``code`` says
    which, e.g. ``"gen_world_failed"``)."""


class KVTransferError(EngineError):
    """A request's KV transfer failed (``code`` ``"kv_transfer_failed"`` by default)."""

    default_code = "kv_transfer_failed"


class KVTransferTimeoutError(KVTransferError):
    """A request's KV transfer did not finish within its deadline."""

    default_code = "kv_transfer_timeout"


class RequestFailedError(EngineError):
    """A request failed inside the engine for a reason that is not the caller's (a bug, a start
    function that raised)."""


class StepFailedError(RequestFailedError):
    """The engine step this request was in raised; the message names the exception."""

    default_code = "engine_error"


class RequestAbortedError(EngineError):
    """The request was aborted (:meth:`AsyncEngine.abort`, e.g. its client went away)."""

    default_code = "request_cancelled"

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
