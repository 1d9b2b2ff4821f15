"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` request models, the tables of
parameters accepted only at their neutral value, and :func:`resolve_max_tokens`."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (BaseModel, ConfigDict, Field, Strict, StrictBool, StrictStr,
                      field_validator, model_validator)

from helixserve.protocol.disagg import DisaggregatedParams
from helixserve.protocol.errors import ContextLengthExceededError
from helixserve.protocol.openai_common import INT32_MAX, IntegralInt, TokenId, param_error

# max_tokens and the like: in [1, int32 max], 76.0 reads as 76
Count = Annotated[IntegralInt, Field(ge=1, le=INT32_MAX)]

MAX_STOP_STRINGS = 4
MAX_CACHE_SALT_CHARS = 1024

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
    max_tokens: Count | None = None
    temperature: Annotated[float, Strict(), Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    # -1 or 0: off; above the vocabulary: every token (the engine clamps it to the vocabulary)
    top_k: Annotated[IntegralInt, Field(ge=-1, le=INT32_MAX)] | None = None
    seed: Annotated[IntegralInt, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    disaggregated_params: DisaggregatedParams | None = None
    # prefix caching shares cached blocks only between requests of one salt (vLLM's field)
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None

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
                raise param_error(f"Unsupported value for '{name}': {why}.", name,
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
            raise param_error(f"stop must be a non-empty string or a list of at most "
                               f"{MAX_STOP_STRINGS} non-empty strings")
        return value

    @model_validator(mode="after")
    def _check_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise param_error("The 'stream_options' parameter is only allowed when 'stream' is "
                               "enabled.", "stream_options")
        if self.stream and self.disaggregated_params and self.disaggregated_params.is_context_only:
            raise param_error("context_only requests cannot be streamed.", "stream")
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
                raise param_error("prompt must not be empty")
            return value
        if not isinstance(value, list):
            raise param_error("prompt must be a string or a list of token ids", kind="invalid_type")
        if not value:
            raise param_error("prompt must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if min(value) < 0:
                raise param_error("token ids in prompt must be >= 0")
            return value
        if all(isinstance(p, (str, list)) for p in value):
            raise param_error("batched prompts (a list of several prompts) are not supported; "
                               "send one request per prompt", kind="unsupported_parameter")
        raise param_error("prompt must be a string or a list of token ids", kind="invalid_type")


class ChatMessage(BaseModel):
    """One input message. ``developer`` becomes ``system``; text parts are joined with newlines."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: StrictStr

    @field_validator("role", mode="before")
    @classmethod
    def _check_role(cls, value: Any) -> Any:
        if value in ("tool", "function"):
            raise param_error(f"role '{value}' is not supported (tools are not supported)",
                               kind="unsupported_parameter")
        return "system" if value == "developer" else value

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise param_error("content must be a string or a non-empty list of text parts",
                               kind="invalid_type")
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise param_error(f"content part {j} has type {kind!r}; only 'text' parts are "
                                   "supported", kind="unsupported_parameter")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise param_error(f"content part {j} must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    _NEUTRAL: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = _CHAT_NEUTRAL

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None

    @model_validator(mode="after")
    def _check_max_tokens(self) -> Self:
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise param_error("max_tokens and max_completion_tokens disagree; set only one.",
                               "max_completion_tokens")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def raw_prompt_length(raw: Any) -> int | None:
    """The length of a parsed (not yet validated) body's ``prompt`` when it is a token-id list,
    else None: an over-long list is refused before the work of validating it."""
    prompt = raw.get("prompt") if isinstance(raw, dict) else None
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return len(prompt)
    return None


def prompt_too_long(num_tokens: int, max_prompt_tokens: int, max_model_len: int | None,
                    param: str = "prompt", at_least: bool = False) -> ContextLengthExceededError:
    """The 400 for a prompt of ``num_tokens`` (``at_least``: a lower bound, counted before
    tokenizing) over ``max_prompt_tokens``, worded by which limit it is: the context, or
    ``limits.max_prompt_tokens`` below it."""
    has = f"{'at least ' if at_least else ''}{num_tokens} tokens"
    if max_model_len is not None and max_prompt_tokens >= max_model_len:
        message = (f"This model's maximum context length is {max_model_len} tokens; the prompt "
                   f"has {has}.")
    else:
        message = (f"The prompt has {has}; this server accepts at most {max_prompt_tokens} "
                   f"prompt tokens.")
    return ContextLengthExceededError(message, param=param)


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
