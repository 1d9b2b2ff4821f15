"""Per-request cache handles: one KDA state slot + the MLA blocks this CP rank owns (torch-free).

Capacity is accounted **CP-group-uniformly**: a request is charged the blocks that CP rank 0 would
hold for it (rank 0 owns logical block 0, so it always holds the most of any rank). Every rank of
a CP group, given the same requests, therefore answers every ``can_*`` identically and never runs
out physically before rank 0 would; ranks ``> 0`` may leave up to one block per request unused.
With ``cp_size == 1`` this is exact accounting.

Check/act pairs: ``can_allocate``/``allocate``, ``can_extend``/``extend``; ``shrink`` gives
back the blocks past a shorter span. An act that does not
fit raises :class:`CacheCapacityError` with the numbers; nothing is ever evicted silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.kvcache.allocator import BlockAllocator, SlotAllocator
from helixserve.kvcache.errors import AllocationError, CacheCapacityError
from helixserve.kvcache.helix import arrange_by_source, num_local_blocks, num_logical_blocks


@dataclass(slots=True)
class CacheHandle:
    """The cache a request holds on this rank.

    Attributes:
        request_id: owner.
        slot: KDA state slot (index into dim 0 of every KDA state/conv tensor), ``None`` when the
            model has no KDA layers.
        block_ids: physical MLA blocks in local order: ``block_ids[k]`` holds global logical
            block ``cp_rank + k * cp_size``.
        num_tokens: tokens the handle has room for (its blocks cover positions ``[0, num_tokens)``).
    """

    request_id: str
    slot: int | None
    block_ids: list[int]
    num_tokens: int
    tokens_per_block: int
    cp_rank: int = 0
    cp_size: int = 1
    # the last default-length table and what it was built from (block_ids list, its length, the
    # logical block count): a decode step reuses it until a block is added
    _table: list[int] | None = field(default=None, repr=False, compare=False)
    _table_key: tuple[object, int, int] | None = field(default=None, repr=False, compare=False)

    @property
    def num_logical_blocks(self) -> int:
        return num_logical_blocks(self.num_tokens, self.tokens_per_block)

    def block_table(self, max_blocks: int | None = None) -> list[int]:
        """Global logical block -> physical block on this rank, ``-1`` where not held here.

        Length ``max_blocks`` (default: the handle's logical block count); entries past the
        allocated blocks are ``-1``. Raises ``ValueError`` if ``max_blocks`` is too small.

        The default-length table is built once per change of the blocks and then returned again
        (the same list object, which callers must not modify): per-step callers such as the
        scheduler and the CUDA-graph runner pay nothing while a request decodes inside a block.
        """
        num_blocks = self.num_logical_blocks
        if max_blocks is None:
            key = (self.block_ids, len(self.block_ids), num_blocks)
            cached = self._table_key
            if cached is not None and cached[0] is key[0] and cached[1:] == key[1:]:
                return self._table  # type: ignore[return-value]
            self._table, self._table_key = self._build_table(num_blocks), key
            return self._table
        if max_blocks < num_blocks:
            raise ValueError(
                f"request {self.request_id!r} spans {num_blocks} logical blocks "
                f"({self.num_tokens} tokens), more than max_blocks={max_blocks}"
            )
        return self._build_table(max_blocks)

    def _build_table(self, length: int) -> list[int]:
        table = [-1] * length
        n = len(self.block_ids)
        table[self.cp_rank : self.cp_rank + n * self.cp_size : self.cp_size] = self.block_ids
        return table


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """The cached prefix a request can start from (:mod:`.prefix_manager`): ``num_tokens`` tokens
    in ``block_ids`` (held by the hit once allocated), the KDA state after them in state
    checkpoint ``checkpoint`` (``None`` without KDA layers or without a hit)."""

    num_tokens: int = 0
    block_ids: tuple[int, ...] = ()
    checkpoint: int | None = None
    # a helix CP group's hit: each CP rank's blocks of it (``block_ids`` is rank 0's)
    rank_block_ids: tuple[tuple[int, ...], ...] = ()


NO_HIT = PrefixHit()


@dataclass(slots=True, frozen=True)
class CacheStats:
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_reserved_blocks: int  # CP-group-uniform charge (== num_used_blocks when cp_size == 1)
    num_slots: int
    num_used_slots: int
    num_free_slots: int
    num_requests: int


class CacheManager:
    """Owns the block and slot allocators of one rank and the handles of its requests."""

    prefix_caching = False  # reuses no prefix: every hit is NO_HIT

    def __init__(
        self,
        num_blocks: int,
        num_slots: int,
        tokens_per_block: int,
        cp_rank: int = 0,
        cp_size: int = 1,
        has_mla: bool = True,
        has_kda: bool = True,
    ) -> None:
        num_local_blocks(0, tokens_per_block, cp_rank, cp_size)  # validates the three
        self.tokens_per_block = tokens_per_block
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.has_mla = has_mla
        self.has_kda = has_kda
        self.blocks = BlockAllocator(num_blocks if has_mla else 0)
        self.slots = SlotAllocator(num_slots if has_kda else 0)
        self._handles: dict[str, CacheHandle] = {}
        self._num_reserved_blocks = 0

    # -- sizes -------------------------------------------------------------------------------

    def _charge(self, num_tokens: int) -> int:
        """Blocks a ``num_tokens`` sequence is charged (rank 0's share)."""
        if not self.has_mla:
            return 0
        return num_local_blocks(num_tokens, self.tokens_per_block, 0, self.cp_size)

    def _local(self, num_tokens: int) -> int:
        if not self.has_mla:
            return 0
        return num_local_blocks(num_tokens, self.tokens_per_block, self.cp_rank, self.cp_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one ``num_tokens`` sequence fits in the whole (empty) cache."""
        has_slot = self.slots.capacity >= 1 or not self.has_kda
        return has_slot and self._charge(num_tokens) <= self.blocks.capacity

    # -- allocate / extend / free ---------------------------------------------------------

    def can_allocate(self, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        assert hit is NO_HIT, "this manager caches no prefix"
        has_slot = self.slots.num_free >= 1 or not self.has_kda
        return has_slot and self._num_reserved_blocks + self._charge(num_tokens) <= self.blocks.capacity

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> CacheHandle:
        """Take a slot and the local blocks for positions ``[0, num_tokens)``."""
        assert hit is NO_HIT, "this manager caches no prefix"
        if request_id in self._handles:
            raise AllocationError(f"request {request_id!r} already holds a cache handle")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if not self.can_allocate(num_tokens):
            raise CacheCapacityError(
                f"cannot allocate request {request_id!r} ({num_tokens} tokens): "
                f"{self._need_message(self._charge(num_tokens), need_slot=self.has_kda)}"
            )
        slot = self.slots.allocate(1)[0] if self.has_kda else None
        block_ids = self.blocks.allocate(self._local(num_tokens))
        self._num_reserved_blocks += self._charge(num_tokens)
        handle = CacheHandle(
            request_id, slot, block_ids, num_tokens, self.tokens_per_block, self.cp_rank, self.cp_size
        )
        self._handles[request_id] = handle
        return handle

    def arrange_for_sources(self, request_id: str, num_sources: int) -> None:
        """Reassign a just-allocated request's blocks so each of ``num_sources`` ctx ranks' part is
        one run where the blocks are (:func:`~.helix.arrange_by_source`); before anything is
        written to or published from them."""
        handle = self.get(request_id)
        handle.block_ids = arrange_by_source(handle.block_ids, self.cp_rank, self.cp_size, num_sources)
        handle._table = handle._table_key = None

    def can_extend(self, handle: CacheHandle, new_num_tokens: int) -> bool:
        self._own(handle)
        extra = self._charge(max(new_num_tokens, handle.num_tokens)) - self._charge(handle.num_tokens)
        return self._num_reserved_blocks + extra <= self.blocks.capacity

    def try_extend(self, handle: CacheHandle, new_num_tokens: int) -> bool:
        """``extend`` if ``can_extend``; returns whether it did. A step that stays inside the
        handle's last logical block (most decode steps) only moves ``num_tokens``."""
        if (new_num_tokens >= handle.num_tokens
                and num_logical_blocks(new_num_tokens, handle.tokens_per_block) == handle.num_logical_blocks):
            self._own(handle)
            handle.num_tokens = new_num_tokens  # same logical blocks: same charge, same local blocks
            return True
        if not self.can_extend(handle, new_num_tokens):
            return False
        self.extend(handle, new_num_tokens)
        return True

    def extend(self, handle: CacheHandle, new_num_tokens: int) -> None:
        """Grow ``handle`` to cover ``[0, new_num_tokens)``; adds blocks this rank owns."""
        self._own(handle)
        if new_num_tokens < handle.num_tokens:
            raise ValueError(
                f"cannot shrink request {handle.request_id!r} from {handle.num_tokens} "
                f"to {new_num_tokens} tokens"
            )
        extra = self._charge(new_num_tokens) - self._charge(handle.num_tokens)
        if not self.can_extend(handle, new_num_tokens):
            raise CacheCapacityError(
                f"cannot extend request {handle.request_id!r} from {handle.num_tokens} to "
                f"{new_num_tokens} tokens: {self._need_message(extra, need_slot=False)}"
            )
        num_new = self._local(new_num_tokens) - len(handle.block_ids)
        handle.block_ids.extend(self.blocks.allocate(num_new))
        self._num_reserved_blocks += extra
        handle.num_tokens = new_num_tokens

    def shrink(self, handle: CacheHandle, new_num_tokens: int) -> None:
        """Cover only ``[0, new_num_tokens)``: the blocks this rank holds past it go back (positions
        written for draft tokens the target rejected). Block ``b`` stays on rank ``b % cp_size``,
        so the handle keeps exactly the local blocks of the shorter span."""
        self._own(handle)
        if not 0 <= new_num_tokens <= handle.num_tokens:
            raise ValueError(f"cannot shrink request {handle.request_id!r} from {handle.num_tokens} "
                             f"to {new_num_tokens} tokens")
        keep = self._local(new_num_tokens)
        if keep < len(handle.block_ids):
            self.blocks.free(handle.block_ids[keep:])
            del handle.block_ids[keep:]
            handle._table_key = None  # noqa: SLF001 - a re-extend may reach the same length with other blocks
        self._num_reserved_blocks -= self._charge(handle.num_tokens) - self._charge(new_num_tokens)
        handle.num_tokens = new_num_tokens

    def free(self, request_id: str) -> None:
        """Return the request's slot and blocks."""
        handle = self._handles.pop(request_id, None)
        if handle is None:
            raise AllocationError(f"request {request_id!r} holds no cache handle")
        self.blocks.free(handle.block_ids)
        if handle.slot is not None:
            self.slots.free([handle.slot])
        self._num_reserved_blocks -= self._charge(handle.num_tokens)
        handle.block_ids = []
        handle.slot = None
        handle.num_tokens = 0

    # -- queries -----------------------------------------------------------------------------

    def get(self, request_id: str) -> CacheHandle:
        handle = self._handles.get(request_id)
        if handle is None:
            raise AllocationError(f"request {request_id!r} holds no cache handle")
        return handle

    def full_row_table(self, request_id: str) -> list[int]:
        """``request_id``'s block table, every block being this rank's: the draft model's (as
        ``GroupCacheManager.full_row_table`` is a CP group's)."""
        return self.get(request_id).block_table()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._handles

    @property
    def num_requests(self) -> int:
        return len(self._handles)

    def stats(self) -> CacheStats:
        return CacheStats(
            num_blocks=self.blocks.capacity,
            num_used_blocks=self.blocks.num_used,
            num_free_blocks=self.blocks.num_free,
            num_reserved_blocks=self._num_reserved_blocks,
            num_slots=self.slots.capacity,
            num_used_slots=self.slots.num_used,
            num_free_slots=self.slots.num_free,
            num_requests=len(self._handles),
        )

    def rank_stats(self) -> list[CacheStats]:
        """Each CP rank's own blocks and slots (this manager is one rank's): ``[stats()]``, as
        :meth:`~helixserve.kvcache.group_cache.GroupCacheManager.rank_stats` gives a group's."""
        return [self.stats()]

    def _own(self, handle: CacheHandle) -> None:
        if self._handles.get(handle.request_id) is not handle:
            raise AllocationError(f"handle of request {handle.request_id!r} is not live here")

    def _need_message(self, num_blocks: int, need_slot: bool) -> str:
        return (
            f"need {num_blocks} blocks (charged per CP group, cp_size={self.cp_size}) "
            f"and {int(need_slot)} slot; {self.blocks.capacity - self._num_reserved_blocks} of "
            f"{self.blocks.capacity} blocks and {self.slots.num_free} of "
            f"{self.slots.capacity} slots free"
        )
