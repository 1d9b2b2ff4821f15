"""When a finished or preempted request's cache is freed (torch-free): held caches and frees
deferred past steps still on the device.

- **Held.** A request with ``hold_cache_on_finish`` (a ctx worker's prefill awaiting its gen worker) that
  finishes by stop or length keeps its cache: it no longer runs or counts as unfinished, but its
  blocks and slot stay allocated until ``release(request_id)``. An abort or error frees at once.
- **Deferred.** A request in a step scheduled ahead (``Scheduler.schedule_ahead``) and not yet
  updated may still have its cache written by the device; freeing it waits until that step is
  updated (``step_updated``) or forgotten (``clear_in_flight``).
"""

from __future__ import annotations

from collections.abc import Iterable

from helixserve.engine.request import Request, RequestStatus
from helixserve.kvcache.manager import CacheManager

_HOLDABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class CacheReleases:
    """The scheduler's frees go through here; it owns the held requests and deferred frees."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self._held: dict[str, Request] = {}  # finished, cache kept for its gen worker until release()
        # requests of a step scheduled ahead and not yet updated: caches freed once it is
        self._in_flight: set[str] = set()
        self._deferred_frees: list[str] = []

    @property
    def num_held(self) -> int:
        return len(self._held)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def finish(self, request: Request, status: RequestStatus) -> None:
        """A running request finishes with ``status``: hold its cache or free it."""
        if request.hold_cache_on_finish and status in _HOLDABLE:
            self._held[request.request_id] = request
        else:
            self.free(request.request_id)

    def release(self, request_id: str) -> bool:
        """Free the cache of a held request; False when ``request_id`` is not held."""
        if self._held.pop(request_id, None) is None:
            return False
        self.cache.free(request_id)
        return True

    def free(self, request_id: str) -> None:
        """Free now, or once the step ahead that holds ``request_id`` is updated."""
        if request_id in self._in_flight:
            self._deferred_frees.append(request_id)
        else:
            self.cache.free(request_id)

    def add_in_flight(self, request_ids: Iterable[str]) -> None:
        """The requests of a step just scheduled ahead."""
        self._in_flight.update(request_ids)

    def step_updated(self, in_flight_ids: Iterable[str]) -> None:
        """A step was updated; ``in_flight_ids`` are those of the step ahead still pending."""
        if self._deferred_frees or self._in_flight:
            self._in_flight = set(in_flight_ids)
            self._free_deferred()

    def clear_in_flight(self) -> None:
        """The pending steps were forgotten: free every deferred cache."""
        self._in_flight.clear()
        self._free_deferred()

    def _free_deferred(self) -> None:
        for rid in self._deferred_frees:
            if rid not in self._in_flight:
                self.cache.free(rid)
        self._deferred_frees = [rid for rid in self._deferred_frees if rid in self._in_flight]
