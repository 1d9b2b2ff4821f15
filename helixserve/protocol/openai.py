"""OpenAI ``/v1/completions`` and ``/v1/chat/completions``: request and response models.

Requests are parsed with :func:`helixserve.protocol.errors.parse_model`, which turns every failure
into a 400 naming the parameter. What a request may ask for:

- supported: ``model``, ``prompt`` (a non-empty string or token id list; a one-element list is
  unwrapped, a batch of several prompts is rejected), ``messages`` (roles system/developer/user/
  assistant, content a string or a list of text parts, joined with ``"\\n"``), ``max_tokens`` /
  ``max_completion_tokens`` [1, 2**31 - 1], ``temperature`` [0, 2], ``top_p`` (0, 1] (floats
  finite: NaN and infinities are refused), ``seed`` [-2**63, 2**64), ``stop`` (a string or up to
  4 strings), ``stream``, ``stream_options`` (only with ``stream``), ``user``; extensions ``top_k``
  ([-1, 2**31 - 1]; -1 or 0 = off, above the vocabulary = every token), ``stop_token_ids``
  (within the vocabulary), ``ignore_eos`` and
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

This module gathers the public names of three modules: :mod:`.openai_requests` (request models,
neutral-value tables, :func:`resolve_max_tokens`), :mod:`.openai_responses` (response objects,
their builders, SSE framing) and :mod:`.openai_common` (shared types, :class:`FinishReason`).
"""

from helixserve.protocol.openai_common import (FinishReason, IntegralInt, NonNegativeInt,
                                               OpenAIFinishReason, PositiveInt, TokenId,
                                               param_error, to_openai_finish_reason)
from helixserve.protocol.openai_requests import (MAX_STOP_STRINGS, ChatCompletionRequest,
                                                 ChatMessage, CompletionRequest, StreamOptions,
                                                 prompt_too_long, raw_prompt_length,
                                                 resolve_max_tokens)
from helixserve.protocol.openai_responses import (SSE_DONE, AssistantMessage, ChatChoice,
                                                  ChatChunkChoice, ChatCompletionChunk,
                                                  ChatCompletionResponse, ChatDelta,
                                                  CompletionChoice, CompletionResponse, ModelCard,
                                                  ModelList, ResponseMeta, Usage,
                                                  chat_completion_chunk, chat_completion_response,
                                                  chat_usage_chunk, completion_chunk,
                                                  completion_response, completion_usage_chunk,
                                                  new_chat_completion_id, new_completion_id,
                                                  sse_event)

__all__ = [
    "MAX_STOP_STRINGS", "SSE_DONE", "AssistantMessage", "ChatChoice", "ChatChunkChoice",
    "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatDelta",
    "ChatMessage", "CompletionChoice", "CompletionRequest", "CompletionResponse", "FinishReason",
    "IntegralInt", "ModelCard", "ModelList", "NonNegativeInt", "OpenAIFinishReason", "PositiveInt",
    "ResponseMeta", "StreamOptions", "TokenId", "Usage", "chat_completion_chunk",
    "chat_completion_response", "chat_usage_chunk", "completion_chunk", "completion_response",
    "completion_usage_chunk", "new_chat_completion_id", "new_completion_id", "param_error",
    "prompt_too_long", "raw_prompt_length", "resolve_max_tokens", "sse_event", "to_openai_finish_reason",
]
