"""Stages 3 -> 4 of a ctx world (``ctx[].tp > 1``): every rank's KV sender serves its own shard.

Each rank of the world runs a :class:`~helixserve.transceiver.ctx.sender.KVSender` over its own
pools (:class:`RankSender`, built on the rank by :class:`WorldSenderFactory`), listening on
``transceiver_host:transceiver_port + rank`` with the world's layout naming its rank
(``ctx_rank``); a gen rank asks the ranks that hold part of its shard
(:mod:`helixserve.transceiver.fan`). :class:`CtxWorldTransceiver` is the ``context_only`` path's
sender (:class:`~helixserve.ctx_server.context_only.CtxSender`) over them:

- :meth:`~CtxWorldTransceiver.offer`: on the engine thread, a finished, held prefill is held on
  every rank (rank 0's leader channel carries each rank its own handle,
  :class:`~helixserve.engine.kv_holds.HoldRelay`); the answer names every rank's endpoint
  (``ctx_endpoints``, in rank order).
- Each rank's sender frees its hold once the gen ranks it sends to acknowledged, on a cancel, or
  at its hold deadline (``ctx[].pickup_timeout_s``), and only once no send reads its blocks.
- Every ``HOLD_AGREE_S`` while holds are out, the ranks agree (one all-gather) on the holds
  every rank freed; those are released (``SenderFreed``: the leader's scheduler frees every
  rank's blocks). A client's abort and the router's release cancel the hold on every rank.
- A world that failed took its holds with it (its ranks and pools are gone): they are released
  at once, nothing is left in the ctx requests' table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from helixserve.cache_layout import ModelCaches
from helixserve.config import CtxServerConfig
from helixserve.config_transceiver import TransceiverConfig
from helixserve.ctx_server.context_only import DeferredCancels
from helixserve.ctx_server.ctx_requests import CtxRequests, OfferFn
from helixserve.ctx_server.lifecycle import SenderFreed
from helixserve.engine.kv_holds import HoldRelay
from helixserve.engine.llm import resolve_dtype
from helixserve.kvcache.manager import CacheHandle
from helixserve.models.dummy import LoadFormat, model_config_of
from helixserve.parallel import Mapping
from helixserve.protocol import KVLayout, TransceiverEndpoint
from helixserve.protocol.disagg import PullGrant
from helixserve.serving.world_supervisor import ServedWorld
from helixserve.transceiver.ctx.sender import KVSender
from helixserve.transceiver.layout import layout_for
from helixserve.transceiver.polling import TransferMetrics

logger = logging.getLogger(__name__)

# internal: how often the ranks agree on the holds every rank freed while holds are out (a freed
# cache is released at most this much later; one gloo all-gather over the world per agreement)
HOLD_AGREE_S = 0.05


class RankSender:
    """One ctx rank's :class:`KVSender` as the engine's ``ShardSender`` (started here)."""

    def __init__(self, config: TransceiverConfig, layout: KVLayout, caches: ModelCaches, host: str, port: int,
                 hold_timeout_s: float) -> None:
        self._freed: list[str] = []
        self._lock = threading.Lock()
        self.sender = KVSender(config, layout, caches, self._on_free, host=host, port=port,
                               hold_timeout_s=hold_timeout_s)
        self.endpoint = self.sender.start()

    def hold(self, request_id: str, handle: CacheHandle, num_prompt_tokens: int,
             first_gen_tokens: Sequence[int]) -> None:
        self.sender.hold(request_id, handle, num_prompt_tokens, first_gen_tokens)  # (no pull grant: a world rank)

    def cancel(self, request_id: str, reason: str) -> bool:
        return self.sender.cancel(request_id, reason)

    def take_freed(self) -> list[str]:
        with self._lock:
            freed, self._freed = self._freed, []
        return freed

    def metrics(self) -> TransferMetrics:
        return self.sender.stats().metrics

    def close(self) -> None:
        self.sender.stop()

    def _on_free(self, request_id: str) -> None:  # the sender thread
        with self._lock:
            self._freed.append(request_id)


@dataclass(frozen=True, slots=True)
class WorldSenderFactory:
    """Builds each ctx world rank's sender (pickled to the spawned ranks): the world's layout
    (``ctx_tp_size`` tp) naming the rank, on ``port + rank``."""

    config: TransceiverConfig
    model_path: str
    load_format: LoadFormat
    served_model: str
    dtype: str | None  # the model's (None: the device's default, as every rank resolves it)
    tp: int
    host: str
    port: int
    hold_timeout_s: float

    def layout(self, caches: ModelCaches, ctx_rank: int = 0) -> KVLayout:
        device = caches.tensors()[0].device
        layout = layout_for(model_config_of(self.model_path, self.load_format), resolve_dtype(self.dtype, device),
                            caches.tokens_per_block, self.served_model)
        return layout.model_copy(update={"ctx_tp_size": self.tp, "ctx_rank": ctx_rank})

    def __call__(self, mapping: Mapping, caches: ModelCaches) -> RankSender:
        return RankSender(self.config, self.layout(caches, mapping.cp_rank), caches, self.host,
                          self.port + mapping.rank, self.hold_timeout_s)


class CtxWorldTransceiver(DeferredCancels):
    """The ctx world's KV senders over its ctx requests (see the module docstring)."""

    def __init__(self, requests: CtxRequests, world: ServedWorld, server: CtxServerConfig) -> None:
        super().__init__(server.release_grace_s)
        self.requests = requests
        self.world = world
        self._out: dict[str, HoldRelay] = {}  # held on the ranks, not yet freed on every rank
        self.num_released = 0
        self.num_lost = 0  # holds of a world that failed
        self._relay: HoldRelay | None = None  # whose counters metrics() read last
        self._restarted = TransferMetrics()  # the counters of the worlds before a restart

    @property
    def endpoints(self) -> list[TransceiverEndpoint]:
        relay = self.world.driver.core.kv_holds
        if relay is None:
            raise RuntimeError("the ctx world runs no KV senders")
        return list(relay.endpoints)

    @property
    def endpoint(self) -> TransceiverEndpoint:
        return self.endpoints[0]

    def offer(self, request_id: str, num_prompt_tokens: int, first_gen_tokens: list[int]) -> OfferFn:
        """``offer(core)`` on the engine thread holds the finished prefill on every rank."""

        def hold(core: Any) -> None:  # (the worker's WorldCore)
            relay = core.driver.core.kv_holds
            if relay is None:
                raise RuntimeError("the ctx world runs no KV senders")
            relay.hold(request_id, num_prompt_tokens, first_gen_tokens)
            self._out[request_id] = relay

        return hold

    def take_grant(self, request_id: str) -> PullGrant | None:
        return None  # a world rank's pools hold part of the shard: nothing to copy in one pull

    async def cancel(self, request_id: str, reason: str) -> bool:
        """Stop serving a hold on every rank; it is released once every rank freed it."""

        def cancel(core: Any) -> bool:
            relay = self._out.get(request_id)
            if relay is None or relay is not core.driver.core.kv_holds or self.world.failure() is not None:
                return False
            relay.cancel(request_id, reason)
            return True

        return await self.requests.engine.call(cancel)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[CtxWorldTransceiver]:
        """Agree on freed holds every ``HOLD_AGREE_S`` while holds are out."""
        task = asyncio.create_task(self._agree_forever())
        try:
            yield self
        finally:
            task.cancel()
            self._cancel_tasks()

    def metrics(self) -> TransferMetrics:
        """Every rank's transfer counters, a hold counted once (``engine.kv_holds.group_metrics``),
        as of the ranks' last agreement; a restarted world's counters add to its predecessors'."""
        relay = self.world.driver.core.kv_holds
        if relay is not self._relay:
            if self._relay is not None:
                self._restarted = _added(self._restarted, self._relay.metrics)
            self._relay = relay
        return _added(self._restarted, relay.metrics if relay is not None else TransferMetrics())

    def stats(self) -> dict[str, float]:
        m = self.metrics()
        return {"kv_transfer_bytes": m.bytes_transferred, "kv_transfer_seconds": m.seconds_transferred,
                "kv_transfers_completed": m.completed, "kv_transfer_failures": m.failures,
                "kv_transfer_timeouts": m.timeouts, "kv_transfers_cancelled": m.cancellations,
                "kv_transfers_in_flight": len(self._out), "kv_holds_released": self.num_released,
                "kv_holds_lost": self.num_lost}

    def gauges(self) -> list[tuple[str, str, float]]:
        m = self.metrics()
        return [("kv_transfers_in_flight", "holds not freed on every ctx rank yet", len(self._out)),
                ("kv_holds_released_total", "holds freed on every ctx rank and released", self.num_released),
                ("kv_holds_lost_total", "holds of a ctx world that failed", self.num_lost),
                ("kv_transfer_bytes_total", "KV bytes sent to gen ranks by every ctx rank", m.bytes_transferred),
                ("kv_transfer_seconds_total", "hold to last acknowledgement, summed over ctx ranks",
                 m.seconds_transferred),
                ("kv_transfers_completed_total", "holds acknowledged on every ctx rank", m.completed),
                ("kv_transfer_failures_total", "holds failed or expired on some ctx rank", m.failures),
                ("kv_transfer_timeouts_total", "holds that hit their deadline on some ctx rank", m.timeouts),
                ("kv_transfers_cancelled_total", "holds cancelled on some ctx rank", m.cancellations)]

    # -- internals ----------------------------------------------------------------------------

    def _agree(self, core: Any) -> list[str]:
        """Engine thread: the holds freed on every rank, and those of a world that failed."""
        relay = core.driver.core.kv_holds
        lost = [rid for rid, r in self._out.items() if r is not relay or self.world.failure() is not None]
        if lost:
            logger.warning("ctx world failed holding %d prefills: released (%s)", len(lost), ", ".join(lost[:8]))
            self.num_lost += len(lost)
        freed: list[str] = []
        if relay is not None and self.world.failure() is None and len(lost) < len(self._out):
            try:
                freed = relay.agree()
            except Exception as exc:  # noqa: BLE001 - the world's collectives broke: it failed
                core.driver.failure = core.driver.failure or f"the hold agreement failed: {exc}"
                logger.error("ctx world hold agreement failed: %s", exc)
        for rid in [*lost, *freed]:
            self._out.pop(rid, None)
        self.num_released += len(freed)
        return [*lost, *freed]

    async def _agree_forever(self) -> None:
        while True:
            await asyncio.sleep(HOLD_AGREE_S)
            if not self._out:
                continue
            try:
                released = await self.requests.engine.call(self._agree)
            except Exception as exc:  # noqa: BLE001 - the engine stopped: running()'s exit frees all
                logger.debug("ctx world hold agreement not run: %s", exc)
                continue
            for rid in released:
                self.requests.post(SenderFreed(rid))


def _added(a: TransferMetrics, b: TransferMetrics) -> TransferMetrics:
    """Counters ``a`` + ``b`` (``in_flight`` is ``b``'s: a gauge, not a counter)."""
    return TransferMetrics(
        bytes_transferred=a.bytes_transferred + b.bytes_transferred,
        seconds_transferred=a.seconds_transferred + b.seconds_transferred, in_flight=b.in_flight,
        completed=a.completed + b.completed, failures=a.failures + b.failures, timeouts=a.timeouts + b.timeouts,
        cancellations=a.cancellations + b.cancellations, expired_holds=a.expired_holds + b.expired_holds)
