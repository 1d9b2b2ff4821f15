"""Pieces both OpenAI endpoints share: id and count types, the request-validation error, and the
engine's :class:`FinishReason` with its mapping to OpenAI's ``finish_reason``."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StrictInt
from pydantic_core import PydanticCustomError

from helixserve.protocol.errors import RequestCancelledError



def _integral(value: Any) -> Any:
    """``76.0`` -> ``76`` (JSON has one number type; clients send integral floats); ``76.5`` is a
    400 naming the value. Booleans and strings stay what they are (StrictInt refuses them)."""
    if isinstance(value, float):
        if not value.is_integer():
            raise param_error(f"expected an integer, got {value!r}", kind="integer_type")
        return int(value)
    return value


INT32_MAX = 2**31 - 1  # the engine's bound on integer parameters (top_k, max_tokens)
TokenId = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
# a request's integer parameter (max_tokens, top_k, seed): an integral float is accepted
IntegralInt = Annotated[StrictInt, BeforeValidator(_integral)]
OpenAIFinishReason = Literal["stop", "length"]


def param_error(message: str, param: str | None = None, kind: str = "invalid_value",
                **ctx: Any) -> PydanticCustomError:
    """A validation error that :func:`~helixserve.protocol.errors.parse_model` turns into a 400
    of type ``kind`` naming ``param``."""
    return PydanticCustomError(kind, message, {**ctx, "param": param} if param else ctx)


class FinishReason(StrEnum):
    """Why the engine stopped a request."""

    STOP = "stop"        # eos, a stop string or a stop token id
    LENGTH = "length"    # max_tokens or the context limit
    ABORT = "abort"      # cancelled or failed; never shown to clients as a finish reason


def to_openai_finish_reason(reason: FinishReason | str | None) -> OpenAIFinishReason | None:
    """stop -> ``"stop"``, length -> ``"length"``, ``None`` -> ``None`` (still running);
    abort raises :class:`RequestCancelledError`; anything else raises ``ValueError``."""
    if reason is None:
        return None
    reason = FinishReason(reason)
    if reason is FinishReason.ABORT:
        raise RequestCancelledError("The request was aborted before it finished.")
    return "stop" if reason is FinishReason.STOP else "length"
