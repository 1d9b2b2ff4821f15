"""Starting and probing real servers on loopback (e2e tests, ``bench/serve.py``): free ports,
a dependency-free JSON HTTP call, and polling until a condition holds.

Workers answer only callers holding the deployment's internal secret (``serving/auth.py``): a
harness that starts a deployment registers its workers' base URLs with :func:`trust_workers`, and
:func:`http` then sends the secret to those URLs (as the router does) unless told not to."""

from __future__ import annotations

import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from helixserve.parallel.ports import free_ports  # noqa: F401 - re-exported for the tests
from helixserve.serving.auth import INTERNAL_SECRET_HEADER


_WORKER_SECRETS: dict[str, str] = {}  # worker base URL -> its deployment's internal secret
SECRET_HEADER = INTERNAL_SECRET_HEADER


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def trust_workers(urls: list[str], secret: str) -> None:
    """:func:`http` sends ``secret`` to these worker base URLs from now on."""
    for url in urls:
        _WORKER_SECRETS[url.rstrip("/")] = secret


def secret_for(url: str) -> str | None:
    """The secret registered for the worker ``url`` belongs to, if any."""
    for base, secret in _WORKER_SECRETS.items():
        if url == base or url.startswith(base + "/"):
            return secret
    return None


def http(method: str, url: str, body: Any = None, headers: dict | None = None,
         timeout: float = 30, internal: bool = True) -> tuple[int, Any]:
    """``(status, parsed JSON or text)``; never raises for an HTTP status. ``internal``: send the
    registered secret of the worker ``url`` names (False: call as a stranger would)."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    secret = secret_for(url) if internal else None
    auth = {SECRET_HEADER: secret} if secret else {}
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **auth, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1,
               state: Callable[[], Any] | None = None) -> None:
    """Poll ``predicate`` every ``interval`` s until it is true; ``AssertionError`` naming ``what``
    after ``timeout`` s, with ``state()`` (what the caller wants to see of a failure) appended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f"; state: {state()}" if state else ""))
