"""OpenAI ``/v1/completions`` and ``/v1/chat/completions``: request and response models.

Requests are parsed with :func:`helixserve.protocol.errors.parse_model`, which turns every failure
into a 400 naming the parameter. What a request may ask for:

- supported: ``model``, ``prompt`` (a non-empty string or token id list; a one-element list is
  unwrapped, a batch of several prompts is rejected), ``messages`` (roles system/developer/user/
  assistant, content a string or a list of text parts, joined with ``"\\n"``), ``max_tokens`` /
  ``max_completion_tokens`` (>= 1), ``temperature`` [0, 2], ``top_p`` (0, 1], ``seed``, ``stop``
  (a string or up to 4 strings), ``stream``, ``stream_options`` (only with ``stream``), ``user``;
  extensions ``top_k`` (>= -1; -1 or 0 = off), ``stop_token_ids``, ``ignore_eos`` and
  ``disaggregated_params`` (router <-> workers, see :mod:`helixserve.protocol.disagg`).
- accepted only at their neutral value, else 400 ``unsupported_parameter`` (see the ``_NEUTRAL``
  tables): ``n`` (1), penalties (0), ``logit_bias``, ``logprobs``, ``best_of``, ``echo``,
  ``suffix``, tools/functions, ``response_format`` (text), audio and the like.
- anything else: 400 ``unknown_parameter``.

Responses: :class:`CompletionResponse` (also each ``/v1/completions`` SSE chunk),
:class:`ChatCompletionResponse` and :class:`ChatCompletionChunk`, built by the ``*_response`` /
``*_chunk`` helpers from a :class:`ResponseMeta` (id, model, created; one per request, shared by
all its chunks). The engine's finish reasons map as stop -> ``"stop"``, length -> ``"length"``;
abort has no OpenAI value and raises :class:`RequestCancelledError`, which the server sends as an
error body (or :func:`sse_error` event) instead of a truncated answer that looks complete.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr,
                      field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from helixserve.protocol.disagg import DisaggregatedParams
from helixserve.protocol.errors import ContextLengthExceededError, RequestCancelledError

TokenId = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
OpenAIFinishReason = Literal["stop", "length"]
MAX_STOP_STRINGS = 4

# parameter -> (values that mean "feature off", why anything else is refused)
_COMMON_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "only n=1 is supported"),
    "presence_penalty": ((0, 0.0), "only 0 is supported"),
    "frequency_penalty": ((0, 0.0), "only 0 is supported"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "logprobs": ((False,), "logprobs are not supported"),
}
_COMPLETION_NEUTRAL = {
    **_COMMON_NEUTRAL,
    "logprobs": ((), "logprobs are not supported"),
    "best_of": ((1,), "only best_of=1 is supported"),
    "echo": ((False,), "echo is not supported"),
    "suffix": (("",), "suffix is not supported"),
}
_CHAT_NEUTRAL = {
    **_COMMON_NEUTRAL,
    "top_logprobs": ((0,), "logprobs are not supported"),
    "tools": (([],), "tools are not supported"),
    "tool_choice": (("none",), "tools are not supported"),
    "parallel_tool_calls": ((True, False), "tools are not supported"),
    "functions": (([],), "functions are not supported"),
    "function_call": (("none",), "functions are not supported"),
    "response_format": (({"type": "text"},), "only response_format {'type': 'text'} is supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "storing completions is not supported"),
    "metadata": (({},), "metadata is only used with store, which is not supported"),
    "service_tier": (("auto", "default"), "only the default service tier exists"),
}


def _invalid(message: str, param: str | None = None, kind: str = "invalid_value",
             **ctx: Any) -> PydanticCustomError:
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


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    """``stream_options``; ``include_obfuscation`` is accepted, helixserve never obfuscates."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


