"""The router's HTTP client to its workers (aiohttp): JSON hops, SSE streams, health probes.

Why aiohttp and not httpx (which the tests' and benches' clients use): httpcore's connection pool
(1.0.9) walks every pooled connection, polling each idle socket, on every request start and every
response close (``AsyncConnectionPool._assign_requests_to_connections``), so the cost of one event
grows with the connections open, i.e. with the requests in flight (two per request here: the
ctx hop and the gen stream, plus the release). On one H200 at 64 concurrent streams a py-spy of
the router showed about half of its event loop there; the loop was saturated and requests waited
~0.6 s before reaching the ctx worker. aiohttp's connector keeps a free list per host (what
vLLM's and SGLang's disaggregation proxies use).

Failures come out as one exception, :class:`UpstreamError`, which says whether the hop timed out
(the worker did not answer in time: 504) or the transport failed (the worker cannot be reached or
broke the connection: 503, and the worker is marked unhealthy).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

# under the workers' keep-alive (WorkerConnectionsConfig validates it), so the router never
# reuses a connection a worker is closing at that moment
from helixserve.config import UPSTREAM_KEEPALIVE_S
# compact and strict, like the router's own parsing of the client's JSON
_dumps = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class UpstreamError(Exception):
    """A hop without an HTTP answer. ``timed_out``: the worker did not answer (or stream) within
    the hop's timeout; otherwise it could not be reached or broke the connection."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        self.timed_out = _is_timeout(cause)
        text = str(cause)
        super().__init__(f"{type(cause).__name__}: {text}" if text else type(cause).__name__)


def _is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # no connection at all: unreachable
        return False
    return isinstance(exc, (asyncio.TimeoutError, TimeoutError))


_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, OSError)


@dataclass(slots=True)
class Answer:
    """A worker's whole answer."""

    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON; a body that is not JSON becomes an OpenAI error object quoting it."""
        try:
            return json.loads(self.body)
        except ValueError:
            return {"error": {"message": self.body[:500].decode("utf-8", "replace")}}


class Stream:
    """A worker's answer while it streams (an SSE response, or any answer read at once)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except _FAILURES as exc:
            raise UpstreamError(exc) from exc

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line ends."""
        pending = b""
        try:
            async for chunk in self._response.content.iter_any():
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r").decode("utf-8")
        except _FAILURES as exc:
            raise UpstreamError(exc) from exc
        if pending:
            yield pending.decode("utf-8")

    def close(self) -> None:
        """Done with it: a fully read answer's connection goes back to the pool, an unfinished
        one's is closed (the worker sees the disconnect)."""
        self._response.release()


class Upstream:
    """One client session to every worker, for the router's lifetime (``async with``)."""

    def __init__(self, connect_timeout_s: float, request_timeout_s: float, max_connections: int,
                 headers: Mapping[str, str]) -> None:
        # connect: waiting for a pooled connection plus making one (the admission bound keeps the
        # pool from filling, but the wait has a bound of its own); sock_read: between bytes
        self._timeout = aiohttp.ClientTimeout(total=None, connect=request_timeout_s,
                                              sock_connect=connect_timeout_s, sock_read=request_timeout_s)
        self._max_connections = max_connections
        # identity: the answers are relayed as they come, never decompressed
        self._headers = {"Accept-Encoding": "identity", **headers}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Upstream:
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        # no cookie jar (no state carried from one request's answer into another's hop) and
        # no redirects followed (a worker's answer is relayed, never chased)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                              headers=self._headers, auto_decompress=False,
                                              cookie_jar=aiohttp.DummyCookieJar(), json_serialize=_dumps)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the upstream client is not open"
        return self._session

    def _timeout_for(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        return self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)

    async def post(self, url: str, body: Any, headers: Mapping[str, str] | None = None,
                   timeout_s: float | None = None) -> Answer:
        """POST ``body`` as JSON and read the whole answer."""
        try:
            async with self.session.post(url, json=body, headers=headers, allow_redirects=False,
                                         timeout=self._timeout_for(timeout_s)) as response:
                return Answer(response.status, await response.read())
        except _FAILURES as exc:
            raise UpstreamError(exc) from exc

    async def get(self, url: str, timeout_s: float | None = None) -> Answer:
        try:
            async with self.session.get(url, allow_redirects=False,
                                        timeout=self._timeout_for(timeout_s)) as response:
                return Answer(response.status, await response.read())
        except _FAILURES as exc:
            raise UpstreamError(exc) from exc

    async def open(self, url: str, body: Any, headers: Mapping[str, str] | None = None) -> Stream:
        """POST ``body`` as JSON; the answer's status and headers are in, its body is not read."""
        try:
            response = await self.session.post(url, json=body, headers=headers, allow_redirects=False)
        except _FAILURES as exc:
            raise UpstreamError(exc) from exc
        return Stream(response)
