"""Prefix caching for a helix CP group, owned by its leader (torch-free).

:class:`GroupPrefixCacheManager` is a :class:`~.group_cache.GroupCacheManager` whose ranks are
:class:`~.prefix_manager.PrefixCachingCacheManager` s: each CP rank names, matches, publishes and
evicts the logical blocks it holds (``b % cp_size == rank``) in its own pool, with exact
accounting of its own blocks. The KDA state checkpoints are the group's: one pool of checkpoint
slots, kept by rank 0's manager; every rank's runner copies its own head slice of the state into
the same checkpoint slot (the leader sends the slot numbers with each rank's step).

A group's hit is the longest prefix that every rank holds its blocks of and that has a state
checkpoint after its last block; each rank then allocates from its own blocks of that prefix
(:attr:`~.manager.PrefixHit.rank_block_ids`). A request can be allocated only when every rank has
room for it; each rank evicts from its own LRU.

Every rank's pool records its blocks' stored / removed events into one
:class:`~.prefix_events.PrefixEventLog` (a block's key names its position, so one rank holds it):
what the group caches, for the router's index (a ctx world's ``/v1/prefix_events``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from helixserve.kvcache.group_cache import GroupCacheManager
from helixserve.kvcache.manager import NO_HIT, CacheHandle, CacheManager, PrefixHit
from helixserve.kvcache.prefix_events import PrefixEventLog
from helixserve.kvcache.prefix_index import BlockKey
from helixserve.kvcache.prefix_manager import ChunkPlan, PrefixCachingCacheManager, PrefixStats, TokenRange
from helixserve.kvcache.prefix_snapshot import PrefixCacheSnapshot
from helixserve.kvcache.state_checkpoints import StateCheckpointPool


class GroupPrefixCacheManager(GroupCacheManager):
    """See the module docstring."""

    prefix_caching = True

    def __init__(self, num_blocks: int, num_slots: int, tokens_per_block: int, cp_size: int,
                 num_checkpoint_slots: int, checkpoint_interval_blocks: int, has_mla: bool = True,
                 has_kda: bool = True, events: PrefixEventLog | None = None) -> None:
        self._num_checkpoint_slots, self._interval = num_checkpoint_slots, checkpoint_interval_blocks
        self.events = events  # every rank's stored / removed blocks, one log (the router's index)
        super().__init__(num_blocks, num_slots, tokens_per_block, cp_size, has_mla, has_kda)
        self.prefix_ranks: list[PrefixCachingCacheManager] = self.ranks  # type: ignore[assignment]

    def _rank_manager(self, num_blocks: int, num_slots: int, cp_rank: int) -> CacheManager:
        checkpoints = self._num_checkpoint_slots if cp_rank == 0 else 0  # the group's pool: rank 0's
        return PrefixCachingCacheManager(num_blocks, num_slots, self.tokens_per_block, checkpoints, self._interval,
                                         self.has_mla, self.has_kda, self.events, cp_rank=cp_rank,
                                         cp_size=self.cp_size)

    @property
    def checkpoints(self) -> StateCheckpointPool:
        return self.prefix_ranks[0].checkpoints

    @property
    def prefix_stats(self) -> PrefixStats:
        return self.prefix_ranks[0].prefix_stats

    def snapshot(self) -> PrefixCacheSnapshot:
        """The group's cache now (``/metrics``): its lookups and checkpoints (rank 0 keeps them),
        every rank's cached blocks and evictions."""
        leader = self.prefix_ranks[0].snapshot()
        return replace(leader, evictions=sum(m.blocks.num_evictions for m in self.prefix_ranks),
                       cached_blocks=sum(m.blocks.num_cached for m in self.prefix_ranks))

    def find_prefix(self, keys: Sequence[BlockKey], token_ids: Sequence[int], cache_salt: str | None) -> PrefixHit:
        """The prefix every rank holds and a checkpoint follows (see the module docstring)."""
        if not self.has_mla:
            return NO_HIT
        matches = [m.match_blocks(keys, token_ids, cache_salt) for m in self.prefix_ranks]
        leader = self.prefix_ranks[0]
        n = leader.checkpointed(keys, min(n for n, _ in matches))
        if not n:
            return NO_HIT
        checkpoint = self.checkpoints.lookup(keys[n - 1]) if self.has_kda else None
        per_rank = tuple(tuple(ids[:m.local_blocks(n)]) for m, (_, ids) in zip(self.prefix_ranks, matches))
        return PrefixHit(n * self.tokens_per_block, per_rank[0], checkpoint, per_rank)

    def _rank_hit(self, hit: PrefixHit, cp_rank: int) -> PrefixHit:
        if hit is NO_HIT:
            return NO_HIT
        return replace(hit, block_ids=hit.rank_block_ids[cp_rank], checkpoint=hit.checkpoint if cp_rank == 0 else None,
                       rank_block_ids=())

    def can_allocate(self, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        return all(m.can_allocate(num_tokens, self._rank_hit(hit, r)) for r, m in enumerate(self.prefix_ranks))

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> CacheHandle:
        handles = [m.allocate(request_id, num_tokens, self._rank_hit(hit, r)) for r, m in enumerate(self.prefix_ranks)]
        return handles[0]

    def can_extend(self, handle: CacheHandle, new_num_tokens: int) -> bool:
        return all(m.can_extend(m.get(handle.request_id), new_num_tokens) for m in self.ranks)

    def try_extend(self, handle: CacheHandle, new_num_tokens: int) -> bool:
        if not self.can_extend(handle, new_num_tokens):
            return False
        self.extend(handle, new_num_tokens)
        return True

    def plan_chunk(self, request_id: str, keys: Sequence[BlockKey], num_prompt_tokens: int, start: int,
                   stop: int) -> ChunkPlan:
        """The group's checkpoint plan for the chunk (rank 0's pool; every rank copies alike)."""
        return self.prefix_ranks[0].plan_chunk(request_id, keys, num_prompt_tokens, start, stop)

    def commit_computed(self, request_id: str, keys: Sequence[BlockKey], token_ids: TokenRange,
                        cache_salt: str | None, num_computed_tokens: int) -> None:
        """Every rank publishes the computed blocks it holds; the group's checkpoints commit."""
        for manager in self.prefix_ranks:
            manager.commit_computed(request_id, keys, token_ids, cache_salt, num_computed_tokens)

    def exclude(self, request_id: str) -> None:
        for manager in self.prefix_ranks:
            manager.exclude(request_id)

    def reset_prefix_cache(self) -> int:
        return sum(m.reset_prefix_cache() for m in self.prefix_ranks)
