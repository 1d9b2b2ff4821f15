"""Stages 3 -> 4 of the ctx worker over the transceiver: a KV sender serves the held prefills.

:class:`CtxTransceiver` runs a :class:`~helixserve.transceiver.ctx.sender.KVSender` (gRPC control plane
on ``transceiver_host:transceiver_port``, UCX data plane) over the engine's cache for the app's
lifetime:

- :meth:`CtxTransceiver.offer`: a finished prefill (HELD in the ctx requests' life,
  :mod:`~helixserve.ctx_server.lifecycle`) goes to the sender on the engine thread, where its
  block ids and state slot are read; its hold deadline starts there (HELD -> SENDING).
- The sender frees it once every expected gen rank acknowledged its shard, on cancel, or when the
  hold deadline passed (counted as expired), and only once no send can still read its blocks (a
  hold whose send may still be in flight is quarantined, never freed under it). Its ``on_free``
  posts ``SenderFreed``: on the engine thread the request becomes RELEASED and the engine's hold
  is released (:class:`~helixserve.ctx_server.ctx_requests.CtxRequests`).
- :meth:`CtxTransceiver.cancel`: the client left (``POST /v1/abort``); :meth:`cancel_later`: the
  router released the hold (``POST /v1/release``, sent once a gen worker answered; a gen worker
  that received the shards has acknowledged by then, one that recomputes never asks for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from helixserve.config import CtxServerConfig
from helixserve.config_transceiver import TransceiverConfig
from helixserve.ctx_server.context_only import DeferredCancels
from helixserve.ctx_server.lifecycle import SenderFreed
from helixserve.ctx_server.ctx_requests import CtxRequests, OfferFn
from helixserve.engine.core import EngineCore
from helixserve.protocol import KVLayout, TransceiverEndpoint
from helixserve.protocol.disagg import PullGrant
from helixserve.transceiver.polling import TransferMetrics
from helixserve.transceiver.ctx.sender import KVSender

logger = logging.getLogger(__name__)

# internal: how often the /metrics snapshot of the sender is refreshed (a gauge's staleness, no wait)
STATS_INTERVAL_S = 0.5


@dataclass(slots=True)
class SenderSnapshot:
    """The sender's counters as last read (the sender thread owns the live ones)."""

    num_held: int = 0
    num_quarantined: int = 0
    metrics: TransferMetrics | None = None
    num_granted: int = 0

    def stats(self) -> dict[str, float]:
        m = self.metrics or TransferMetrics()
        return {"kv_transfer_bytes": m.bytes_transferred, "kv_transfer_seconds": m.seconds_transferred,
                "kv_transfers_completed": m.completed, "kv_transfer_failures": m.failures,
                "kv_transfer_timeouts": m.timeouts, "kv_transfers_cancelled": m.cancellations,
                "kv_transfers_in_flight": m.in_flight, "kv_pickups_expired": m.expired_holds,
                "kv_pickups_quarantined": self.num_quarantined, "kv_pickups_granted": self.num_granted}


# (stats key, metric name under helixserve_worker_, help); the counters never decrease
_GAUGES = [
    ("kv_transfer_bytes", "kv_transfer_bytes_total", "KV bytes sent to gen ranks (acknowledged holds)"),
    ("kv_transfer_seconds", "kv_transfer_seconds_total", "hold to last acknowledgement, summed"),
    ("kv_transfers_completed", "kv_transfers_completed_total", "holds acknowledged by every gen rank"),
    ("kv_transfer_failures", "kv_transfer_failures_total", "holds failed or expired"),
    ("kv_transfer_timeouts", "kv_transfer_timeouts_total", "holds that hit their deadline"),
    ("kv_transfers_cancelled", "kv_transfers_cancelled_total", "holds cancelled (client gone, released)"),
    ("kv_transfers_in_flight", "kv_transfers_in_flight", "holds not settled yet"),
    ("kv_pickups_quarantined", "kv_pickups_quarantined", "settled pickups a send may still read"),
    ("kv_pickups_granted", "kv_pickups_granted_total", "pickups every gen rank copied on the ctx's grant, "
                                                        "without RequestShard (same host, CUDA IPC)"),
]


