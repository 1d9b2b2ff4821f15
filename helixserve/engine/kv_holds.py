"""Held prefills of a ctx world (``ctx[].tp > 1``): every rank's KV sender serves its own shard.

A ctx world holds a request's cache the helix way (dp 1 x cp tp): rank ``r`` has the MLA blocks
``b % tp == r`` and its own KDA head slice. Each rank runs a KV sender over its own pools (a
:class:`ShardSender`, built by the world's :data:`ShardSenderFactory`); a gen rank asks the ranks
that hold part of its shard (:mod:`helixserve.transceiver.fan`).

Two owners, one per concern:

- :class:`RankHolds` (every rank): this rank's sender, the holds it serves, and its end of the
  group's agreement on which holds every rank has freed (one all-gather over the group's gloo
  group per agreement: each rank's freed ids; the intersection is freed everywhere).
- :class:`HoldRelay` (the group's leader, rank 0): holds a finished prefill on every rank (its
  own, and the other ranks' through a :class:`~.spmd.channel.Holds` message carrying each
  rank's own handle), cancels, and asks for the agreement. The leader's scheduler keeps the
  request's cache (every rank's blocks: the group's cache manager) until the agreement says
  every rank's sender freed it; only then does the ctx worker release it.

Each agreement also carries every rank's transfer counters; :attr:`RankHolds.world_metrics` counts a
hold once for the group: bytes and seconds are every rank's summed; a hold is counted completed
once every rank counted it (the ranks' least count), failed, timed out or cancelled once some rank
did (the ranks' most). Counters move at agreements, which run while holds are out.

A hold that cannot start on a rank counts as freed there (nothing of it is served) and is
cancelled on every rank at the next agreement. Every sender frees a hold at its deadline at the
latest, so every hold ends; a world that fails takes its holds with it (its ranks' pools are gone).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from helixserve.cache_layout import ModelCaches
from helixserve.kvcache.manager import CacheHandle
from helixserve.parallel import CollectiveError, Mapping
from helixserve.transceiver.polling import TransferMetrics

logger = logging.getLogger(__name__)


class ShardSender(Protocol):
    """One ctx rank's KV sender (the transceiver plugs in here)."""

    @property
    def endpoint(self) -> Any:
        """Where gen ranks reach it (opaque to the engine: the ctx answer carries it)."""
    def hold(self, request_id: str, handle: CacheHandle, num_prompt_tokens: int,
             first_gen_tokens: Sequence[int]) -> None: ...
    def cancel(self, request_id: str, reason: str) -> bool: ...
    def take_freed(self) -> list[str]:
        """Holds freed since the last call (quiesced: no send reads their blocks any more)."""
    def metrics(self) -> TransferMetrics:
        """This rank's transfer counters so far (a snapshot)."""
    def close(self) -> None: ...


# ``factory(mapping, caches) -> ShardSender`` for a rank (picklable: it crosses to spawned ranks)
ShardSenderFactory = Callable[[Mapping, ModelCaches], ShardSender]


@dataclass(frozen=True, slots=True)
class HoldStart:
    """Hold ``request_id`` (this rank's ``handle``) for its gen worker."""

    request_id: str
    handle: CacheHandle
    num_prompt_tokens: int
    first_gen_tokens: tuple[int, ...]


