"""Errors raised by the cache bookkeeping (torch-free)."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error raised by ``helixserve.kvcache``."""


class CacheCapacityError(KVCacheError):
    """Not enough free blocks or state slots; the message carries the numbers.

    The cache never evicts silently: the caller (the scheduler) checks with ``can_*`` first and
    decides what to preempt.
    """


class AllocationError(KVCacheError, ValueError):
    """A caller error: double free, foreign id, unknown or duplicate request id."""
