"""gen side: receives requests' shards into this rank's cache pools (engine thread only).

`KVReceiver` is the rank's transfer machine; the caller owns the cache handles. This is the seam
the SPMD gen world plugs in (as `engine.kv_intake.ShardReceiver`, through the gen server's
`PacedKVReceiver`; its `RankTransfers` agree over the CP group).

1. `start(request_id, handle, caches, ticket)`: the ticket (a `ticket.KVTicket`) is checked
   (layout equal to ours), the request's overall deadline is anchored now and its `Inbound`
   starts a transport (see `transport`): a granted pull copies at once; otherwise RequestShard
   goes to the ctx worker asynchronously, with that deadline. For the tagged stream every
   receive is posted while the ctx answers (see `tagged_stream`): ucxx's own thread moves the
   bytes straight into the pools (or staging) as the ctx sends, so transfers progress while the
   engine computes. Problems are reported by `poll`, never raised.
2. The ctx's answer is checked against our own plan (an untrusted plan is refused).
3. `poll()` (bounded, non-blocking by default) returns the transfers that ended: ``None`` for a
   complete one (the handle is the caller's again: start decoding), or an error naming the ctx
   worker and the cause (refused, unreachable, UCX error, AUX mismatch, timeout). A complete
   transfer is acknowledged to the ctx.
4. `cancel(request_id)` (client gone, or the group failed it; also before freeing a failed one's
   handle) stops it and returns once nothing can write into its handle any more: the ctx is told
   to stop, what it already posted is still received, then every receive still posted is
   retracted (bounded by `drain_timeout_ms` + `rpc_timeout_ms`). The UCX endpoint to a ctx worker
   is shared by all requests and never closed per request (see `ucxx_backend`, `retract`).

Threading: every method runs on the engine thread; only ucxx's thread (and a pull's copy, on the
engine's stream) writes into the pools, and only into the blocks/slot of a transfer in flight,
which the caller must not free or reuse until `poll` reported the transfer complete or `cancel`
returned.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.clock import Clock, MonotonicClock
from helixserve.config_transceiver import TransceiverConfig
from helixserve.kvcache.manager import CacheHandle
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import DisaggregatedParams, KVLayout, TransceiverEndpoint
from helixserve.transceiver.backends import open_data_plane
from helixserve.transceiver.base import ReceiverSession, TransferState
from helixserve.transceiver.gen.control_client import ControlClient, ControlClients
from helixserve.transceiver.control import target
from helixserve.transceiver.cuda_ipc import PoolDirectory, ask_until_answered
from helixserve.transceiver.gen.inbound import Inbound, Phase
from helixserve.transceiver.cache_check import check_caches
from helixserve.transceiver.layout import ShardSpec
from helixserve.transceiver.layout_match import LayoutMismatchError, check_layout
from helixserve.transceiver.plane import DataPlane
from helixserve.transceiver.gen.pull import warm_up_copy
from helixserve.transceiver.polling import DEFAULT_TICK_S, PollResult, TransferMetrics, TransferPoller
from helixserve.transceiver.gen.retract import Retractor
from helixserve.transceiver.stream import KindHandle, staging_for
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)

# internal: a retraction is a local 0-byte message that ends in microseconds; this only bounds a
# broken plane (the request already failed, drain_timeout_ms bounded the wait before it)
RETRACT_WAIT_S = 1.0
# internal: a ctx not answering DescribePools at a gen rank's start (still loading) is asked again
# this often, this many times (a minute), so that its first request is already pulled and granted
PREFETCH_RETRY_S = 0.5
PREFETCH_ATTEMPTS = 120
# internal: while a pulled shard's copy is in flight (10–200 µs on an H200; its end sets no
# wakeup), the poller probes the copies' events this often between its sweeps (a tick apart)
PULL_TICK_S = 0.00002  # (a wait this short spins: clock.SPIN_BELOW_S)


class KVReceiver:
    """One gen rank's receiver; the caller (the engine) allocates and frees the cache handles.

    It serves the engine's seam `engine.kv_intake.ShardReceiver`: `start` / `poll` / `cancel`.

    Args:
        config: transceiver settings (timeouts, message size, bounce pool).
        layout: this rank's layout with *global* head counts (as a ctx worker advertises it).
        cp_rank / cp_size: this rank's place in its CP group (defines the shard).
        gen_rank: this rank's id in the gen world (errors, logs).
        peer_hosts: the ctx transceivers' hosts it will reach (the data plane may bind toward them).
    """

    def __init__(self, config: TransceiverConfig, layout: KVLayout, *, cp_rank: int = 0, cp_size: int = 1,
                 gen_rank: int = 0, clock: Clock | None = None, peer_hosts: Sequence[str] = ()) -> None:
        check_layout(layout, layout, "gen", "gen")
        ShardSpec(layout, 1, cp_rank, cp_size)  # KDA heads divisible by cp_size
        self.config = config
        self.layout = layout
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.gen_rank = gen_rank
        self.clock: Clock = clock or MonotonicClock()
        self.poller = TransferPoller(clock=self.clock)
        # config.backend picks it
        self.plane: DataPlane = open_data_plane(config, self.poller.wakeup, peer_hosts=tuple(peer_hosts))
        self.retractor = Retractor(self.plane, self.clock, config.timeout_s)
        self.clients = ControlClients(config.rpc_timeout_s, config)
        self.staging = staging_for(config)
        self.pools = PoolDirectory(gen_rank, layout, enabled=config.cuda_ipc)
        self.num_pulled = 0  # shards copied out of a ctx's pools (cuda_ipc), not sent
        self.num_granted = 0  # of those, copied on the ctx's grant (no RequestShard)
        self.inbounds: dict[str, Inbound] = {}  # each request's (first) inbound
        self._fanned: dict[str, list[Inbound]] = {}  # a request from several ctx ranks: an inbound per rank
        self._reported: set[str] = set()
        self._acks: list = []
        self._tags = itertools.count(1)
        self.draft_fallbacks: set[tuple] = set()  # (ctx, its drafter) whose drafter cache is rebuilt here (logged)

    def start(self, request_id: str, handle: CacheHandle, caches: ModelCaches,
              ticket: KVTicket | DisaggregatedParams) -> None:
        """Receive `request_id`'s shard into `handle` (blocks and slot of `caches`).

        A ticket of a ctx world (``ctx_endpoints``) is received from each ctx rank holding part of
        this rank's shard (`KVTicket.source_tickets`): an inbound per rank, each its task per kind
        in the request's one session, so the request completes, fails and is cancelled as one.

        Transfer-level problems (layout mismatch, refused, unreachable, timeout) are reported by
        `poll`, never raised; a duplicate id, a handle too small for the prompt or params that are
        not ``generation_only`` raise ValueError. (``DisaggregatedParams`` are read as their ticket.)
        """
        if isinstance(ticket, DisaggregatedParams):
            ticket = KVTicket.from_params(ticket)
        if request_id in self.inbounds:
            raise ValueError(f"request {request_id} is already being received here")
        device = check_caches(self.layout, caches, self.layout.num_kda_heads // self.cp_size, remember=True)
        session = ReceiverSession(request_id, timeout_s=self.config.timeout_s, clock=self.clock,
                                  wakeup=self.poller.wakeup)  # (the poller's: `add` sets it anyway)
        inbounds = [Inbound(self, request_id, source, handle, caches, next(self._tags), device)
                    for source in ticket.source_tickets(self.cp_rank, self.cp_size)]
        kind_bytes = [dict.fromkeys(inbound.plan.kinds, 0) for inbound in inbounds]
        for inbound, sizes in zip(inbounds, kind_bytes):
            for seg in inbound.plan.segments:  # (its messages cut its segments: the same bytes)
                sizes[seg.kind] += seg.nbytes
        for peer, sizes in enumerate(kind_bytes):
            for kind, nbytes in sizes.items():
                session.add_task(peer, kind, nbytes)
        self.poller.add(session)
        self.inbounds[request_id] = inbounds[0]
        if len(inbounds) > 1:
            self._fanned[request_id] = inbounds
        for peer, (inbound, sizes) in enumerate(zip(inbounds, kind_bytes)):
            for kind in sizes:
                session.attach(peer, kind, KindHandle(inbound, kind))  # anchors the deadline
        try:
            check_layout(self.layout, ticket.layout, "gen", inbounds[0].ctx)
            if ticket.layout.ctx_tp_size != 1 and not ticket.ctx_endpoints:  # one rank's part is not the shard
                raise LayoutMismatchError(f"{inbounds[0].ctx}: a ctx world of ctx_tp_size {ticket.layout.ctx_tp_size} "
                                          "holds the request, the ticket names none of its ranks' endpoints")
        except ValueError as error:
            for inbound in inbounds:
                inbound.fail_unsent(str(error))
            return None
        for inbound in inbounds:
            inbound.request(session.remaining())  # starts its transport (the tagged stream posts every receive)
        return None

    def inbounds_of(self, request_id: str) -> list[Inbound]:
        """The inbounds of a request: one per ctx rank it is received from."""
        return self._fanned.get(request_id) or [self.inbounds[request_id]]

    def _every_inbound(self) -> list[Inbound]:
        if not self._fanned:
            return list(self.inbounds.values())
        return [inbound for request_id in self.inbounds for inbound in self.inbounds_of(request_id)]

    def poll(self, wait_num: int | None = 0, interval_s: float = 0.0) -> dict[str, str | None]:
        """Bounded local poll; transfers that ended since the last call: ``id -> None`` (complete:
        the handle is the caller's now) or an error message (call `cancel` before freeing)."""
        self.progress(wait_num, interval_s)
        out: dict[str, str | None] = {}
        for request_id, session in list(self.poller.sessions.items()):
            if not session.state.is_settled or request_id in self._reported:
                continue
            if session.state is TransferState.COMPLETED:
                out[request_id] = None
                self.forget(request_id)
            else:
                out[request_id] = self.error_of(request_id)
                self._reported.add(request_id)
        return out

    def cancel(self, request_id: str, reason: str = "cancelled", wait_s: float | None = None) -> bool:
        """Stop a transfer and return once nothing can write into its handle any more (bounded by
        `wait_s`, default drain + rpc timeouts); then forget it. False if unknown."""
        session = self.poller.sessions.get(request_id)
        if session is None:
            return False
        if not session.state.is_settled:
            session.cancel(reason)
            session.update()
        limit = self.clock.monotonic() + (wait_s if wait_s is not None else
                                          self.config.drain_timeout_s + self.config.rpc_timeout_s)
        while not session.is_quiesced and self.clock.monotonic() < limit:
            self.progress()
            self.clock.wait(None, DEFAULT_TICK_S)
        if not session.is_quiesced:
            for inbound in self.inbounds_of(request_id):
                if inbound.phase is not Phase.CLOSED:
                    inbound.close(may_still_send=None)  # drain overran: retract, sinks absorb late messages
            limit = self.clock.monotonic() + RETRACT_WAIT_S
            while not session.is_quiesced and self.clock.monotonic() < limit:
                self.clock.wait(None, DEFAULT_TICK_S)
        if not session.is_quiesced:
            logger.error("request %s: transfer not quiesced after cancel; a late write may land", request_id)
        self.forget(request_id, force=True)
        return True

    def progress(self, wait_num: int | None = 0, interval_s: float = 0.0) -> PollResult:
        """One bounded poller pass plus the drains of transfers that gave up."""
        self._drive()
        self.retractor.prune()
        result = self.poller.poll(wait_num, interval_s, self._copy_ended_probe(), PULL_TICK_S)
        self._drive()
        return result

    def _copy_ended_probe(self):  # noqa: ANN202 (Callable[[], bool] | None)
        """None when no pull is in flight or may start (none pulling, none asking a ctx whose
        pools it has open); else a probe that says True once for each pulled copy that ended
        since it was made (pulls a sweep launches too), so that the poller sweeps at once."""
        inbounds = self._every_inbound()
        if not any(i.phase is Phase.TRANSFERRING and i.transport.pulls for i in inbounds):
            return None
        seen: set[int] = set()

        def ended() -> bool:
            found = False
            for inbound in inbounds:
                copy = inbound.transport.copy
                if inbound.phase is Phase.TRANSFERRING and copy is not None and id(copy) not in seen and copy.is_done():
                    seen.add(id(copy))
                    found = True
            return found
        return ended

    def forget(self, request_id: str, force: bool = False) -> None:
        """Drop a settled transfer (quiesced unless `force`)."""
        session = self.poller.sessions[request_id]
        if force and not session.state.is_settled:
            session.cancel("forgotten")
            session.update()
        if force or session.is_quiesced:
            self.poller.sessions.pop(request_id)
        else:
            self.poller.retire(request_id)  # raises: not quiesced
        for inbound in self.inbounds_of(request_id):
            if inbound.phase is not Phase.CLOSED:
                inbound.close(may_still_send=None)  # (nothing is posted any more once complete)
        self.inbounds.pop(request_id)
        self._fanned.pop(request_id, None)
        self._reported.discard(request_id)

    def fail(self, request_id: str, reason: str) -> None:
        session = self.poller.sessions[request_id]
        if not session.state.is_settled:
            session.fail(reason)
            session.update()

    def error_of(self, request_id: str) -> str:
        session = self.poller.sessions[request_id]
        inbounds = self.inbounds_of(request_id)
        inbound = next((i for i in inbounds if i.error), inbounds[0])  # the ctx rank that failed it
        return (f"request {request_id}: KV transfer from {inbound.ctx} to gen rank {self.gen_rank} "
                f"failed: {inbound.error or session.error}")

    @property
    def metrics(self) -> TransferMetrics:
        return self.poller.metrics

    def close(self) -> None:
        """Shut down: close every transfer (frees nothing: the caller owns the handles)."""
        for inbound in self._every_inbound():
            if inbound.phase is not Phase.CLOSED:
                inbound.close()
        self.plane.close()  # closing the endpoints cancels whatever is still posted
        self.clients.close()

    def _drive(self) -> None:
        """Start draining transfers whose session ended without success; progress the drains."""
        for request_id in self.inbounds:
            session = self.poller.sessions[request_id]
            for inbound in self.inbounds_of(request_id):
                if session.state.is_settled and session.state is not TransferState.COMPLETED:
                    inbound.stop(session.error or session.state.value)
                if inbound.phase is Phase.DRAINING:
                    inbound.advance()
        self._acks = [f for f in self._acks if not f.done()]

    def warm_up(self, device: torch.device) -> None:
        """Compile what a pulled shard runs on `device` (its copy kernel), so that the first
        request does not pay for it; nothing to do off CUDA or with cuda_ipc off."""
        if device.type == "cuda" and self.config.cuda_ipc:
            warm_up_copy(device)

    def connect_ahead(self, endpoints: Sequence[TransceiverEndpoint]) -> None:
        """Open the control channels to these ctx workers now, so that the first transfer from each
        finds its connection up (`ControlClients.connect_ahead`); not blocking."""
        self.clients.connect_ahead(endpoints)

    def prefetch(self, endpoints: Sequence[TransceiverEndpoint], device: torch.device) -> None:
        """Ask these ctx workers for their pools now (not blocking; `cuda_ipc`), so that the first
        request to each can already be pulled (and granted): a ctx that does not answer yet (still
        loading) is asked again every PREFETCH_RETRY_S for up to PREFETCH_ATTEMPTS tries."""
        if device.type != "cuda" or not self.config.cuda_ipc:
            return
        for endpoint in endpoints:
            # its own channels, each closed once answered: a ctx not listening yet leaves a
            # connection attempt pending for up to grpc's min_reconnect_backoff, which must not be
            # the one the first request's RequestShard waits behind
            def make_client(endpoint: TransceiverEndpoint = endpoint) -> ControlClient:
                return ControlClient(endpoint, self.config.rpc_timeout_s, config=self.config)
            if self.pools.wants(target(endpoint), device):
                answer = ask_until_answered(make_client, self.pools.request(), PREFETCH_RETRY_S, PREFETCH_ATTEMPTS)
                self.pools.expect(target(endpoint), self.pools.opened(answer, device))

    def send_ack(self, inbound: Inbound, success: bool, error: str) -> None:
        ack = pb.AckRequest(ctx_request_id=inbound.ticket.ctx_request_id, cp_rank=inbound.plan.spec.cp_rank,
                            gen_rank=self.gen_rank, success=success, error=error,
                            cp_size=inbound.plan.spec.cp_size)
        self._acks.append(inbound.client.acknowledge_async(ack))