class RankHolds:
    """One rank's holds and its end of the group's agreement (see the module docstring)."""

    def __init__(self, sender: ShardSender, group: Any, group_size: int) -> None:
        self.sender = sender
        self.group, self.group_size = group, group_size
        self._held: set[str] = set()  # held here, not yet agreed freed
        self._freed: set[str] = set()  # freed here (or never held: failed), not yet agreed
        self._failed: set[str] = set()  # could not start here: cancelled on every rank
        self._lock = threading.Lock()
        self.world_metrics = TransferMetrics()  # the group's counters as of the last agreement

    @property
    def num_held(self) -> int:
        return len(self._held)

    def hold(self, start: HoldStart) -> None:
        self._held.add(start.request_id)
        try:
            self.sender.hold(start.request_id, start.handle, start.num_prompt_tokens, start.first_gen_tokens)
        except Exception as exc:  # noqa: BLE001 - nothing of it is served here; cancelled everywhere
            logger.error("ctx rank could not hold %s: %s: %s", start.request_id, type(exc).__name__, exc)
            self._freed.add(start.request_id)
            self._failed.add(start.request_id)

    def cancel(self, request_id: str, reason: str) -> None:
        if request_id in self._held and request_id not in self._freed:
            self.sender.cancel(request_id, reason)

    def agree(self) -> list[str]:
        """Every rank of the group calls this in the same message: the holds freed on every rank
        (forgotten here); holds that failed on some rank are cancelled here."""
        self._freed.update(rid for rid in self.sender.take_freed() if rid in self._held)
        report = (sorted(self._freed), sorted(self._failed), self.sender.metrics())
        reports = [report]
        if self.group_size > 1:
            reports = [None] * self.group_size
            try:
                dist.all_gather_object(reports, report, group=self.group)
            except RuntimeError as exc:
                raise CollectiveError(f"ctx hold agreement failed: {exc}") from exc
        freed = set.intersection(*(set(r[0]) for r in reports))
        failed = set().union(*(set(r[1]) for r in reports))
        self.world_metrics = group_metrics([r[2] for r in reports])
        for request_id in failed - freed:
            self.cancel(request_id, "a ctx rank could not hold it")
        self._held -= freed
        self._freed -= freed
        self._failed -= freed
        return sorted(freed)

    def close(self) -> None:
        self.sender.close()


def group_metrics(ranks: Sequence[TransferMetrics]) -> TransferMetrics:
    """One group's counters from its ranks' (a hold counted once: see the module docstring)."""
    return TransferMetrics(
        bytes_transferred=sum(m.bytes_transferred for m in ranks),
        seconds_transferred=sum(m.seconds_transferred for m in ranks),
        in_flight=max(m.in_flight for m in ranks), completed=min(m.completed for m in ranks),
        failures=max(m.failures for m in ranks), timeouts=max(m.timeouts for m in ranks),
        cancellations=max(m.cancellations for m in ranks), expired_holds=max(m.expired_holds for m in ranks))


class HoldSender(Protocol):
    """How the leader tells the other ranks (``GroupLeader.holds``)."""

    def holds(self, starts: list[list[HoldStart]], cancels: list[tuple[str, str]], agree: bool) -> None: ...


class HoldRelay:
    """The leader's side: holds on every rank of its group, the agreement (module docstring).

    Args:
        cache: the group's cache manager (``handle_on(rank, request_id)`` for every rank).
        holds: the leader's own :class:`RankHolds`.
        group: sends the other ranks their holds, cancels and the agreement.
        endpoints: every rank's sender, in rank order (the ctx answer's ``ctx_endpoints``).
    """

    def __init__(self, cache: Any, holds: RankHolds, group: HoldSender,
                 endpoints: Sequence[Any]) -> None:
        self.cache, self.holds, self.group = cache, holds, group
        self.endpoints = tuple(endpoints)

    @property
    def num_held(self) -> int:
        return self.holds.num_held

    def hold(self, request_id: str, num_prompt_tokens: int, first_gen_tokens: Sequence[int]) -> None:
        """Hold a finished prefill (its cache held by the scheduler) on every rank."""
        starts = [HoldStart(request_id, self.cache.handle_on(r, request_id), num_prompt_tokens,
                            tuple(first_gen_tokens)) for r in range(len(self.endpoints))]
        self.group.holds([[s] for s in starts], [], False)
        self.holds.hold(starts[0])

    def cancel(self, request_id: str, reason: str) -> None:
        self.group.holds([[] for _ in self.endpoints], [(request_id, reason)], False)
        self.holds.cancel(request_id, reason)

    @property
    def metrics(self) -> TransferMetrics:
        """The group's transfer counters as of the last agreement (:func:`group_metrics`)."""
        return self.holds.world_metrics

    def agree(self) -> list[str]:
        """The holds every rank's sender freed: their cache may be released now."""
        self.group.holds([[] for _ in self.endpoints], [], True)
        return self.holds.agree()

    def close(self) -> None:
        self.holds.close()
