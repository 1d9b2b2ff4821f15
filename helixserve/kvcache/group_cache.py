"""The cache of a whole CP group, owned by its leader: one :class:`CacheManager` per CP rank
(torch-free).

A CP group's scheduler runs on its leader only; the other ranks hold cache tensors but no
allocator. :class:`GroupCacheManager` keeps the block and slot allocators of every rank of the
group and applies each allocate / extend / free to all of them, so the leader knows every rank's
physical blocks (``handle_on(cp_rank, request_id)``) and sends each rank its own block tables
with the step. Capacity is CP-group-uniform (see :mod:`.manager`): every rank answers each
``can_*`` alike, so the group's answers are rank 0's; the handles the scheduler sees are rank 0's.
Slots come out identical on every rank (same allocator, same calls).
"""

from __future__ import annotations

from helixserve.kvcache.errors import AllocationError
from helixserve.kvcache.helix import full_row_table
from helixserve.kvcache.manager import NO_HIT, CacheHandle, CacheManager, CacheStats, PrefixHit


class GroupCacheManager:
    """The ``CacheManager`` interface over ``cp_size`` per-rank managers (see the module docstring)."""

    prefix_caching = False

    def __init__(self, num_blocks: int, num_slots: int, tokens_per_block: int, cp_size: int,
                 has_mla: bool = True, has_kda: bool = True) -> None:
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        self.tokens_per_block = tokens_per_block
        self.cp_size = cp_size
        self.has_mla, self.has_kda = has_mla, has_kda
        self.num_blocks = num_blocks
        self._full_rows: dict[str, tuple[list[list[int]], list[int]]] = {}  # request -> (rank tables, table)
        self.ranks = [self._rank_manager(num_blocks, num_slots, r) for r in range(cp_size)]

    def _rank_manager(self, num_blocks: int, num_slots: int, cp_rank: int) -> CacheManager:
        """CP rank ``cp_rank``'s manager."""
        return CacheManager(num_blocks, num_slots, self.tokens_per_block, cp_rank=cp_rank, cp_size=self.cp_size,
                            has_mla=self.has_mla, has_kda=self.has_kda)

    @property
    def _leader(self) -> CacheManager:
        return self.ranks[0]

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self._leader.can_ever_fit(num_tokens)

    def can_allocate(self, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        return self._leader.can_allocate(num_tokens, hit)

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> CacheHandle:
        assert hit is NO_HIT, "a CP group caches no prefix"
        handles = [m.allocate(request_id, num_tokens) for m in self.ranks]
        return handles[0]

    def arrange_for_sources(self, request_id: str, num_sources: int) -> None:
        """On every rank: :meth:`CacheManager.arrange_for_sources`."""
        for manager in self.ranks:
            manager.arrange_for_sources(request_id, num_sources)

    def can_extend(self, handle: CacheHandle, new_num_tokens: int) -> bool:
        return self._leader.can_extend(handle, new_num_tokens)

    def try_extend(self, handle: CacheHandle, new_num_tokens: int) -> bool:
        if not self._leader.try_extend(handle, new_num_tokens):
            return False
        for manager in self.ranks[1:]:
            if not manager.try_extend(manager.get(handle.request_id), new_num_tokens):
                raise AllocationError(f"CP rank {manager.cp_rank} could not extend request "
                                      f"{handle.request_id!r} that rank 0 extended (accounting drifted)")
        return True

    def extend(self, handle: CacheHandle, new_num_tokens: int) -> None:
        self._leader.extend(handle, new_num_tokens)
        for manager in self.ranks[1:]:
            manager.extend(manager.get(handle.request_id), new_num_tokens)

    def shrink(self, handle: CacheHandle, new_num_tokens: int) -> None:
        self._leader.shrink(handle, new_num_tokens)
        for manager in self.ranks[1:]:
            manager.shrink(manager.get(handle.request_id), new_num_tokens)

    def free(self, request_id: str) -> None:
        self._full_rows.pop(request_id, None)
        for manager in self.ranks:
            manager.free(request_id)

    def get(self, request_id: str) -> CacheHandle:
        return self._leader.get(request_id)

    def handle_on(self, cp_rank: int, request_id: str) -> CacheHandle:
        """CP rank ``cp_rank``'s handle of ``request_id`` (its own physical blocks)."""
        return self.ranks[cp_rank].get(request_id)

    def full_row_table(self, request_id: str) -> list[int]:
        """``request_id``'s blocks on every rank as one table over ``cp_size * num_blocks`` pages
        (:func:`~helixserve.kvcache.helix.full_row_table`): the draft model's block table. Built
        again only when a rank's table changed (a decode step inside a block reuses it)."""
        tables = [m.get(request_id).block_table() for m in self.ranks]
        cached = self._full_rows.get(request_id)
        if cached is not None and all(a is b for a, b in zip(cached[0], tables)):
            return cached[1]
        table = full_row_table(tables, self.num_blocks)
        self._full_rows[request_id] = (tables, table)
        return table

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leader

    @property
    def num_requests(self) -> int:
        return self._leader.num_requests

    def stats(self) -> CacheStats:
        """The group's totals: blocks and slots summed over its ranks (each holds its own)."""
        parts = [m.stats() for m in self.ranks]
        return CacheStats(*(sum(getattr(p, f) for p in parts) for f in CacheStats.__dataclass_fields__
                            if f != "num_requests"), num_requests=parts[0].num_requests)

    def rank_stats(self) -> list[CacheStats]:
        """Each CP rank's own blocks and slots, in CP rank order."""
        return [m.stats() for m in self.ranks]