class _GenerationRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")
    _NEUTRAL: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = _COMMON_NEUTRAL

    model: Annotated[StrictStr, Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Strict(), Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    disaggregated_params: DisaggregatedParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in cls._NEUTRAL.keys() & data.keys():
            value = data.pop(name)
            allowed, why = cls._NEUTRAL[name]
            is_neutral = any(type(value) is type(a) and value == a for a in allowed)
            if value is not None and not is_neutral:
                raise _invalid(f"Unsupported value for '{name}': {why}.", name,
                               "unsupported_parameter")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if value is None:
            return None
        if (not isinstance(value, list) or len(value) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in value)):
            raise _invalid(f"stop must be a non-empty string or a list of at most "
                           f"{MAX_STOP_STRINGS} non-empty strings")
        return value

    @model_validator(mode="after")
    def _check_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise _invalid("The 'stream_options' parameter is only allowed when 'stream' is "
                           "enabled.", "stream_options")
        if self.stream and self.disaggregated_params and self.disaggregated_params.is_context_only:
            raise _invalid("context_only requests cannot be streamed.", "stream")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """The requested completion length (``None``: the server's default)."""
        return self.max_tokens

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage-only chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. ``prompt`` is a string or a list of token ids after parsing."""

    _NEUTRAL: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = _COMPLETION_NEUTRAL

    prompt: str | list[TokenId]

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one prompt
        if isinstance(value, str):
            if not value:
                raise _invalid("prompt must not be empty")
            return value
        if not isinstance(value, list):
            raise _invalid("prompt must be a string or a list of token ids", kind="invalid_type")
        if not value:
            raise _invalid("prompt must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if min(value) < 0:
                raise _invalid("token ids in prompt must be >= 0")
            return value
        if all(isinstance(p, (str, list)) for p in value):
            raise _invalid("batched prompts (a list of several prompts) are not supported; "
                           "send one request per prompt", kind="unsupported_parameter")
        raise _invalid("prompt must be a string or a list of token ids", kind="invalid_type")


class ChatMessage(BaseModel):
    """One input message. ``developer`` becomes ``system``; text parts are joined with newlines."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: StrictStr

    @field_validator("role", mode="before")
    @classmethod
    def _check_role(cls, value: Any) -> Any:
        if value in ("tool", "function"):
            raise _invalid(f"role '{value}' is not supported (tools are not supported)",
                           kind="unsupported_parameter")
        return "system" if value == "developer" else value

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise _invalid("content must be a string or a non-empty list of text parts",
                           kind="invalid_type")
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _invalid(f"content part {j} has type {kind!r}; only 'text' parts are "
                               "supported", kind="unsupported_parameter")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise _invalid(f"content part {j} must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    _NEUTRAL: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = _CHAT_NEUTRAL

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None

    @model_validator(mode="after")
    def _check_max_tokens(self) -> Self:
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise _invalid("max_tokens and max_completion_tokens disagree; set only one.",
                           "max_completion_tokens")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       default: int | None = None, prompt_param: str = "prompt") -> int:
    """The completion length to run: ``requested``, else ``default``, else the rest of the context.

    Raises :class:`ContextLengthExceededError` (400) when the prompt leaves no room for one token,
    or when prompt + requested tokens exceed ``max_model_len``.
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, leaving no room for a completion.", param=prompt_param)
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
            f"{requested} for the completion).", param="max_tokens")
    return requested


# ---------------------------------------------------------------- responses


class _Out(BaseModel):
    """Response object; fields named in ``_omit_if_none`` are left out of the JSON when ``None``."""

    model_config = ConfigDict(extra="forbid")
    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class Usage(_Out):
    """``usage``; ``total_tokens`` must equal prompt + completion."""

    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    total_tokens: NonNegativeInt

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)

    @model_validator(mode="after")
    def _check_total(self) -> Self:
        if self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise _invalid("total_tokens must equal prompt_tokens + completion_tokens",
                           "total_tokens")
        return self


class CompletionChoice(_Out):
    index: NonNegativeInt = 0
    text: str
    logprobs: None = None
    finish_reason: OpenAIFinishReason | None = None


class CompletionResponse(_Out):
    """``text_completion``: a non-streamed answer, or one SSE chunk (``finish_reason`` null until
    the last one; a usage-only chunk has no choices)."""

    _omit_if_none = frozenset({"usage", "system_fingerprint", "disaggregated_params"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    disaggregated_params: DisaggregatedParams | None = None


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: NonNegativeInt = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: OpenAIFinishReason


class ChatCompletionResponse(_Out):
    _omit_if_none = frozenset({"usage", "system_fingerprint", "disaggregated_params"})
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    disaggregated_params: DisaggregatedParams | None = None


class ChatDelta(_Out):
    _omit_if_none = frozenset({"role", "content"})
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Out):
    index: NonNegativeInt = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletionChunk(_Out):
    _omit_if_none = frozenset({"usage", "system_fingerprint"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "helixserve"


class ModelList(_Out):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- builders


def _now() -> int:
    return int(time.time())


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """``id``, ``model`` and ``created`` of one request: the same in every chunk of its stream."""

    id: str
    model: str
    created: int

    @classmethod
    def for_completion(cls, model: str, created: int | None = None) -> ResponseMeta:
        return cls(new_completion_id(), model, _now() if created is None else created)

    @classmethod
    def for_chat(cls, model: str, created: int | None = None) -> ResponseMeta:
        return cls(new_chat_completion_id(), model, _now() if created is None else created)

    def header(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "created": self.created}


def _final_reason(reason: FinishReason | str | None) -> OpenAIFinishReason:
    mapped = to_openai_finish_reason(reason)
    if mapped is None:
        raise ValueError("a non-streamed response needs a finish reason")
    return mapped


def completion_response(meta: ResponseMeta, text: str, finish_reason: FinishReason | str,
                        usage: Usage, disaggregated_params: DisaggregatedParams | None = None
                        ) -> CompletionResponse:
    """Non-streamed ``/v1/completions`` answer."""
    choice = CompletionChoice(text=text, finish_reason=_final_reason(finish_reason))
    return CompletionResponse(**meta.header(), choices=[choice], usage=usage,
                              disaggregated_params=disaggregated_params)


def completion_chunk(meta: ResponseMeta, text: str,
                     finish_reason: FinishReason | str | None = None) -> CompletionResponse:
    """One ``/v1/completions`` SSE chunk carrying new text (``finish_reason`` on the last)."""
    choice = CompletionChoice(text=text, finish_reason=to_openai_finish_reason(finish_reason))
    return CompletionResponse(**meta.header(), choices=[choice])


def completion_usage_chunk(meta: ResponseMeta, usage: Usage) -> CompletionResponse:
    """The final usage-only chunk sent when ``stream_options.include_usage`` is set."""
    return CompletionResponse(**meta.header(), choices=[], usage=usage)


def chat_completion_response(meta: ResponseMeta, text: str, finish_reason: FinishReason | str,
                             usage: Usage,
                             disaggregated_params: DisaggregatedParams | None = None
                             ) -> ChatCompletionResponse:
    """Non-streamed ``/v1/chat/completions`` answer."""
    choice = ChatChoice(message=AssistantMessage(content=text),
                        finish_reason=_final_reason(finish_reason))
    return ChatCompletionResponse(**meta.header(), choices=[choice], usage=usage,
                                  disaggregated_params=disaggregated_params)


def chat_completion_chunk(meta: ResponseMeta, text: str | None = None,
                          finish_reason: FinishReason | str | None = None,
                          is_first: bool = False) -> ChatCompletionChunk:
    """One chat SSE chunk. The first chunk of a stream has ``is_first=True`` (delta carries
    ``role: assistant``); the last carries ``finish_reason`` (its delta may be empty)."""
    delta = ChatDelta(role="assistant" if is_first else None, content=text)
    choice = ChatChunkChoice(delta=delta, finish_reason=to_openai_finish_reason(finish_reason))
    return ChatCompletionChunk(**meta.header(), choices=[choice])


def chat_usage_chunk(meta: ResponseMeta, usage: Usage) -> ChatCompletionChunk:
    """The final usage-only chat chunk (``choices`` empty)."""
    return ChatCompletionChunk(**meta.header(), choices=[], usage=usage)


SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: BaseModel) -> str:
    """``data: <json>\\n\\n`` for one chunk."""
    return f"data: {obj.model_dump_json()}\n\n"
