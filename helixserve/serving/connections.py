"""Client connections of an HTTP server (router, ctx and gen workers): a deadline for each phase
of a request's arrival and a cap on open connections (:class:`~helixserve.config.ConnectionsConfig`).

uvicorn closes a connection idle after an answer (``timeout_keep_alive``) and nothing else: a
client that opens a connection and sends nothing, or its headers a byte at a time, or its body
slower than any real client, would hold a file descriptor for ever. :class:`GuardedH11Protocol`
is uvicorn's h11 protocol with one deadline per phase of a connection:

1. **WAITING** (opened, or kept alive after an answer; no byte of a request yet) and **HEADERS**
   (some bytes, headers incomplete): the headers must be complete ``timeout_header_s`` after the
   connection opened, or after the first byte of a request on a kept-alive connection (uvicorn
   closes a kept-alive connection still WAITING after ``timeout_keep_alive``).
2. **BODY** (headers parsed): the body must be complete ``timeout_body_s`` after its headers.
   The handler reading it sees the client gone (a 499, never a 500).
3. **HANDLING** (request complete, answer not yet done): no deadline here; the handler's own
   bounds apply.

:class:`ConnectionGuard` holds a server's open connections in the order they opened. At
``max_connections`` a new connection closes the oldest WAITING connection, else the oldest in
HEADERS; when every connection carries a request the new one is answered 503 and closed.
Closures are counted by reason, and each reason logs at most one warning per interval (a failed
accept too: :class:`GuardedServer` throttles asyncio's traceback per attempt).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import resource
from collections import Counter
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from helixserve.config import ConnectionsConfig
from helixserve.log_throttle import ThrottledLog
from helixserve.protocol import ServiceUnavailableError

logger = logging.getLogger(__name__)

# file descriptors kept for the server's own use (its upstream connections, gRPC, files) beyond
# those open when it starts, when the fd limit lowers max_connections
FD_RESERVE = 128
# the listening socket's backlog, which is also how many connections asyncio accepts in one go;
# the connections closed to make room free their descriptors two loop turns later, so the fd
# limit must leave ACCEPT_BURSTS such bursts beyond max_connections
ACCEPT_BACKLOG = 128
ACCEPT_BURSTS = 3
_ACCEPT_FAILED = "socket.accept() out of system resource"


class Phase(enum.Enum):
    WAITING = "waiting"
    HEADERS = "headers"
    BODY = "body"
    HANDLING = "handling"


def _busy_response() -> bytes:
    err = ServiceUnavailableError("the server is at its connection limit (max_connections); retry later",
                                  code="too_many_connections")
    body = json.dumps(err.body()).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def fd_allowed_connections(max_connections: int) -> int:
    """``max_connections``, lowered to what this process's file-descriptor limit leaves (the soft
    limit raised to the hard one first where that helps, as vLLM's server does)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    num_open = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    wanted = num_open + FD_RESERVE + ACCEPT_BURSTS * ACCEPT_BACKLOG + max_connections
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new_soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            soft = new_soft
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections
    allowed = max(4, soft - num_open - FD_RESERVE - ACCEPT_BURSTS * ACCEPT_BACKLOG)
    if allowed < max_connections:
        logger.warning("connections.max_connections %d lowered to %d: the file-descriptor limit is %d",
                       max_connections, allowed, soft)
    return min(max_connections, allowed)


class ConnectionGuard:
    """One server's open connections (oldest first), its cap and its closures by reason
    (``idle_timeout``: no byte of a request by the header deadline; ``header_timeout``,
    ``body_timeout``, ``evicted``, ``refused``)."""

    def __init__(self, config: ConnectionsConfig, max_connections: int | None = None) -> None:
        self.config = config
        self.max_connections = max_connections if max_connections is not None else config.max_connections
        self.open: dict[GuardedH11Protocol, None] = {}
        self.num_closed: Counter[str] = Counter()
        self.busy_response = _busy_response()
        self._log = ThrottledLog(logger)

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Make room for ``conn`` (closing the oldest connection without a request); False when
        every open connection carries a request."""
        if len(self.open) >= self.max_connections:
            victim = self._oldest_without_request()
            if victim is None:
                self.closed(conn, "refused")
                return False
            victim.close_for("evicted")
        self.open[conn] = None
        return True

    def _oldest_without_request(self) -> GuardedH11Protocol | None:
        slow = None
        for conn in self.open:
            if conn.phase is Phase.WAITING:
                return conn
            if slow is None and conn.phase is Phase.HEADERS:
                slow = conn
        return slow

    def closed(self, conn: GuardedH11Protocol, reason: str) -> None:
        self.open.pop(conn, None)
        self.num_closed[reason] += 1
        self._log.log(reason, "closed a client connection (%s; %d open, max_connections %d)",
                      reason, len(self.open), self.max_connections)

    def forget(self, conn: GuardedH11Protocol) -> None:
        self.open.pop(conn, None)

    def on_loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The event loop's exception handler: a failed accept (out of file descriptors) is one
        throttled warning, not a traceback per attempt (asyncio retries up to the backlog)."""
        if context.get("message") != _ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        self.num_closed["accept_failed"] += 1
        self._log.log("accept_failed", "cannot accept a client connection: %s (%d open)",
                      context.get("exception"), len(self.open))


class GuardedServer(uvicorn.Server):
    """uvicorn's server with the guard's event-loop exception handler."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard

    async def startup(self, sockets: list | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.guard.on_loop_exception)
        await super().startup(sockets)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a :class:`ConnectionGuard` (see the module docstring)."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.phase = Phase.WAITING
        self._deadline: Any = None  # asyncio.TimerHandle of the phase's deadline

    def connection_made(self, transport: Any) -> None:  # noqa: ANN401 (asyncio.Transport)
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.write(self.guard.busy_response)
            transport.close()
            return
        self._arm(self.guard.config.timeout_header_s, "header_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def close_for(self, reason: str) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            is_idle = reason == "header_timeout" and self.phase is Phase.WAITING
            self.guard.closed(self, "idle_timeout" if is_idle else reason)
            self.transport.close()

    def _track(self) -> None:
        """The phase h11's state shows; a deadline starts on entering HEADERS or BODY."""
        their = self.conn.their_state
        if their is h11.IDLE:
            phase = Phase.HEADERS if self.conn.trailing_data[0] else Phase.WAITING
        else:
            phase = Phase.BODY if their is h11.SEND_BODY else Phase.HANDLING
        if phase is self.phase:
            return
        self.phase = phase
        config = self.guard.config
        if phase is Phase.HEADERS and self._deadline is None:  # a fresh connection keeps its own
            self._arm(config.timeout_header_s, "header_timeout")
        elif phase is Phase.BODY:
            self._arm(config.timeout_body_s, "body_timeout")
        elif phase is not Phase.HEADERS:  # WAITING after an answer: uvicorn's keep-alive timer
            self._disarm()

    def _arm(self, timeout_s: float, reason: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(timeout_s, self.close_for, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
