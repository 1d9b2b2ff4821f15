"""Internal authentication of the workers' HTTP apps (docs/security.md).

Clients reach only the router; a ctx or gen worker answers only the deployment's own processes:

- **A secret is configured** (``security.internal_secret``; ``helixserve launch``, the SLURM
  launcher and compose's env file provide it): every route except ``/health``, ``/ready`` and
  ``/metrics`` needs the header ``X-Helixserve-Internal-Secret: <secret>`` (compared in constant time), else
  401 with OpenAI's error body. So ``disaggregated_params`` (which name another worker's cache)
  are honoured only from callers holding the secret: the router.
- **No secret** (a hand-started worker): plain requests are served, but nothing internal is —
  a request carrying ``disaggregated_params``, ``/v1/abort``, ``/v1/release`` and
  ``/v1/prefix_events`` (the block keys a ctx worker caches) get 403 naming
  the fix — unless ``security.allow_unauthenticated: true`` (a dev machine that nobody else
  reaches), which lets everything through.

``/health`` (liveness: orchestrators probe it), ``/ready`` (readiness: the router's pools and
compose's healthcheck probe it) and ``/metrics`` (Prometheus scrapers seldom send custom
headers) stay open: they carry counters and gauges only, nothing of any request's content, ids or tokens. A caller that presents a *wrong* secret there
gets 401 all the same: the router always presents its own (empty when it has none), so a router
started with the wrong secret sees its workers as unhealthy, naming the cause, instead of relaying
401s to its clients.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from helixserve.config import SecurityConfig
from helixserve.protocol import AuthenticationError, OpenAIError

logger = logging.getLogger(__name__)

INTERNAL_SECRET_HEADER = "X-Helixserve-Internal-Secret"
INVALID_INTERNAL_SECRET = "invalid_internal_secret"  # the 401's error code
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
INTERNAL_PATHS = frozenset({"/v1/abort", "/v1/release", "/v1/prefix_events"})  # router-only routes
COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
NO_SECRET_HINT = ("set the deployment's internal secret (HELIXSERVE_INTERNAL_SECRET or "
                  "security.internal_secret_file) on every process, or security.allow_unauthenticated: "
                  "true on a machine nobody else reaches")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class PermissionDeniedError(OpenAIError):
    """403: the caller may not ask for this (e.g. internal traffic to a worker without a secret,
    or a KV source outside the deployment)."""

    status_code = 403
    error_type = "permission_error"
    default_code = "permission_denied"


def internal_headers(secret: str | None) -> dict[str, str]:
    """What the router sends on every hop to a worker, health checks included (an empty value
    when it has no secret: a worker that has one then answers 401, see the module docstring)."""
    return {INTERNAL_SECRET_HEADER: secret or ""}


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _names_disaggregated_params(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False  # not JSON: the route's own parser answers 400
    return isinstance(data, dict) and data.get("disaggregated_params") is not None


class InternalAuthMiddleware:
    """The rules of the module docstring, before any route runs (pure ASGI: a stream passes
    through untouched)."""

    def __init__(self, app: ASGIApp, security: SecurityConfig) -> None:
        self.app = app
        secret = security.secret
        self._secret = secret.encode() if secret else None
        self._allow_unauthenticated = security.allow_unauthenticated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._secret is not None:
            given = _header(scope, INTERNAL_SECRET_HEADER.lower().encode())
            is_open = scope["path"] in OPEN_PATHS and given is None
            if not is_open and (given is None or not hmac.compare_digest(given, self._secret)):
                err = AuthenticationError(
                    "this worker answers only the deployment's router: send the internal secret in "
                    f"the {INTERNAL_SECRET_HEADER} header (clients talk to the router)",
                    code=INVALID_INTERNAL_SECRET)
                return await JSONResponse(err.body(), err.status_code)(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self._allow_unauthenticated:
            return await self.app(scope, receive, send)
        if scope["path"] in INTERNAL_PATHS:
            return await self._deny(f"{scope['path']} is internal", scope, receive, send)
        if scope["path"] in COMPLETION_PATHS and scope.get("method") == "POST":
            body, receive = await _buffered(receive)
            if _names_disaggregated_params(body):
                return await self._deny("disaggregated_params are internal", scope, receive, send)
        return await self.app(scope, receive, send)

    async def _deny(self, what: str, scope: Scope, receive: Receive, send: Send) -> None:
        err = PermissionDeniedError(f"{what} and this worker has no internal secret: {NO_SECRET_HINT}",
                                    param="disaggregated_params" if "params" in what else None)
        await JSONResponse(err.body(), err.status_code)(scope, receive, send)


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """Read the whole body; return it and a ``receive`` that replays it, then the rest."""
    chunks, message = [], {"more_body": True}
    while message.get("more_body"):
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
    body, is_replayed = b"".join(chunks), False

    async def replay() -> Message:
        nonlocal is_replayed
        if not is_replayed:
            is_replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def install_internal_auth(app: FastAPI, security: SecurityConfig) -> None:
    """Guard every route of a worker app by the module docstring's rules."""
    if security.secret is None:
        logger.warning("no internal secret: this worker serves no internal traffic%s",
                       " (allow_unauthenticated: serving it anyway)" if security.allow_unauthenticated else "")
    app.add_middleware(InternalAuthMiddleware, security=security)
