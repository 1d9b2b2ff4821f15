"""Free-list allocators for MLA cache blocks and KDA state slots (torch-free).

Ids are plain ints in ``[0, capacity)``. ``allocate`` is all-or-nothing; ``free`` of an id that
is not currently allocated (double free, foreign or out-of-range id) raises ``AllocationError``
and leaves the allocator unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from helixserve.kvcache.errors import AllocationError, CacheCapacityError


class _IdAllocator:
    _kind = "id"

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{self._kind} capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        # pop() from the end hands out low ids first
        self._free_ids: list[int] = list(range(capacity - 1, -1, -1))
        self._used_ids: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return len(self._used_ids)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free_ids)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of {self._kind}s: {n}")
        if n > len(self._free_ids):
            raise CacheCapacityError(
                f"need {n} {self._kind}s, only {len(self._free_ids)} of {self.capacity} free"
            )
        ids = self._take(n)
        self._used_ids.update(ids)
        return ids

    def _take(self, n: int) -> list[int]:
        """The last `n` free ids, last first (what `n` pops give; one slice, not n calls)."""
        start = len(self._free_ids) - n
        ids = self._free_ids[start:]
        del self._free_ids[start:]
        ids.reverse()
        return ids

    def _give(self, ids: list[int]) -> None:
        self._free_ids.extend(reversed(ids))

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        unique = set(ids)
        if len(unique) != len(ids) or not unique <= self._used_ids:
            bad = [i for i in ids if i not in self._used_ids]
            raise AllocationError(
                f"cannot free {self._kind}s {sorted(bad) or ids}: not allocated "
                f"(double free, duplicate or foreign id; capacity {self.capacity})"
            )
        self._used_ids.difference_update(ids)
        self._give(ids)

    def is_allocated(self, i: int) -> bool:
        return i in self._used_ids


class BlockAllocator(_IdAllocator):
    """Physical MLA cache blocks ``[0, num_blocks)``, the ids of one allocation ascending: whatever
    order blocks were freed in, a request's blocks that happen to be adjacent are adjacent in its
    local order too, so a transfer moves them as one run (in place) rather than block by block."""

    _kind = "block"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)

    def _take(self, n: int) -> list[int]:
        ids = super()._take(n)
        ids.sort()
        return ids

    @property
    def num_blocks(self) -> int:
        return self.capacity


class SlotAllocator(_IdAllocator):
    """KDA recurrent/conv state slots ``[0, num_slots)``, lowest free slot first: a batch's
    sequences tend to hold consecutive ascending slots, which the CPU KDA step reads as one
    contiguous slice of the state pool instead of gathering and scattering every state."""

    _kind = "slot"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._free_ids = list(range(num_slots))  # ascending: already a min-heap

    def _take(self, n: int) -> list[int]:
        return [heapq.heappop(self._free_ids) for _ in range(n)]

    def _give(self, ids: list[int]) -> None:
        for i in ids:
            heapq.heappush(self._free_ids, i)

    @property
    def num_slots(self) -> int:
        return self.capacity
