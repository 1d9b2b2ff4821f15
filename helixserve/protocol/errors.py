"""OpenAI-shaped errors: one exception class per HTTP status the servers answer with.

Every error a client sees has OpenAI's body shape::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Servers raise an :class:`OpenAIError` subclass anywhere in a request's path; the HTTP layer turns it
into ``(err.status_code, err.body())`` (or :func:`sse_error` inside a stream). Request parsing goes
through :func:`parse_model`, which turns malformed JSON and pydantic ``ValidationError`` s into a
400 :class:`InvalidRequestError` whose ``param`` names the offending field (``"temperature"``,
``"messages[1].content"``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import from_json

ModelT = TypeVar("ModelT", bound=BaseModel)

# ``PydanticCustomError`` kinds raised by helixserve's validators (never used by pydantic itself)
OWN_ERROR_KINDS = frozenset({"invalid_value", "invalid_type", "unsupported_parameter"})


class ErrorInfo(BaseModel):
    """The inside of an error body (documents the shape; :func:`error_body` builds it)."""

    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``: every 4xx / 5xx answer's body."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorInfo


class OpenAIError(Exception):
    """Base error: carries the HTTP status and the fields of OpenAI's error body."""

    status_code: int = 500
    error_type: str = "server_error"
    default_code: ClassVar[str | None] = None
    default_headers: ClassVar[Mapping[str, str]] = {}

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        if error_type is not None:
            self.error_type = error_type
        self.headers: dict[str, str] = {**self.default_headers, **(headers or {})}

    def body(self) -> dict[str, Any]:
        """The JSON body to send with ``status_code``."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(status={self.status_code}, message={self.message!r}, "
                f"param={self.param!r}, code={self.code!r})")


class InvalidRequestError(OpenAIError):
    """400: the request is malformed or asks for something invalid."""

    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedParameterError(InvalidRequestError):
    """400: a valid OpenAI parameter that helixserve does not implement was set."""

    default_code = "unsupported_parameter"


class ContextLengthExceededError(InvalidRequestError):
    """400: prompt (+ max_tokens) does not fit the model's context or the cache."""

    default_code = "context_length_exceeded"


class PayloadTooLargeError(InvalidRequestError):
    """413: the request body is larger than the server accepts."""

    status_code = 413
    default_code = "request_too_large"


class AuthenticationError(OpenAIError):
    """401: missing or wrong API key."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class NotFoundError(OpenAIError):
    """404: unknown route or object."""

    status_code = 404
    error_type = "not_found_error"


class ModelNotFoundError(NotFoundError):
    """404: the requested model is not served here."""

    error_type = "invalid_request_error"
    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist or is not served here.",
                         param="model")


class RateLimitError(OpenAIError):
    """429: too many requests."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"
    default_headers: ClassVar[Mapping[str, str]] = {"Retry-After": "1"}


class QueueFullError(RateLimitError):
    """429: a bounded request queue is full; retry later."""

    default_code = "queue_full"


class RequestCancelledError(OpenAIError):
    """499: the request was cancelled or aborted before it finished (client went away, or an
    engine abort with no more specific cause)."""

    status_code = 499
    error_type = "request_cancelled"
    default_code = "request_cancelled"


class InternalServerError(OpenAIError):
    """500: a bug or unexpected failure inside helixserve."""

    status_code = 500
    error_type = "server_error"
    default_code = "internal_error"


class ServiceUnavailableError(OpenAIError):
    """503: no healthy worker, a worker died, or the server is shutting down."""

    status_code = 503
    error_type = "service_unavailable_error"
    default_code = "service_unavailable"


class GatewayTimeoutError(OpenAIError):
    """504: a worker or a KV transfer did not answer within its timeout."""

    status_code = 504
    error_type = "timeout_error"
    default_code = "timeout"


