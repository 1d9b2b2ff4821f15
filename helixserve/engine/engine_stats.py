"""A snapshot of one engine's load (torch-free): health, load balancing and metrics read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class _CacheStats(Protocol):
    num_blocks: int
    num_used_blocks: int
    num_slots: int
    num_used_slots: int


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot for health, load balancing and metrics."""

    num_running: int
    num_waiting: int
    num_held: int  # finished, cache kept for its gen worker
    num_blocks: int
    num_used_blocks: int
    num_slots: int
    num_used_slots: int

    @classmethod
    def of(cls, num_running: int, num_waiting: int, num_held: int, cache: _CacheStats) -> EngineStats:
        """The snapshot of these queue counts and a cache manager's ``stats()``."""
        return cls(num_running, num_waiting, num_held, cache.num_blocks, cache.num_used_blocks, cache.num_slots,
                   cache.num_used_slots)
