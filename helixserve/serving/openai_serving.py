"""OpenAI requests -> engine inputs, engine outputs -> OpenAI answers and SSE streams (workers).

:func:`prepare` validates what pydantic cannot (prompt length vs ``limits.max_prompt_tokens`` and
the context, token ids vs the vocabulary) and builds :class:`SamplingParams`; a prompt that cannot
fit is refused before it is tokenized when its token count or its byte count proves it.
:func:`collect` and :func:`sse_stream` turn a request's :class:`RequestOutput` s into the
non-streamed answer or the SSE events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from helixserve.engine.async_engine import RequestOutput
from helixserve.engine.request import SamplingParams
from helixserve.models.generation_config import GenerationDefaults
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.protocol import (SSE_DONE, ChatCompletionRequest, CompletionRequest,
                                 DisaggregatedParams, InvalidRequestError, OpenAIError,
                                 ResponseMeta, Usage, chat_completion_chunk,
                                 chat_completion_response, chat_usage_chunk, completion_chunk,
                                 completion_response, completion_usage_chunk, prompt_too_long,
                                 resolve_max_tokens, sse_error, sse_event)

GenerationRequest = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """What a worker's engine allows; filled once at start-up."""

    served_model: str
    max_model_len: int
    vocab_size: int
    default_max_tokens: int | None
    max_prompt_tokens: int  # at most max_model_len
    max_body_bytes: int
    # the most prompt bytes one token can stand for, where the tokenizer proves a bound (None:
    # no early refusal by byte count; the prompt is tokenized, then checked)
    max_bytes_per_token: int | None = None
    # the checkpoint's generation_config.json defaults, for what a request leaves unset
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