_BY_STATUS: dict[int, type[OpenAIError]] = {
    400: InvalidRequestError, 401: AuthenticationError, 404: NotFoundError,
    413: PayloadTooLargeError, 429: RateLimitError,
    499: RequestCancelledError, 500: InternalServerError, 503: ServiceUnavailableError,
    504: GatewayTimeoutError,
}


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's error shape)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_from_body(status_code: int, body: Any) -> OpenAIError:
    """Rebuild an error a worker answered with (the router re-raises it to its client).

    The class follows ``status_code`` (an unmapped 4xx/5xx keeps its status on an
    InvalidRequestError / InternalServerError); a body that is not OpenAI-shaped becomes an error
    whose message quotes the body.
    """
    cls = _BY_STATUS.get(status_code)
    if cls is None:
        cls = InvalidRequestError if 400 <= status_code < 500 else InternalServerError
    inner = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(inner, Mapping) or not isinstance(inner.get("message"), str):
        err = cls(f"upstream answered HTTP {status_code}: {str(body)[:500]}")
    else:
        param, code, kind = inner.get("param"), inner.get("code"), inner.get("type")
        err = cls(inner["message"], param=param if isinstance(param, str) else None,
                  code=code if isinstance(code, str) else None,
                  error_type=kind if isinstance(kind, str) else None)
    if 400 <= status_code < 600:
        err.status_code = status_code  # keep an unmapped 4xx/5xx status as the worker sent it
    return err


def sse_error(err: OpenAIError) -> str:
    """One SSE event carrying the error body, for failures after a stream has started."""
    return f"data: {json.dumps(err.body())}\n\n"


def loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; ``()`` -> ``None``."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else part
    return param or None


def validation_error_to_openai(exc: ValidationError) -> InvalidRequestError:
    """The first error of a pydantic ``ValidationError`` as a 400 naming its parameter.

    Pydantic's own errors are named by their ``loc``. Errors raised by our model-level validators
    carry ``ctx["param"]`` (the field, relative to the model that raised) and may carry
    ``ctx["code"]``.
    """
    first = exc.errors(include_url=False)[0]
    ctx = first.get("ctx") or {}
    loc = tuple(first["loc"])
    param = loc_to_param(loc + ((ctx["param"],) if ctx.get("param") else ()))
    kind, msg = first["type"], first["msg"]
    name = f"'{param}'" if param else "the request body"
    if kind == "missing":
        return InvalidRequestError(f"Missing required parameter: {name}.", param=param,
                                   code="missing_required_parameter")
    if kind == "extra_forbidden":
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}", param=param,
                                   code="unknown_parameter")
    if kind == "unsupported_parameter":
        return UnsupportedParameterError(msg, param=param)
    if kind in OWN_ERROR_KINDS:  # our validators' messages are complete sentences already
        return InvalidRequestError(msg, param=param, code=ctx.get("code", kind))
    is_type_error = kind.endswith("_type") or kind.endswith("_parsing")
    code = "invalid_type" if is_type_error else "invalid_value"
    return InvalidRequestError(f"Invalid value for {name}: {msg}{_got(first.get('input'))}.",
                               param=param, code=code)


def _got(value: Any) -> str:
    """`` (got 9223372036854775808)`` for a number a client sent (ints up to 128 bits: a longer
    one is named by its size, its digits could run to the body limit)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ""
    if isinstance(value, int) and value.bit_length() > 128:
        return f" (got an integer of {value.bit_length()} bits)"
    return f" (got {value!r})"


def parse_json(raw: bytes | str) -> Any:
    """A request body as Python objects; 400 ``invalid_json`` for anything that is not strict JSON:
    bad UTF-8, a lone surrogate escape (``"\\ud800"``, which no UTF-8 hop could re-encode),
    ``NaN`` / ``Infinity``, or nesting deeper than the parser's recursion limit."""
    try:
        return from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}",
                                  code="invalid_json") from None


def parse_model(cls: type[ModelT], raw: bytes | str | Mapping[str, Any]) -> ModelT:
    """Parse a request body into ``cls``; every failure is an :class:`InvalidRequestError` (400)."""
    if isinstance(raw, (bytes, bytearray, str)):
        raw = parse_json(bytes(raw) if isinstance(raw, bytearray) else raw)
    if not isinstance(raw, Mapping):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise validation_error_to_openai(exc) from None
