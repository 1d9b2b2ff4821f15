"""OpenAI response objects (answers, SSE chunks, the model list), the ``*_response`` / ``*_chunk``
builders that fill them from a :class:`ResponseMeta`, and SSE framing."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

from helixserve.protocol.disagg import DisaggregatedParams
from helixserve.protocol.openai_common import (FinishReason, NonNegativeInt, OpenAIFinishReason,
                                               param_error, to_openai_finish_reason)



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


class PromptTokensDetails(_Out):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens read from the prefix cache."""

    cached_tokens: NonNegativeInt


class Usage(_Out):
    """``usage``; ``total_tokens`` must equal prompt + completion. ``prompt_tokens_details`` is
    there when the server caches prefixes."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"prompt_tokens_details"})
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    total_tokens: NonNegativeInt
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
        details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    @model_validator(mode="after")
    def _check_total(self) -> Self:
        if self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise param_error("total_tokens must equal prompt_tokens + completion_tokens",
                               "total_tokens")
        return self


class CompletionChoice(_Out):
    index: NonNegativeInt = 0
    text: str
    logprobs: None = None
    finish_reason: OpenAIFinishReason | None = None


class _Envelope(_Out):
    """The fields of every answer and chunk; subclasses narrow ``object`` and ``choices``."""

    _omit_if_none = frozenset({"usage", "system_fingerprint"})
    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionResponse(_Envelope):
    """``text_completion``: a non-streamed answer, or one SSE chunk (``finish_reason`` null until
    the last one; a usage-only chunk has no choices)."""

    _omit_if_none = frozenset({"usage", "system_fingerprint", "disaggregated_params"})
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    disaggregated_params: DisaggregatedParams | None = None


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: NonNegativeInt = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: OpenAIFinishReason


class ChatCompletionResponse(_Envelope):
    _omit_if_none = frozenset({"usage", "system_fingerprint", "disaggregated_params"})
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
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


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


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
