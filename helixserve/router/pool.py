"""Worker pools: which ctx / gen workers are healthy, how loaded, and which one gets a request.

A worker starts unknown (not healthy) and becomes healthy when its ``GET /ready`` answers 200
(alive and warmed up: ``/health`` is liveness only, 200 while the worker still warms up).
A failed health check, or a request that could not reach it, marks it unhealthy with the cause;
the next passing health check brings it back (rejoin).

Capacity: a worker's ``/ready`` answer says how many requests it admits at once (``capacity``:
its running slots plus its queue); beyond that it answers 429. The router never sends a worker
more than that: :meth:`WorkerPool.pick` skips a worker at its capacity, and the router's
admission holds its requests in flight to the pools' :attr:`WorkerPool.capacity`, so overload
is queued or refused by the router itself, at once.

Policies: ``round_robin``; ``least_loaded`` (fewest requests in flight from this router, ties in
turn); ``cache_aware`` (a pool with a :class:`~helixserve.router.prefix_index.PrefixIndex`, the
ctx pool: the worker holding most of the request's prefix, weighed against load, see there;
no match, or a pool without an index: least loaded).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from helixserve.kvcache.prefix_index import BlockKey
from helixserve.protocol import QueueFullError, ServiceUnavailableError
from helixserve.router.prefix_index import PrefixIndex
from helixserve.router.upstream import Upstream, UpstreamError

logger = logging.getLogger(__name__)

Policy = Literal["round_robin", "least_loaded", "cache_aware"]


@dataclass(slots=True)
class WorkerState:
    url: str
    role: str
    is_healthy: bool = False
    num_inflight: int = 0  # requests this router has on it now
    last_error: str | None = "not checked yet"
    stats: dict[str, Any] = field(default_factory=dict)  # the worker's last /ready answer

    @property
    def capacity(self) -> int | None:
        """Requests it admits at once, from its last ``/ready`` answer (None: not said)."""
        capacity = self.stats.get("capacity")
        is_count = isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 0
        return capacity if is_count else None

    @property
    def has_room(self) -> bool:
        capacity = self.capacity
        return capacity is None or self.num_inflight < capacity

    def describe(self) -> str:
        return f"{self.url} ({'healthy' if self.is_healthy else self.last_error})"


class WorkerPool:
    """The workers of one role."""

    def __init__(self, role: str, urls: tuple[str, ...] | list[str], policy: Policy,
                 prefix_index: PrefixIndex | None = None) -> None:
        if not urls:
            raise ValueError(f"no {role} workers configured")
        self.role = role
        self.policy = policy
        self.prefix_index = prefix_index if policy == "cache_aware" else None
        self.workers = [WorkerState(url.rstrip("/"), role) for url in urls]
        self._rr = itertools.count()

    @property
    def healthy(self) -> list[WorkerState]:
        return [w for w in self.workers if w.is_healthy]

    @property
    def capacity(self) -> int | None:
        """Requests the healthy workers admit at once, summed (None: none is healthy, or one
        does not say: no limit known)."""
        capacities = [w.capacity for w in self.healthy]
        return None if not capacities or None in capacities else sum(capacities)

    def pick(self, block_keys: Sequence[BlockKey] = ()) -> WorkerState:
        """A healthy worker with room by the policy (``block_keys``: the request's prompt blocks,
        for ``cache_aware``); 503 naming every worker's state when none is healthy, 429 when
        every healthy one is at its capacity."""
        healthy = self.healthy
        if not healthy:
            states = "; ".join(w.describe() for w in self.workers)
            raise ServiceUnavailableError(f"no healthy {self.role} worker: {states}",
                                          code=f"no_healthy_{self.role}_worker")
        healthy = [w for w in healthy if w.has_room]
        if not healthy:
            raise QueueFullError(f"every healthy {self.role} worker is at its capacity; retry later")
        start = next(self._rr)
        rotated = [healthy[(start + i) % len(healthy)] for i in range(len(healthy))]
        if self.policy == "round_robin":
            return rotated[0]
        index = self.prefix_index
        if index is None or not block_keys:
            return min(rotated, key=lambda w: w.num_inflight)  # ties: round robin
        chosen = index.choose(rotated, block_keys) or min(rotated, key=lambda w: w.num_inflight)
        index.routed(chosen.url, block_keys)
        return chosen

    def mark_failed(self, worker: WorkerState, error: str) -> None:
        if worker.is_healthy:
            logger.warning("%s worker %s marked unhealthy: %s", self.role, worker.url, error)
        worker.is_healthy = False
        worker.last_error = error

    async def check(self, client: Upstream, timeout_s: float) -> None:
        """One health check of every worker, concurrently."""
        await asyncio.gather(*(self._check_one(client, w, timeout_s) for w in self.workers))

    async def _check_one(self, client: Upstream, worker: WorkerState, timeout_s: float
                         ) -> None:
        try:
            answer = await client.get(f"{worker.url}/ready", timeout_s=timeout_s)
            stats = json.loads(answer.body)
        except UpstreamError as exc:
            self.mark_failed(worker, f"health check failed: {exc}")
            return
        except ValueError as exc:
            self.mark_failed(worker, f"health check failed: {type(exc).__name__}: {exc}")
            return
        if answer.status != 200:
            self.mark_failed(worker, f"health check answered {answer.status}: {_cause(stats)}")
            return
        if not worker.is_healthy:
            logger.info("%s worker %s is healthy", self.role, worker.url)
        worker.is_healthy, worker.last_error = True, None
        worker.stats = stats if isinstance(stats, dict) else {}


def _cause(answer: Any) -> Any:
    """What a failed ``/ready`` answer says: its status, or its OpenAI error message (a 401:
    this router does not hold the worker's internal secret)."""
    if not isinstance(answer, dict):
        return answer
    error = answer.get("error")
    return answer.get("status") or (error.get("message") if isinstance(error, dict) else error)
