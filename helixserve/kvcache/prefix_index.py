"""MLA blocks named by content, reference-counted, kept in LRU order once freed (torch-free).

A full block of ``tokens_per_block`` tokens is named by a hash chain: block ``k``'s key is
BLAKE2b-128 over block ``k - 1``'s key and block ``k``'s token ids; block 0 chains from a root
key of the request's ``cache_salt`` (``None`` and ``""`` differ from every other salt). A cached
block stores its parent key, its token ids and its salt, and a lookup compares all three: a hit
never hands a request another prompt's tokens unless two different prefixes collide in
BLAKE2b-128 at the parent key (about 2^64 tries by the birthday bound), and never crosses salts.

:class:`PrefixBlockPool` has :class:`~helixserve.kvcache.allocator.BlockAllocator`'s interface:
``num_free`` counts the never-cached free blocks plus the cached blocks no request holds (the
*evictable* ones), ``allocate`` takes free blocks first and then evicts the least recently freed
cached blocks, and ``free`` drops one reference. Only a block with no reference is ever evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from helixserve.kvcache.errors import AllocationError, CacheCapacityError
from helixserve.kvcache.prefix_events import PrefixEventLog

BlockKey = bytes
_KEY_BYTES = 16


def root_key(cache_salt: str | None) -> BlockKey:
    """The parent key of block 0 for ``cache_salt``."""
    tag = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(b"helixserve-prefix" + tag, digest_size=_KEY_BYTES).digest()


def block_key(parent: BlockKey, token_ids: Sequence[int]) -> BlockKey:
    """Block key of ``token_ids`` (one full block) after the block keyed ``parent``."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=_KEY_BYTES).digest()


def append_block_keys(keys: list[BlockKey], new_token_ids: Sequence[int], tokens_per_block: int,
                      cache_salt: str | None) -> list[BlockKey]:
    """Append to ``keys`` the keys of the full blocks of ``new_token_ids``, the tokens from
    position ``len(keys) * tokens_per_block`` on."""
    for start in range(0, len(new_token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = keys[-1] if keys else root_key(cache_salt)
        keys.append(block_key(parent, new_token_ids[start:start + tokens_per_block]))
    return keys


@dataclass(slots=True, frozen=True)
class _CachedBlock:
    key: BlockKey
    parent: BlockKey
    token_ids: tuple[int, ...]
    cache_salt: str | None


class PrefixBlockPool:
    """Physical blocks ``[0, capacity)`` with reference counts and a content index (module docstring)."""

    def __init__(self, capacity: int, events: PrefixEventLog | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"block capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free_ids: list[int] = list(range(capacity - 1, -1, -1))  # never cached (or unpublished)
        self._refs: dict[int, int] = {}  # held blocks -> holders
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none; LRU first
        self._by_key: dict[BlockKey, int] = {}
        self._cached: dict[int, _CachedBlock] = {}
        self.num_evictions = 0
        self.events = events  # block-stored / block-removed events for the router, if kept

    # -- the BlockAllocator interface ---------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_blocks(self) -> int:
        return self.capacity

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each held once: free ones first, then evicted LRU cached ones."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_free:
            raise CacheCapacityError(f"need {n} blocks, only {self.num_free} of {self.capacity} free")
        ids = []
        for _ in range(n):
            if self._free_ids:
                ids.append(self._free_ids.pop())
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._unpublish(block_id)
                self.num_evictions += 1
                ids.append(block_id)
        for block_id in ids:
            self._refs[block_id] = 1
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference of each block; a cached block no one holds becomes evictable (the
        last of ``ids`` first: a request's tail goes before its prefix), any other is free."""
        ids = list(ids)
        bad = [i for i in ids if i not in self._refs]
        if bad or len(set(ids)) != len(ids):
            raise AllocationError(f"cannot free blocks {sorted(bad) or ids}: not allocated "
                                  f"(double free, duplicate or foreign id; capacity {self.capacity})")
        for block_id in reversed(ids):
            self._refs[block_id] -= 1
            if self._refs[block_id]:
                continue
            del self._refs[block_id]
            if block_id in self._cached:
                self._evictable[block_id] = None
            else:
                self._free_ids.append(block_id)

    def is_allocated(self, i: int) -> bool:
        return i in self._refs

    # -- content ------------------------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        """Blocks in the content index (held or evictable)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refs(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    def match(self, keys: Sequence[BlockKey], token_ids: Sequence[int], tokens_per_block: int,
              cache_salt: str | None, first: int = 0, stride: int = 1) -> list[int]:
        """The cached blocks of the longest run of blocks ``first, first + stride, ...`` of
        ``keys`` whose parent keys, token ids and salt all equal the request's
        (``token_ids[k * B:(k + 1) * B]`` is block ``k``; block ``k``'s parent is ``keys[k - 1]``).
        A CP rank of a helix group matches the blocks it holds: ``first`` its rank, ``stride``
        the group's size."""
        found: list[int] = []
        for k in range(first, len(keys), stride):
            block_id = self._by_key.get(keys[k])
            entry = self._cached.get(block_id) if block_id is not None else None
            parent = keys[k - 1] if k else root_key(cache_salt)
            tokens = tuple(token_ids[k * tokens_per_block:(k + 1) * tokens_per_block])
            if entry is None or entry.parent != parent or entry.token_ids != tokens or entry.cache_salt != cache_salt:
                break
            found.append(block_id)
        return found

    def acquire(self, ids: Sequence[int]) -> None:
        """Hold cached blocks a hit found (each once more; an evictable one leaves the LRU)."""
        missing = [i for i in ids if i not in self._cached]
        if missing:
            raise AllocationError(f"blocks {missing} are not cached")
        for block_id in ids:
            if block_id in self._evictable:
                del self._evictable[block_id]
            self._refs[block_id] = self._refs.get(block_id, 0) + 1

    def num_evictable_of(self, ids: Iterable[int]) -> int:
        return sum(1 for i in ids if i in self._evictable)

    def publish(self, block_id: int, key: BlockKey, parent: BlockKey, token_ids: Sequence[int],
                cache_salt: str | None) -> bool:
        """Name a held, fully written block by its content; False (left unnamed) when another
        block already has that key or this block is already named."""
        if block_id not in self._refs:
            raise AllocationError(f"cannot publish block {block_id}: not held")
        if key in self._by_key or block_id in self._cached:
            return False
        self._by_key[key] = block_id
        self._cached[block_id] = _CachedBlock(key, parent, tuple(token_ids), cache_salt)
        if self.events is not None:
            self.events.stored(key)
        return True

    def unpublish(self, block_id: int) -> None:
        """Forget a held block's name (its contents are about to change)."""
        if block_id in self._evictable:
            raise AllocationError(f"block {block_id} is held by none; it is evicted, not unpublished")
        self._unpublish(block_id)

    def _unpublish(self, block_id: int) -> None:
        entry = self._cached.pop(block_id, None)
        if entry is not None:
            del self._by_key[entry.key]
            if self.events is not None:
                self.events.removed(entry.key)

    def reset(self) -> int:
        """Evict every cached block no request holds (the held ones stay named); how many."""
        num = len(self._evictable)
        for block_id in list(self._evictable):
            self._unpublish(block_id)
            self._free_ids.append(block_id)
        self._evictable.clear()
        return num