def max_bytes_per_token(tokenizer: HelixTokenizer | None) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token covers, or None where none is proven
    (see each backend's ``max_bytes_per_token``): a text of ``n`` bytes has at least
    ``ceil(n / bound)`` tokens."""
    return tokenizer.max_bytes_per_token() if tokenizer is not None else None


def check_prompt_length(num_tokens: int, limits: ServingLimits, param: str,
                        at_least: bool = False) -> None:
    """400 ``context_length_exceeded`` for a prompt over ``limits.max_prompt_tokens``."""
    if num_tokens > limits.max_prompt_tokens:
        raise prompt_too_long(num_tokens, limits.max_prompt_tokens, limits.max_model_len, param,
                              at_least)


def _encode(text: str, tokenizer: HelixTokenizer, limits: ServingLimits, param: str) -> list[int]:
    """Tokenize ``text`` unless its byte count alone proves it is too long."""
    bound = limits.max_bytes_per_token
    if bound is not None and len(text) > limits.max_prompt_tokens:  # bytes >= characters
        num_bytes = len(text.encode("utf-8"))
        check_prompt_length(-(-num_bytes // bound), limits, param, at_least=True)
    ids = tokenizer.encode(text)
    check_prompt_length(len(ids), limits, param)
    return ids


@dataclass(slots=True)
class PreparedRequest:
    """One validated request, ready for the engine."""

    request_id: str
    body: GenerationRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    meta: ResponseMeta

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    @property
    def is_stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def disaggregated_params(self) -> DisaggregatedParams | None:
        return self.body.disaggregated_params


def prompt_token_ids(body: GenerationRequest, tokenizer: HelixTokenizer | None,
                     limits: ServingLimits) -> list[int]:
    """The prompt as token ids: a generation_only request's ctx-given ids, else tokenized here;
    400 when it is longer than ``limits.max_prompt_tokens``."""
    params = body.disaggregated_params
    if params is not None and params.is_generation_only:
        ids = list(params.prompt_token_ids)
        check_prompt_length(len(ids), limits, "prompt")
    elif isinstance(body, ChatCompletionRequest):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: chat is not available",
                                      param="messages")
        text = tokenizer.render_chat([m.model_dump() for m in body.messages])
        ids = _encode(text, tokenizer, limits, "messages")
    elif isinstance(body.prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids",
                                      param="prompt")
        ids = _encode(body.prompt, tokenizer, limits, "prompt")
    else:
        check_prompt_length(len(body.prompt), limits, "prompt")
        ids = list(body.prompt)
    if not ids:
        raise InvalidRequestError("the prompt encodes to zero tokens", param="prompt")
    return ids


def sampling_params(body: GenerationRequest, num_prompt_tokens: int, limits: ServingLimits
                    ) -> SamplingParams:
    """What the request sets, else the model's ``generation_config.json``, else OpenAI's defaults
    (temperature 1, top_p 1, top_k off) and the server's ``default_max_tokens``; 400 when the
    prompt leaves no room."""
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    model = limits.generation_defaults
    default_max = model.max_tokens if model.max_tokens is not None else limits.default_max_tokens
    max_tokens = resolve_max_tokens(body.max_new_tokens, num_prompt_tokens, limits.max_model_len,
                                    default_max, prompt_param=prompt_param)
    bad = [t for t in body.stop_token_ids or () if t >= limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad[:8]} are outside the vocabulary "
                                  f"[0, {limits.vocab_size})", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_first_set(body.temperature, model.temperature, 1.0),
        top_p=_first_set(body.top_p, model.top_p, 1.0),
        top_k=_first_set(body.top_k, model.top_k, 0),
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        stop=tuple(body.stop_strings),
        ignore_eos=bool(body.ignore_eos),
        cache_salt=body.cache_salt,
    )


def _first_set(*values: float | int | None) -> float | int:
    return next(v for v in values if v is not None)


def prepare(request_id: str, body: GenerationRequest, tokenizer: HelixTokenizer | None,
            limits: ServingLimits) -> PreparedRequest:
    ids = prompt_token_ids(body, tokenizer, limits)
    bad = [t for t in ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids {bad[:8]} are outside the vocabulary "
                                  f"[0, {limits.vocab_size})", param="prompt")
    params = sampling_params(body, len(ids), limits)
    is_chat = isinstance(body, ChatCompletionRequest)
    meta = (ResponseMeta.for_chat if is_chat else ResponseMeta.for_completion)(body.model)
    return PreparedRequest(request_id, body, ids, params, meta)


@dataclass(slots=True)
class Collected:
    """A whole request's outputs."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int | None = None

    @property
    def usage(self) -> Usage:
        return Usage.of(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)


async def collect_outputs(outputs: AsyncIterator[RequestOutput]) -> Collected:
    parts: list[str] = []
    token_ids: list[int] = []
    last: RequestOutput | None = None
    async for out in outputs:
        parts.append(out.text)
        token_ids.extend(out.token_ids)
        last = out
    assert last is not None and last.is_finished, "an output stream ended without finishing"
    return Collected("".join(parts), token_ids, last.finish_reason, last.num_prompt_tokens,
                     last.num_output_tokens, last.num_cached_tokens)


def answer_json(prepared: PreparedRequest, done: Collected) -> str:
    """The non-streamed OpenAI answer as JSON."""
    build = chat_completion_response if prepared.is_chat else completion_response
    return build(prepared.meta, done.text, done.finish_reason, done.usage).model_dump_json()


async def sse_stream(prepared: PreparedRequest, first: RequestOutput,
                     rest: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """SSE events of one request: chunks, the usage chunk if asked for, then ``[DONE]``; an
    error after the stream started is sent as an error event (and ends the stream)."""
    meta = prepared.meta
    if prepared.is_chat:
        yield sse_event(chat_completion_chunk(meta, "", is_first=True))
    last = first
    try:
        out: RequestOutput | None = first
        while out is not None:
            last = out
            if out.text or out.is_finished:
                if prepared.is_chat:
                    yield sse_event(chat_completion_chunk(meta, out.text or None, out.finish_reason))
                else:
                    yield sse_event(completion_chunk(meta, out.text, out.finish_reason))
            out = None if out.is_finished else await anext(rest, None)
    except OpenAIError as err:
        yield sse_error(err)
        return
    if prepared.body.include_usage:
        usage = Usage.of(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        build = chat_usage_chunk if prepared.is_chat else completion_usage_chunk
        yield sse_event(build(meta, usage))
    yield SSE_DONE