class CtxTransceiver(DeferredCancels):
    """The ctx worker's KV sender over its ctx requests (see the module docstring)."""

    def __init__(self, requests: CtxRequests, core: EngineCore, layout: KVLayout,
                 config: TransceiverConfig, server: CtxServerConfig) -> None:
        super().__init__(server.release_grace_s)
        self.requests = requests
        self.core = core
        self.layout = layout
        self.config = config
        self.server = server
        self.sender = None  # a KVSender while running
        self.snapshot = SenderSnapshot()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grants: dict[str, PullGrant] = {}  # held (engine thread) -> taken by the answer

    @property
    def endpoint(self) -> TransceiverEndpoint:
        if self.sender is None or self.sender.endpoint is None:
            raise RuntimeError("the ctx KV sender is not running")
        return self.sender.endpoint

    @property
    def endpoints(self) -> list[TransceiverEndpoint]:
        return []  # one rank: ``endpoint`` is all

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[CtxTransceiver]:
        """Start the sender (UCX worker, gRPC server); stop it on exit."""
        self._loop = asyncio.get_running_loop()
        server = self.server
        self.sender = KVSender(self.config, self.layout, self.core.transfer_caches, self._on_free,
                               host=server.transceiver_host, port=server.transceiver_port,
                               hold_timeout_s=server.pickup_timeout_s)
        await asyncio.to_thread(self.sender.start)
        refresher = asyncio.create_task(self._refresh_stats_forever())
        try:
            yield self
        finally:
            refresher.cancel()
            self._cancel_tasks()
            await asyncio.to_thread(self.sender.stop)
            self.sender = None
            self._loop = None

    def offer(self, request_id: str, num_prompt_tokens: int, first_gen_tokens: list[int]) -> OfferFn:
        """``offer(core)`` on the engine thread hands a finished, held prefill to the sender (it
        reads the request's cache handle there); raises if the sender does not take it."""

        def hold(driver: object) -> None:  # (the engine driver; the handle is this worker's core's)
            del driver
            sender = self.sender
            if sender is None:
                raise RuntimeError("the ctx KV sender is not running")
            handle = self.core.cache_manager.get(request_id)
            grant = sender.hold(request_id, handle, num_prompt_tokens, first_gen_tokens)
            if grant is not None:
                self._grants[request_id] = grant  # the answer carries it (take_grant)

        return hold

    def take_grant(self, request_id: str) -> PullGrant | None:
        """The pull granted when `request_id` was held (once; None if none was)."""
        return self._grants.pop(request_id, None)

    async def cancel(self, request_id: str, reason: str) -> bool:
        """Stop serving a hold; it is freed once quiesced. False if the sender does not hold it."""
        if self.sender is None:
            return False
        return await asyncio.to_thread(self.sender.cancel, request_id, reason)

    def stats(self) -> dict[str, float]:
        return self.snapshot.stats()

    def gauges(self) -> list[tuple[str, str, float]]:
        stats = self.stats()
        return [(name, text, stats[key]) for key, name, text in _GAUGES]

    # -- internals ----------------------------------------------------------------------------

    def _on_free(self, request_id: str) -> None:
        """Sender thread: the request's cache may be freed now."""
        self._grants.pop(request_id, None)  # a grant no answer took (the handler had already left)
        self.requests.post(SenderFreed(request_id))
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(lambda: self._spawn(self._refresh_stats()))
        except RuntimeError:  # the loop closed: nothing left to refresh
            pass

    async def _refresh_stats(self) -> None:
        sender = self.sender
        if sender is None:
            return
        try:
            stats = await asyncio.to_thread(sender.stats)
        except Exception as exc:  # noqa: BLE001 - the sender stopped or is busy: keep the last figures
            logger.debug("KV sender stats unavailable: %s", exc)
            return
        self.snapshot = SenderSnapshot(stats.num_held, stats.num_quarantined, stats.metrics, stats.num_granted)

    async def _refresh_stats_forever(self) -> None:
        while True:
            await self._refresh_stats()
            await asyncio.sleep(STATS_INTERVAL_S)
