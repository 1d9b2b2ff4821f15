"""KDA state checkpoints: which checkpoint slot holds the recurrent + conv state after which
prefix (torch-free; the tensors are a second set of state pools, :func:`.pools.copy_states`).

A checkpoint is named by the block key (:mod:`.prefix_index`) of the last block of the prefix it
was taken after, so it is valid exactly where the MLA blocks of that prefix are. Lifecycle of one:

1. ``reserve(request_id, key)`` when a prefill chunk that covers a checkpoint position is
   scheduled: a free slot, else the least recently used checkpoint's (evicted); the step writes
   the request's state at that position into it (during the forward, or after it when the
   chunk ends there);
2. ``commit(request_id)`` when that chunk's step is applied: the checkpoint becomes findable
   (``lookup``); one already under that key keeps its place and the new slot goes back;
3. ``drop(request_id)`` when the request's cache is freed before (an abort, a failed step):
   the reserved slots go back unnamed.

A reserved checkpoint is never evicted; a committed one only when a reservation needs its slot.
"""

from __future__ import annotations

from collections import OrderedDict

from helixserve.kvcache.prefix_index import BlockKey


class StateCheckpointPool:
    """Checkpoint slots ``[0, capacity)`` in LRU order (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"checkpoint capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free_ids = list(range(capacity - 1, -1, -1))
        self._by_key: OrderedDict[BlockKey, int] = OrderedDict()  # LRU first
        self._reserved: dict[str, list[tuple[BlockKey, int]]] = {}
        self.num_evictions = 0

    @property
    def num_committed(self) -> int:
        return len(self._by_key)

    @property
    def num_reserved(self) -> int:
        return sum(map(len, self._reserved.values()))

    def has(self, key: BlockKey) -> bool:
        return key in self._by_key

    def lookup(self, key: BlockKey) -> int | None:
        """The slot of the checkpoint after the block keyed ``key`` (now most recently used)."""
        slot = self._by_key.get(key)
        if slot is not None:
            self._by_key.move_to_end(key)
        return slot

    def reserve(self, request_id: str, key: BlockKey) -> int | None:
        """A slot for the checkpoint ``request_id`` takes after block ``key``; ``None`` when every
        slot is reserved (the chunk then runs without saving)."""
        if self._free_ids:
            slot = self._free_ids.pop()
        elif self._by_key:
            _, slot = self._by_key.popitem(last=False)
            self.num_evictions += 1
        else:
            return None
        self._reserved.setdefault(request_id, []).append((key, slot))
        return slot

    def commit(self, request_id: str) -> int:
        """Make ``request_id``'s reserved checkpoints findable; how many were new."""
        num_new = 0
        for key, slot in self._reserved.pop(request_id, ()):
            if key in self._by_key:
                self._free_ids.append(slot)
            else:
                self._by_key[key] = slot
                num_new += 1
        return num_new

    def drop(self, request_id: str) -> None:
        """Give back ``request_id``'s reserved, uncommitted slots."""
        self._free_ids.extend(slot for _, slot in self._reserved.pop(request_id, ()))

    def reset(self) -> None:
        """Forget every committed checkpoint (reserved ones stay)."""
        self._free_ids.extend(self._by_key.values())
        self._by_key.clear()
