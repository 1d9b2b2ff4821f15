"""The scheduler's side of prefix caching (torch-free): a waiting request's cached prefix, where
its prefill chunks stop, and what a step it ran leaves cached
(:class:`~helixserve.kvcache.prefix_manager.PrefixCachingCacheManager`). With a cache manager
that caches nothing (``prefix_caching`` false) every hit is empty and chunks stop where the
budget says."""

from __future__ import annotations

from helixserve.engine.request import Request
from helixserve.kvcache.manager import NO_HIT, CacheManager, PrefixHit
from helixserve.kvcache.prefix_index import BlockKey, append_block_keys
from helixserve.kvcache.prefix_manager import ChunkPlan


def block_keys(cache: CacheManager, request: Request, num_tokens: int) -> list[BlockKey]:
    """The request's block keys through its first ``num_tokens`` tokens (computed once each)."""
    keys, size = request.block_keys, cache.tokens_per_block
    num_full = num_tokens // size
    if len(keys) < num_full:
        append_block_keys(keys, request.token_ids_between(len(keys) * size, num_full * size), size,
                          request.cache_salt)
    return keys


def prefix_hit(cache: CacheManager, request: Request) -> PrefixHit:
    """The cached prefix the waiting ``request`` can start from."""
    if not cache.prefix_caching:
        return NO_HIT
    keys = block_keys(cache, request, request.num_tokens)
    return cache.find_prefix(keys, request.token_ids_between(0, request.num_tokens),  # type: ignore[attr-defined]
                             request.cache_salt)


def admit(cache: CacheManager, request: Request, hit: PrefixHit) -> None:
    """Allocate the request's cache from ``hit``; its computed count starts after the hit."""
    cache.allocate(request.request_id, request.num_tokens, hit)
    request.num_computed_tokens = hit.num_tokens
    if cache.prefix_caching:
        request.num_cached_tokens = hit.num_tokens


def plan_chunk(cache: CacheManager, request: Request, start: int, stop: int) -> ChunkPlan:
    """Where the prefill chunk ``[start, stop)`` stops and its checkpoint copies."""
    if not cache.prefix_caching:
        return ChunkPlan(stop)
    keys = block_keys(cache, request, stop)
    return cache.plan_chunk(request.request_id, keys, request.num_prompt_tokens, start, stop)  # type: ignore[attr-defined]


def commit_computed(cache: CacheManager, request: Request) -> None:
    """After a step of ``request`` was applied: publish what it computed."""
    if not cache.prefix_caching:
        return
    num_computed = request.num_computed_tokens
    keys = block_keys(cache, request, num_computed)
    cache.commit_computed(request.request_id, keys, request.token_ids_between,  # type: ignore[attr-defined]
                          request.cache_salt, num_computed)


def exclude_received(cache: CacheManager, request: Request) -> None:
    """A request whose prompt cache a KV transfer filled: nothing of it is published (its blocks
    were not computed by this engine's prefill, and a hit must equal a fresh prefill)."""
    if cache.prefix_caching:
        cache.exclude(request.request_id)  # type: ignore[attr-defined]
