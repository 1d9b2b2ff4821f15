"""A :class:`~.manager.CacheManager` that reuses cached prefixes (torch-free): one process's, or
one CP rank's blocks under a helix group's :class:`~.group_prefix.GroupPrefixCacheManager`.

MLA blocks are named by content (:class:`~.prefix_index.PrefixBlockPool`) and KDA states are
checkpointed at block-aligned positions (:class:`~.state_checkpoints.StateCheckpointPool`). A
request's life here:

1. ``find_prefix``: the longest prefix of its full blocks that is cached, with (on a model with
   KDA layers) a state checkpoint after its last block, and at most ``num_tokens - 1`` tokens
   (one token is always computed, for the logits);
2. ``allocate(..., hit)``: holds the hit's blocks, takes new ones for the rest and a fresh state
   slot, which the first chunk's ``plan_chunk`` restores from the hit's checkpoint;
3. ``plan_chunk``: a prefill chunk reserves a checkpoint slot for each checkpoint position it
   covers (every ``checkpoint_interval_blocks`` blocks and the last full block before the
   prompt's last token) that has no checkpoint yet; the state at its end is copied after the
   step, the states at positions inside it are taken by the KDA layers during the forward (the
   chunk is not cut there: one step, whatever the checkpoints);
4. ``commit_computed``: once a step is applied, the blocks it completed are published and its
   checkpoint committed;
5. ``free``: blocks drop a reference (cached ones stay, evictable in LRU order), reserved
   checkpoints go back. ``shrink`` (rejected drafts) unpublishes a block it gives back.

Capacity is exact: blocks in use are the blocks some request holds on this rank; evictable cached
blocks count as free, and a hit's blocks already held by another request cost nothing more. A
CP rank (``cp_rank`` of ``cp_size``) names, matches and publishes only the logical blocks it holds
(``b % cp_size == cp_rank``); the group combines the ranks' matches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from helixserve.kvcache.errors import AllocationError, CacheCapacityError
from helixserve.kvcache.manager import NO_HIT, CacheHandle, CacheManager, PrefixHit
from helixserve.kvcache.prefix_events import PrefixEventLog
from helixserve.kvcache.prefix_index import BlockKey, PrefixBlockPool, root_key
from helixserve.kvcache.prefix_snapshot import PrefixCacheSnapshot
from helixserve.kvcache.state_checkpoints import StateCheckpointPool

TokenRange = Callable[[int, int], list[int]]  # (start, stop) -> the request's token ids there


@dataclass(slots=True, frozen=True)
class ChunkPlan:
    """Where a prefill chunk stops, the state checkpoint it restores before, the one it saves
    after (at ``stop``) and those it saves at positions inside it (``(position, checkpoint)``,
    taken by the KDA layers during the step's forward)."""

    stop: int
    restore_checkpoint: int | None = None
    save_checkpoint: int | None = None
    inner_saves: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class PrefixStats:
    """Counters since start, at admission: requests and their tokens looked up, and found cached."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_queries: int = 0
    num_hits: int = 0


class PrefixCachingCacheManager(CacheManager):
    """See the module docstring."""

    prefix_caching = True

    def __init__(self, num_blocks: int, num_slots: int, tokens_per_block: int, num_checkpoint_slots: int,
                 checkpoint_interval_blocks: int, has_mla: bool = True, has_kda: bool = True,
                 events: PrefixEventLog | None = None, cp_rank: int = 0, cp_size: int = 1) -> None:
        super().__init__(num_blocks, num_slots, tokens_per_block, cp_rank, cp_size, has_mla, has_kda)
        if checkpoint_interval_blocks < 1:
            raise ValueError(f"checkpoint_interval_blocks must be >= 1, got {checkpoint_interval_blocks}")
        self.blocks = PrefixBlockPool(num_blocks if has_mla else 0, events)  # type: ignore[assignment]
        self.checkpoints = StateCheckpointPool(num_checkpoint_slots if has_kda else 0)
        self.checkpoint_interval = checkpoint_interval_blocks * tokens_per_block
        self.prefix_stats = PrefixStats()
        self._num_published: dict[str, int] = {}
        self._restores: dict[str, int] = {}

    @property
    def events(self) -> PrefixEventLog | None:
        """The pool's stored / removed block events (the router's index), if kept."""
        return self.blocks.events

    def snapshot(self) -> PrefixCacheSnapshot:
        """The cache's counters and gauges now (``/metrics``)."""
        stats = self.prefix_stats
        return PrefixCacheSnapshot(stats.num_queried_tokens, stats.num_hit_tokens, self.blocks.num_evictions,
                                   self.blocks.num_cached, self.checkpoints.num_committed, self.checkpoints.capacity)

    # -- 1. find, 2. allocate --------------------------------------------------------------------

    def find_prefix(self, keys: Sequence[BlockKey], token_ids: Sequence[int], cache_salt: str | None) -> PrefixHit:
        """The prefix ``token_ids`` (whose full blocks' keys are ``keys``) can start from."""
        if not self.has_mla:
            return NO_HIT
        n, block_ids = self.match_blocks(keys, token_ids, cache_salt)
        n = self.checkpointed(keys, n)
        if not n:
            return NO_HIT
        checkpoint = self.checkpoints.lookup(keys[n - 1]) if self.has_kda else None
        return PrefixHit(n * self.tokens_per_block, tuple(block_ids[:self.local_blocks(n)]), checkpoint)

    def match_blocks(self, keys: Sequence[BlockKey], token_ids: Sequence[int], cache_salt: str | None
                     ) -> tuple[int, list[int]]:
        """``(n, block_ids)``: the first ``n`` logical blocks of the request (at most
        ``num_tokens - 1`` tokens: one is always computed, for the logits) are cached as far as
        this rank holds them, in ``block_ids`` (this rank's, in local order, maybe one more)."""
        usable = min(len(keys), (len(token_ids) - 1) // self.tokens_per_block)
        block_ids = self.blocks.match(keys[:usable], token_ids, self.tokens_per_block, cache_salt,
                                      self.cp_rank, self.cp_size)
        return min(usable, self.cp_rank + len(block_ids) * self.cp_size), block_ids

    def checkpointed(self, keys: Sequence[BlockKey], n: int) -> int:
        """The longest ``m <= n`` whose block ``m - 1`` has a state checkpoint (``n`` without KDA
        layers)."""
        if self.has_kda:
            while n and not self.checkpoints.has(keys[n - 1]):
                n -= 1
        return n

    def _charge(self, num_tokens: int) -> int:
        """Exact accounting: a request is charged the blocks this rank holds for it."""
        return self._local(num_tokens)

    def local_blocks(self, num_logical: int) -> int:
        """The blocks this rank holds of the first ``num_logical`` logical blocks."""
        return self._local(num_logical * self.tokens_per_block)

    def can_allocate(self, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        has_slot = self.slots.num_free >= 1 or not self.has_kda
        need = self._local(num_tokens) - len(hit.block_ids) + self.blocks.num_evictable_of(hit.block_ids)
        return has_slot and need <= self.blocks.num_free

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> CacheHandle:
        """A slot, the hit's blocks and new local blocks for positions ``[0, num_tokens)``."""
        if request_id in self._handles:
            raise AllocationError(f"request {request_id!r} already holds a cache handle")
        if not 0 <= hit.num_tokens < max(num_tokens, 1):
            raise ValueError(f"a hit of {hit.num_tokens} tokens for a {num_tokens}-token request")
        if not self.can_allocate(num_tokens, hit):
            raise CacheCapacityError(
                f"cannot allocate request {request_id!r} ({num_tokens} tokens, {hit.num_tokens} cached): "
                f"{self._need_message(self._local(num_tokens) - len(hit.block_ids), need_slot=self.has_kda)}")
        slot = self.slots.allocate(1)[0] if self.has_kda else None
        self.blocks.acquire(hit.block_ids)  # before allocate: held blocks are never evicted
        block_ids = [*hit.block_ids, *self.blocks.allocate(self._local(num_tokens) - len(hit.block_ids))]
        handle = CacheHandle(request_id, slot, block_ids, num_tokens, self.tokens_per_block, self.cp_rank, self.cp_size)
        self._handles[request_id] = handle
        self._num_reserved_blocks = self.blocks.num_used
        self._num_published[request_id] = len(hit.block_ids)
        if hit.checkpoint is not None:
            self._restores[request_id] = hit.checkpoint
        stats = self.prefix_stats
        stats.num_queries += 1
        stats.num_queried_tokens += num_tokens
        stats.num_hits += int(hit.num_tokens > 0)
        stats.num_hit_tokens += hit.num_tokens
        return handle

    # -- 3. chunks, 4. publish -----------------------------------------------------------------

    def plan_chunk(self, request_id: str, keys: Sequence[BlockKey], num_prompt_tokens: int, start: int,
                   stop: int) -> ChunkPlan:
        """The checkpoints the prefill chunk ``[start, stop)`` of ``request_id`` restores and saves
        (``keys``: the request's block keys through ``stop``); it stops at ``stop``."""
        restore = self._restores.pop(request_id, None)
        if not self.has_kda or not self.checkpoints.capacity:
            return ChunkPlan(stop, restore)
        saves: list[tuple[int, int]] = []
        for position in self._checkpoint_positions(num_prompt_tokens, start, min(stop, len(keys) * self.tokens_per_block)):
            key = keys[position // self.tokens_per_block - 1]
            if self.checkpoints.has(key):
                continue
            slot = self.checkpoints.reserve(request_id, key)
            if slot is None:
                break
            saves.append((position, slot))
        at_stop = saves.pop()[1] if saves and saves[-1][0] == stop else None
        return ChunkPlan(stop, restore, at_stop, tuple(saves))

    def _checkpoint_positions(self, num_prompt_tokens: int, start: int, stop: int) -> list[int]:
        """Checkpoint positions in ``(start, stop]``, ascending."""
        interval = self.checkpoint_interval
        positions = set(range((start // interval + 1) * interval, stop + 1, interval))
        # the last full block before the prompt's last token: where the same prompt again resumes
        last_full = (num_prompt_tokens - 1) // self.tokens_per_block * self.tokens_per_block
        if start < last_full <= stop:
            positions.add(last_full)
        return sorted(positions)

    def commit_computed(self, request_id: str, keys: Sequence[BlockKey], token_ids: TokenRange,
                        cache_salt: str | None, num_computed_tokens: int) -> None:
        """Publish ``request_id``'s blocks its first ``num_computed_tokens`` tokens fill and commit
        its reserved checkpoints (its step was applied)."""
        published = self._num_published.get(request_id)
        if published is None:
            return
        full = min(num_computed_tokens // self.tokens_per_block, len(keys))
        if full > published:
            block_ids, size = self._handles[request_id].block_ids, self.tokens_per_block
            tokens = token_ids(published * size, full * size)
            for b in range(published, full):
                if b % self.cp_size != self.cp_rank:
                    continue  # another CP rank holds it
                parent = keys[b - 1] if b else root_key(cache_salt)
                offset = (b - published) * size
                self.blocks.publish(block_ids[b // self.cp_size], keys[b], parent, tokens[offset:offset + size],
                                    cache_salt)
            self._num_published[request_id] = full
        self.checkpoints.commit(request_id)

    def exclude(self, request_id: str) -> None:
        """``request_id`` publishes nothing: its cache was filled from elsewhere (a KV transfer),
        not by this engine's prefill of its tokens."""
        self._num_published.pop(request_id, None)

    # -- 5. give back ----------------------------------------------------------------------------

    def extend(self, handle: CacheHandle, new_num_tokens: int) -> None:
        super().extend(handle, new_num_tokens)
        self._num_reserved_blocks = self.blocks.num_used

    def shrink(self, handle: CacheHandle, new_num_tokens: int) -> None:
        """As the base class; a block given back that this request alone held and had published
        is unpublished first (its positions past the span hold rejected drafts)."""
        self._own(handle)
        keep = self._local(new_num_tokens) if 0 <= new_num_tokens <= handle.num_tokens else len(handle.block_ids)
        for block_id in handle.block_ids[keep:]:
            if self.blocks.refs(block_id) == 1:
                self.blocks.unpublish(block_id)
        rid = handle.request_id
        if rid in self._num_published:
            self._num_published[rid] = min(self._num_published[rid], new_num_tokens // self.tokens_per_block)
        super().shrink(handle, new_num_tokens)
        self._num_reserved_blocks = self.blocks.num_used

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._num_reserved_blocks = self.blocks.num_used
        self._num_published.pop(request_id, None)
        self._restores.pop(request_id, None)
        self.checkpoints.drop(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds and every committed checkpoint; the number
        of blocks evicted."""
        self.checkpoints.reset()
        return self.blocks.reset()
