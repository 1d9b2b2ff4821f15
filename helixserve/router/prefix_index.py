"""The router's index of the blocks each ctx worker caches, for ``router.policy: cache_aware``
(torch-free).

Per ctx worker a set of block keys, at most ``router.prefix_index_max_blocks`` (least recently
used out first), kept up to date by polling the worker's ``GET /v1/prefix_events``
(:mod:`helixserve.protocol.prefix_events`) after each health check, each poll bounded by the
health check's timeout. A ``stored`` event adds a key, ``removed`` drops it, a resync answer
replaces the set. A worker that fails its health check or a poll, answers with another epoch
(it restarted: its cache is empty), does not publish events (404: caching off) or blocks of
another ``tokens_per_block`` has its set dropped; it is re-learnt from a resync. A ctx world
publishes its CP group's blocks from its leader, a world restarted in place under a new epoch.

A request routed to a worker adds its keys at once (the worker is about to store them), so
requests sharing a prefix that arrive before the worker's events follow the first one.

:meth:`PrefixIndex.choose` scores each worker with room: the blocks of the request's chain the
worker holds, counted from the first, minus ``router.cache_aware_load_weight`` x its requests in
flight. A match shorter than ``router.cache_threshold`` of the request's blocks counts as none
(SGLang's name: a chat template's opening, which every prompt shares, is not a reason to send
everything to one worker). The best score wins; equal scores go to the least loaded; no match
anywhere: None (the pool then picks the least loaded).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from pydantic import ValidationError

from helixserve.kvcache.prefix_index import BlockKey
from helixserve.protocol.prefix_events import PREFIX_EVENTS_PATH, PrefixEventsAnswer
from helixserve.router.upstream import Upstream, UpstreamError

logger = logging.getLogger(__name__)


class Worker(Protocol):
    """What the index reads of a pool's worker (``router.pool.WorkerState``)."""

    url: str
    num_inflight: int
    is_healthy: bool


W = TypeVar("W", bound=Worker)


class WorkerBlocks:
    """One ctx worker's cached block keys, as far as this router knows them (LRU, bounded)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.keys: OrderedDict[BlockKey, None] = OrderedDict()
        self.epoch: str | None = None
        self.seq: int | None = None  # ask for the events after this one (None: resync)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: BlockKey) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.max_blocks:
            self.keys.popitem(last=False)

    def clear(self) -> None:
        self.keys.clear()
        self.epoch = self.seq = None

    def num_matched(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, this worker holds (those count as used now)."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            self.keys.move_to_end(key)
            n += 1
        return n

    def apply(self, answer: PrefixEventsAnswer) -> bool:
        """Take in one answer; False (nothing taken, set dropped) when events came from another
        epoch than the one this set was learnt from: ask again for a resync."""
        if answer.epoch != self.epoch and not answer.resync:
            self.clear()
            return False
        if answer.resync:
            self.keys.clear()
            for key in answer.blocks:
                self.add(bytes.fromhex(key))
        for _, kind, key in answer.events:
            if kind == "stored":
                self.add(bytes.fromhex(key))
            else:
                self.keys.pop(bytes.fromhex(key), None)
        self.epoch, self.seq = answer.epoch, answer.seq
        return True


class PrefixIndex:
    """Every ctx worker's :class:`WorkerBlocks`, their polling and the choice (module docstring)."""

    def __init__(self, urls: Sequence[str], max_blocks: int, tokens_per_block: int, load_weight: float,
                 cache_threshold: float = 0.0) -> None:
        self.max_blocks = max_blocks
        self.tokens_per_block = tokens_per_block
        self.load_weight = load_weight
        self.cache_threshold = cache_threshold
        self.workers = {url.rstrip("/"): WorkerBlocks(max_blocks) for url in urls}
        self._why_dropped: dict[str, str] = {}  # the last cause logged per worker

    def num_blocks(self, url: str) -> int:
        return len(self.workers[url])

    def routed(self, url: str, keys: Sequence[BlockKey]) -> None:
        blocks = self.workers[url]
        for key in keys:
            blocks.add(key)

    def choose(self, workers: Sequence[W], keys: Sequence[BlockKey]) -> W | None:
        """The worker of ``workers`` (in tie-break order) with the best score; None when none
        holds ``cache_threshold`` of the chain (and at least its first block)."""
        least = max(1.0, self.cache_threshold * len(keys))
        matched = [self.workers[w.url].num_matched(keys) for w in workers]
        matched = [m if m >= least else 0 for m in matched]
        if not any(matched):
            return None
        scores = [m - self.load_weight * w.num_inflight for m, w in zip(matched, workers, strict=True)]
        best = max(scores)
        return min((w for w, s in zip(workers, scores, strict=True) if s == best), key=lambda w: w.num_inflight)

    async def poll(self, client: Upstream, workers: Sequence[Worker], timeout_s: float) -> None:
        """One poll of every healthy worker's events, concurrently; an unhealthy one's set dropped."""
        for w in workers:
            if not w.is_healthy:
                self._drop(w.url, "it is not healthy")
        await asyncio.gather(*(self._poll_one(client, w.url, timeout_s) for w in workers if w.is_healthy))

    async def _poll_one(self, client: Upstream, url: str, timeout_s: float) -> None:
        blocks = self.workers[url]
        for _ in range(2):  # a second time only to resync after an epoch change
            query = f"max_blocks={self.max_blocks}" + ("" if blocks.seq is None else f"&since={blocks.seq}")
            try:
                answer = await client.get(f"{url}{PREFIX_EVENTS_PATH}?{query}", timeout_s=timeout_s)
            except UpstreamError as exc:
                return self._drop(url, f"polling its prefix events failed: {exc}")
            if answer.status != 200:
                return self._drop(url, f"its prefix events answered {answer.status} (prefix caching off?)")
            try:
                got = PrefixEventsAnswer.model_validate_json(answer.body)
            except ValidationError as exc:
                return self._drop(url, f"its prefix events are malformed: {exc.errors(include_url=False)[0]['msg']}")
            if got.tokens_per_block != self.tokens_per_block:
                return self._drop(url, f"it caches blocks of {got.tokens_per_block} tokens, this router "
                                       f"hashes {self.tokens_per_block}")
            if blocks.epoch is not None and got.epoch != blocks.epoch:
                logger.info("ctx worker %s restarted (epoch %s): its %d blocks dropped", url, got.epoch, len(blocks))
            if blocks.apply(got):
                self._why_dropped.pop(url, None)
                return None
        return None

    def _drop(self, url: str, why: str) -> None:
        self.workers[url].clear()
        if self._why_dropped.get(url) != why:
            logger.info("cache-aware routing: blocks of ctx worker %s dropped: %s", url, why)
            self._why_dropped[url] = why
