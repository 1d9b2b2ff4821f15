"""Requests whose prompt cache arrives from a ctx worker (disaggregated decode).

Two owners, one per concern:

- :class:`RankTransfers` (every rank of a CP group): this rank's receiver, the outcomes it
  polled, and its end of the group's agreement on them,
  :class:`~helixserve.transceiver.consensus.TransferConsensus` (one all-gather of every rank's
  ``LocalStatus`` per check over the CP group: the code ``pytest -k bounded_polling`` exercises).
- :class:`KVIntake` (the group's leader, inside its :class:`~helixserve.engine.core.EngineCore`):
  each received request's record from admission to its start. A request waits (FIFO) until its
  prompt's cache fits, then the leader allocates it on every rank of the group (the group's
  cache manager holds every rank's allocator), starts its own reception and sends the other
  ranks theirs (:class:`~helixserve.engine.spmd.channel.Transfers`); every step with a reception
  in flight the group agrees on the outcomes. A request whose shard arrived on every rank is
  ready and starts decoding (``Scheduler.add_prefilled``) as soon as a running slot is free; one
  whose transfer failed or timed out on any rank fails on the leader with the first rank's cause
  (its cache freed on every rank once every rank has stopped its reception).

At ``cp == 1`` the consensus is local (no collective) and nothing is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from helixserve.cache_layout import ModelCaches
from helixserve.engine.request import Request, RequestStatus
from helixserve.engine.scheduler_output import RequestUpdate
from helixserve.kvcache.manager import CacheHandle
from helixserve.transceiver.consensus import ConsensusResult, LocalStatus, TransferConsensus
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


class ShardReceiver(Protocol):
    """One rank's receiver of ctx-prefilled shards (the transceiver plugs in here).

    ``start`` must fill exactly this rank's shard: the blocks of ``handle.block_ids`` (global
    logical blocks ``cp_rank + k * cp``) in every MLA pool of ``caches``, and slot ``handle.slot``
    of every KDA state / conv pool (this rank's heads, ``[q | k | v]`` conv sections).
    """

    def start(self, request_id: str, handle: CacheHandle, caches: ModelCaches, ticket: KVTicket) -> None: ...
    def poll(self, wait: bool = False) -> dict[str, str | None]:
        """Transfers finished since the last poll: ``request_id -> None`` (ok) or an error message.
        Local and bounded (no collective). ``wait``: nothing else would run this step, so the
        poll may wait a bounded while for a transfer to end; else one non-blocking pass."""
    def cancel(self, request_id: str) -> None: ...


class RankTransfers:
    """One rank's receptions and its end of the CP group's consensus (see the module docstring)."""

    def __init__(self, receiver: ShardReceiver | None, caches: ModelCaches, consensus: TransferConsensus) -> None:
        self.receiver, self.caches, self.consensus = receiver, caches, consensus
        self._active: set[str] = set()  # started here, not yet agreed
        self._outcomes: dict[str, str | None] = {}  # polled: None ok, else the error

    def start(self, request_id: str, handle: CacheHandle, ticket: KVTicket) -> None:
        """Start receiving into ``handle``; a reception that cannot start is this rank's failed
        outcome (the group agrees on it like on any other failure)."""
        self.consensus.mark_active()  # every rank of the group starts it in the same message
        self._active.add(request_id)
        try:
            if self.receiver is None:
                raise ValueError("this rank has no KV receiver")
            self.receiver.start(request_id, handle, self.caches, ticket)
        except Exception as exc:  # noqa: BLE001 - reported through the consensus
            logger.error("KV reception of %s could not start: %s", request_id, exc)
            self._outcomes[request_id] = f"KV reception could not start: {type(exc).__name__}: {exc}"

    def cancel(self, request_id: str) -> None:
        """Stop a reception; nothing writes into its handle after this."""
        if request_id in self._active:
            self._active.discard(request_id)
            self._outcomes.pop(request_id, None)
            if self.receiver is not None:
                self.receiver.cancel(request_id)

    def agree(self, wait: bool = False) -> ConsensusResult:
        """Poll (waiting a bounded while when ``wait``: the group has nothing else to run), then
        agree with the group (every rank of the group calls this in the same message); agreed
        failures are cancelled here, agreed arrivals forgotten."""
        if self.receiver is not None:
            for request_id, error in self.receiver.poll(wait).items():
                if request_id in self._active:
                    self._outcomes[request_id] = error
        failed = {rid: error for rid, error in self._outcomes.items() if error is not None}
        status = LocalStatus.of(failed=failed, completed=[r for r, e in self._outcomes.items() if e is None])
        agreed = self.consensus.check(status, failed)
        for request_id in agreed.failed | agreed.cancelled:
            self.cancel(request_id)
        for request_id in agreed.ready:
            self._active.discard(request_id)
            self._outcomes.pop(request_id, None)
        return agreed


@dataclass(slots=True)
class _Received:
    request: Request
    ticket: KVTicket


class TransferSender(Protocol):
    """How the leader tells the other ranks of its group (``GroupExecutor.transfers``)."""

    def transfers(self, starts: list[tuple[str, KVTicket]], cancels: list[str], agree: bool, wait: bool) -> None: ...


class KVIntake:
    """The leader's received requests, admission to start (see the module docstring).

    Args:
        cache: the group's cache manager (``allocate`` / ``free`` on every rank of the group).
        transfers: the leader's own :class:`RankTransfers`.
        group: sends the other ranks their starts, cancels and the agreement (None: cp == 1).
    """

    def __init__(self, cache: Any, transfers: RankTransfers, group: TransferSender | None) -> None:
        self.cache, self.transfers, self.group = cache, transfers, group
        self._waiting: dict[str, _Received] = {}  # no cache yet (FIFO)
        self._receiving: dict[str, Request] = {}  # cache allocated, reception started
        self._ready: dict[str, Request] = {}  # arrived on every rank, no running slot yet (FIFO)
        self._starts: list[tuple[str, KVTicket]] = []  # (request id, ticket) for the other ranks
        self._cancels: list[str] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting or request_id in self._receiving or request_id in self._ready

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._receiving) + len(self._ready)

    def add(self, request: Request, ticket: KVTicket) -> None:
        self._waiting[request.request_id] = _Received(request, ticket)

    def abort(self, request_id: str) -> bool:
        """Drop a received request before it decodes (its reception stopped, its cache freed)."""
        if self._waiting.pop(request_id, None) is not None:
            return True
        if self._receiving.pop(request_id, None) is not None:
            self.transfers.cancel(request_id)
            self._cancels.append(request_id)  # sent before anything can reuse its blocks
            self.cache.free(request_id)
            return True
        if self._ready.pop(request_id, None) is not None:
            self.cache.free(request_id)
            return True
        return False

    def abort_all(self) -> list[str]:
        request_ids = [*self._waiting, *self._receiving, *self._ready]
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def step(self, can_start: Callable[[], bool], start: Callable[[Request], list[RequestUpdate]],
             idle: bool = False) -> list[RequestUpdate]:
        """Admit, agree, start: the updates of requests that failed (``FINISHED_ERROR`` with the
        cause) or started decoding (their first tokens). ``idle``: the engine has nothing else
        to run (no request decoding or waiting, no step in flight), so the transfers' poll may
        wait a bounded while for one to end; otherwise it does not wait, and decode steps never
        stall on a transfer still in flight."""
        self._admit()
        updates: list[RequestUpdate] = []
        agree = bool(self._receiving)
        if self.group is not None and (agree or self._starts or self._cancels):
            self.group.transfers(self._starts, self._cancels, agree, idle)
        self._starts, self._cancels = [], []
        if agree:
            agreed = self.transfers.agree(wait=idle)
            for request_id in [r for r in self._receiving if r in agreed.failed | agreed.cancelled]:
                self._receiving.pop(request_id)
                self.cache.free(request_id)
                error = agreed.errors.get(request_id) or f"request {request_id}: KV transfer failed on its CP group"
                updates.append(RequestUpdate(request_id, -1, RequestStatus.FINISHED_ERROR, error=error))
            for request_id in [r for r in self._receiving if r in agreed.ready]:
                self._ready[request_id] = self._receiving.pop(request_id)
        while self._ready and can_start():
            request = self._ready.pop(next(iter(self._ready)))
            try:
                updates += start(request)
            except ValueError as exc:  # checked at admission: should not happen
                logger.error("received request %s could not start: %s", request.request_id, exc)
                self.cache.free(request.request_id)
                updates.append(RequestUpdate(request.request_id, -1, RequestStatus.FINISHED_ERROR, error=str(exc)))
        return updates

    def _admit(self) -> None:
        while self._waiting:
            received = next(iter(self._waiting.values()))
            request = received.request
            rid = request.request_id
            if not self.cache.can_allocate(request.num_prompt_tokens):
                break  # FIFO: later ones wait behind it
            del self._waiting[rid]
            handle = self.cache.allocate(rid, request.num_prompt_tokens)
            self.cache.arrange_for_sources(rid, received.ticket.layout.ctx_tp_size)  # each ctx rank's part one run
            self.transfers.start(rid, handle, received.ticket)
            self._receiving[rid] = request
            self._starts.append((rid, received.ticket))
