"""A snapshot of one engine's load (torch-free): health, load balancing and metrics read it."""

from __future__ import annotations

from dataclasses import dataclass


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
