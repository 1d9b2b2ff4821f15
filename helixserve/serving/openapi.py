"""The OpenAPI document of the router and the workers, carrying the real wire models.

Routes read their bodies themselves (strict JSON, limits, errors in OpenAI's shape), so FastAPI
cannot see their models; :func:`install_openapi` describes each operation from an
:class:`Operation`: the request model, the 200 answer (a model as JSON, an SSE stream, Prometheus
text) and the error statuses, every error with the :class:`ErrorResponse` body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from helixserve.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_REASONS = {400: "Invalid request", 401: "Missing or wrong API key (router) or internal secret (worker)",
            403: "This worker holds no internal secret: it serves no internal traffic", 404: "Unknown model",
            405: "Method not allowed", 413: "Request body too large",
            429: "At capacity; retry after Retry-After seconds",
            499: "Cancelled (the client went away)", 500: "Internal error",
            503: "No healthy worker / the worker cannot serve", 504: "A worker timed out"}
GENERATION_ERRORS = (400, 404, 413, 429, 499, 500, 503, 504)


@dataclass(frozen=True, slots=True)
class Operation:
    """One route's documented wire format."""

    request: type[BaseModel] | None = None  # a JSON body of this model
    response: tuple[type[BaseModel], ...] = ()  # the 200 JSON answer, one of these (): an object
    streams: bool = False  # the 200 answer may be an SSE stream instead (``"stream": true``)
    text: bool = False  # the 200 answer is Prometheus text, not JSON
    errors: tuple[int, ...] = ()
    error_is_object: tuple[int, ...] = ()  # statuses whose body is the route's own JSON object


def install_openapi(app: FastAPI, operations: Mapping[tuple[str, str], Operation]) -> None:
    """``app.openapi()`` describes ``operations`` (keyed by ``(METHOD, path)``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, operations)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI, operations: Mapping[tuple[str, str], Operation]) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = {ErrorResponse}
    for op in operations.values():
        models |= {m for m in (op.request, *op.response) if m is not None}
    refs, defs = models_json_schema([(m, "validation") for m in sorted(models, key=str)],
                                    ref_template=_REF)
    doc.setdefault("components", {})["schemas"] = defs.get("$defs", {})

    def ref(model: type[BaseModel]) -> dict[str, Any]:
        return refs[(model, "validation")]

    for (method, path), op in operations.items():
        entry = doc["paths"].setdefault(path, {}).setdefault(method.lower(), {})
        if op.request is not None:
            entry["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": ref(op.request)}}}
        else:
            entry.pop("requestBody", None)
        entry.pop("parameters", None)
        if op.text:
            ok = {"text/plain": {"schema": {"type": "string"}}}
        else:
            answers = [ref(m) for m in op.response]
            schema = {"type": "object"} if not answers else answers[0] if len(answers) == 1 \
                else {"anyOf": answers}
            ok = {"application/json": {"schema": schema}}
        if op.streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
        for status in op.errors:
            schema = {"type": "object"} if status in op.error_is_object else ref(ErrorResponse)
            responses[str(status)] = {"description": _REASONS.get(status, "Error"),
                                      "content": {"application/json": {"schema": schema}}}
        entry["responses"] = responses
    return doc
