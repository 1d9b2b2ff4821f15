"""One engine's prefix cache at a moment (torch-free): what ``/metrics`` shows of it, and the
sum over a world's CP groups (each group's leader reports its own after every step)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class PrefixCacheSnapshot:
    """Counters since start (tokens looked up at admission and found cached, blocks evicted) and
    gauges (blocks named by content, held or evictable; KDA state checkpoints kept, and slots)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    cached_blocks: int = 0
    checkpoints_used: int = 0
    checkpoints_total: int = 0

    @classmethod
    def total(cls, parts: Iterable[PrefixCacheSnapshot]) -> PrefixCacheSnapshot:
        """Several engines' (a world's CP groups') summed, field by field."""
        parts = list(parts)
        return cls(*(sum(getattr(p, f.name) for p in parts) for f in fields(cls)))
