"""Starting and probing real servers on loopback (e2e tests, ``bench/serve.py``): free ports,
a dependency-free JSON HTTP call, and polling until a condition holds."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (bound, read, released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http(method: str, url: str, body: Any = None, headers: dict | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    """``(status, parsed JSON or text)``; never raises for an HTTP status."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
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
