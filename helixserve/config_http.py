"""Configuration of an HTTP server's client connections (router and workers): how long a client
may take to send its request's headers and body, how long an idle keep-alive connection stays,
and how many connections a server holds. Part of :mod:`helixserve.config` (which re-exports every
name); torch-free, imports nothing of the package. Used by :mod:`helixserve.serving.connections`.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from helixserve.config_lifecycle import Strict

# the router's client drops its idle connections to a worker after this (router/upstream.py); a
# worker keeps an idle one longer, so the router never sends on a connection the worker is closing
UPSTREAM_KEEPALIVE_S = 4.0


class ConnectionsConfig(Strict):
    """Client connections of one HTTP server. Defaults fit a public endpoint (nginx's and Node's
    header/body timeouts are 60 s; ours are shorter, as the requests are small JSON bodies).

    - ``timeout_keep_alive`` (vLLM's ``--timeout-keep-alive``, uvicorn's option): an idle
      connection is closed this long after its last answer.
    - ``timeout_header_s``: a request's headers must be complete this long after the connection
      opened, or after the first byte of a request on a kept-alive connection (idle and
      slow-header clients are closed).
    - ``timeout_body_s``: a request's body must be complete this long after its headers (a slow
      body is closed; the handler sees the client gone, a 499).
    - ``max_connections``: at this many open connections a new one closes the oldest connection
      still waiting for a request (idle first, then slow headers); with none to close, the new one
      is answered 503 and closed. Lowered at start-up to what the file-descriptor limit allows.
    """

    timeout_keep_alive: float = Field(5.0, gt=0, le=60)
    timeout_header_s: float = Field(10.0, gt=0, le=60)
    timeout_body_s: float = Field(30.0, gt=0, le=60)
    max_connections: int = Field(4096, ge=4)


class WorkerConnectionsConfig(ConnectionsConfig):
    """A worker's connections: its keep-alive outlasts the router's idle connections to it."""

    @model_validator(mode="after")
    def _outlasts_the_router(self) -> WorkerConnectionsConfig:
        if self.timeout_keep_alive <= UPSTREAM_KEEPALIVE_S:
            raise ValueError(f"a worker's connections.timeout_keep_alive ({self.timeout_keep_alive} s) must exceed "
                             f"the router's idle-connection expiry ({UPSTREAM_KEEPALIVE_S} s)")
        return self
