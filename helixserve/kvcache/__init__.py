"""helixserve.kvcache: cache bookkeeping (torch-free) and cache tensor pools (``pools``, torch).

Importing this package does not import torch; import ``helixserve.kvcache.pools`` for tensors.
"""

from helixserve.kvcache.allocator import BlockAllocator, SlotAllocator
from helixserve.kvcache.errors import AllocationError, CacheCapacityError, KVCacheError
from helixserve.kvcache.helix import (
    block_owner,
    local_logical_blocks,
    num_local_blocks,
    num_logical_blocks,
    token_owner,
)
from helixserve.kvcache.manager import CacheHandle, CacheManager, CacheStats

__all__ = [
    "AllocationError",
    "BlockAllocator",
    "CacheCapacityError",
    "CacheHandle",
    "CacheManager",
    "CacheStats",
    "KVCacheError",
    "SlotAllocator",
    "block_owner",
    "local_logical_blocks",
    "num_local_blocks",
    "num_logical_blocks",
    "token_owner",
]
