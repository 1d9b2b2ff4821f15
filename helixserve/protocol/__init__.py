"""helixserve.protocol: the wire formats, torch-free.

- :mod:`.openai`: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` requests, responses,
  SSE chunks and the helpers that build them (defined in :mod:`.openai_requests`,
  :mod:`.openai_responses` and :mod:`.openai_common`).
- :mod:`.errors`: :class:`OpenAIError` and its per-status subclasses, OpenAI-shaped error bodies,
  and :func:`parse_model` (request body -> model, or a 400 naming the parameter).
- :mod:`.disagg`: ``disaggregated_params`` exchanged by router, ctx and gen workers.
"""

from helixserve.protocol.disagg import (DisaggregatedParams, KVLayout, RequestType,
                                        TransceiverEndpoint)
from helixserve.protocol.errors import (AuthenticationError, ContextLengthExceededError,
                                        ErrorInfo, ErrorResponse, GatewayTimeoutError,
                                        InternalServerError, InvalidRequestError,
                                        ModelNotFoundError, NotFoundError, OpenAIError,
                                        PayloadTooLargeError, QueueFullError, RateLimitError,
                                        RequestCancelledError, ServiceUnavailableError,
                                        UnsupportedParameterError, error_body, error_from_body,
                                        parse_json, parse_model, sse_error,
                                        validation_error_to_openai)
from helixserve.protocol.openai import (SSE_DONE, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatMessage, CompletionRequest,
                                        CompletionResponse, FinishReason, ModelCard, ModelList,
                                        ResponseMeta, StreamOptions, Usage, chat_completion_chunk,
                                        chat_completion_response, chat_usage_chunk,
                                        completion_chunk, completion_response,
                                        completion_usage_chunk, new_chat_completion_id,
                                        new_completion_id, prompt_too_long,
                                        raw_prompt_length, resolve_max_tokens, sse_event,
                                        to_openai_finish_reason)

__all__ = [
    "AuthenticationError", "ChatCompletionChunk", "ChatCompletionRequest",
    "ChatCompletionResponse", "ChatMessage", "CompletionRequest", "CompletionResponse",
    "ContextLengthExceededError", "DisaggregatedParams", "ErrorInfo", "ErrorResponse",
    "FinishReason", "GatewayTimeoutError", "InternalServerError", "InvalidRequestError",
    "KVLayout", "ModelCard", "ModelList", "ModelNotFoundError", "NotFoundError", "OpenAIError",
    "PayloadTooLargeError", "QueueFullError", "RateLimitError", "RequestCancelledError",
    "RequestType", "ResponseMeta", "SSE_DONE", "ServiceUnavailableError", "StreamOptions",
    "TransceiverEndpoint", "UnsupportedParameterError", "Usage", "chat_completion_chunk",
    "chat_completion_response", "chat_usage_chunk", "completion_chunk", "completion_response",
    "completion_usage_chunk", "error_body", "error_from_body", "new_chat_completion_id",
    "new_completion_id", "parse_json", "parse_model", "prompt_too_long", "raw_prompt_length", "resolve_max_tokens",
    "sse_error", "sse_event", "to_openai_finish_reason", "validation_error_to_openai",
]
