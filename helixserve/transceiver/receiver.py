"""gen side: receives a request's shard into this rank's cache pools.

Lifecycle of one request on one gen rank (an `_Inbound`, driven by the engine thread):

1. **Begin** (`begin`, every rank of the CP group in the same executor step): the ctx layout is
   checked against ours (a mismatch raises `LayoutMismatchError` naming the fields, nothing is
   allocated), the shard's blocks and state slot are allocated in this rank's `CacheManager`
   (`CacheCapacityError` if they do not fit), the deadline is anchored and RequestShard is sent
   (asynchronously, with a deadline).
2. **Receiving**: once the ctx accepted, the sender's message list is checked against our own
   plan, then every message's receive is posted: straight into the pools when its bytes are one
   contiguous run here, else into a staging buffer that is scattered into the pools when it lands.
   ucxx's thread progresses UCX; `poll` / `check` observe completions (bounded, non-blocking).
3. **Done locally**: all messages landed and the AUX payload matches the request -> COMPLETED, an
   Acknowledge goes to the ctx. Failure (refused, ctx unreachable, UCX error, timeout) -> FAILED.
4. **Agreed** (`check`, one batched all-gather over the CP group): a request starts decoding only
   when COMPLETED on every rank (`TransferCheck.ready`: the cache handle now belongs to the
   engine). Failed or cancelled anywhere -> failed everywhere, reported once with one error.
5. **Drained and freed**: a rank that gives up first asks the ctx to stop (Cancel); the reply says
   how many messages were already posted, and those are still received (a UCX rendezvous send
   cannot be cancelled, so an unmatched one would pin the ctx's cache) before the endpoint is
   closed, which cancels the other receives. A dead or silent ctx: the endpoint is closed at once
   / after `drain_timeout_ms`. Blocks are freed only when quiesced on every rank of the group.

Threading: every method runs on the engine thread (it owns the `CacheManager`); only ucxx's own
thread writes into the pools, and only into the blocks/slot allocated to a transfer in flight.
"""

from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import dataclass

from helixserve.kvcache.manager import CacheHandle
from helixserve.models.context import ModelCaches
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import DisaggregatedParams, KVLayout
from helixserve.transceiver.base import PayloadKind, ReceiverSession, TransferState
from helixserve.transceiver.clock import Clock, MonotonicClock
from helixserve.transceiver.config import TransceiverConfig
from helixserve.transceiver.control import ControlClients, check_payloads, payload_descriptors, rpc_error_text, target
from helixserve.transceiver.layout import ShardPlan, ShardSpec, check_layout, decode_aux, scatter, wire_tag
from helixserve.transceiver.polling import PollResult, TransferMetrics, TransferPoller
from helixserve.transceiver.stream import KindHandle, Staging

logger = logging.getLogger(__name__)


class _Phase(enum.Enum):
    REQUESTING = "requesting"  # RequestShard in flight
    RECEIVING = "receiving"  # receives posted
    DONE = "done"  # every message landed
    DRAINING = "draining"  # gave up: waiting for the Cancel reply / the already-posted messages
    CLOSED = "closed"  # endpoint closed: nothing can write any more


@dataclass(slots=True)
class _Recv:
    handle: object | None = None
    staging: object | None = None  # (buffer, reservation) when staged
    is_done: bool = False


class _Inbound:
    """One request's shard stream into this rank (engine thread only)."""

    def __init__(self, receiver: KVReceiver, request_id: str, params: DisaggregatedParams,
                 handle: CacheHandle, caches: ModelCaches, tag_base: int) -> None:
        self.r = receiver
        self.request_id = request_id
        self.handle = handle
        self.caches = caches
        self.params = params
        self.tag_base = tag_base
        self.peer = ("ctx", request_id)
        self.ctx = f"ctx worker {target(params.ctx_endpoint)}"
        self.client = receiver.clients.get(params.ctx_endpoint)
        spec = ShardSpec(receiver.layout, len(params.prompt_token_ids), receiver.cp_rank, receiver.cp_size)
        self.plan = ShardPlan.for_receiver(spec, caches, handle.block_ids, handle.slot,
                                           receiver.config.message_bytes)
        self.phase = _Phase.REQUESTING
        self.recvs: list[_Recv] = []
        self.error: str | None = None
        self.future = None  # RequestShard, then Cancel
        self.drain_end: float | None = None
        self.num_to_drain = 0
        self._kind_indices: dict[PayloadKind, list[int]] = {}

    # -- requesting ---------------------------------------------------------------------------
    def request(self, deadline_s: float) -> None:
        handle = self.handle
        req = pb.ShardRequest(
            ctx_request_id=self.params.ctx_request_id, gen_rank=self.r.gen_rank,
            cp_rank=self.plan.spec.cp_rank, cp_size=self.plan.spec.cp_size,
            layout_json=self.r.layout.model_dump_json(), ucx_worker_address=self.r.plane.address,
            tag_base=self.tag_base, num_prompt_tokens=self.plan.spec.num_tokens,
            max_message_bytes=self.plan.message_bytes, deadline_ms=int(deadline_s * 1e3),
            dst_block_ids=handle.block_ids, dst_slot=-1 if handle.slot is None else handle.slot)
        self.future = self.client.request_shard_async(req, timeout_s=deadline_s)
        self.future.add_done_callback(lambda _: self.r.poller.wakeup.set())

    def advance(self) -> None:
        """Non-blocking progress of whatever phase the stream is in."""
        if self.phase is _Phase.REQUESTING and self.future.done():
            self._on_reply()
        if self.phase in (_Phase.RECEIVING, _Phase.DRAINING):
            self._post(len(self.recvs) if self.phase is _Phase.RECEIVING else self.num_to_drain)
            self._collect()
        if self.phase is _Phase.RECEIVING and all(r.is_done for r in self.recvs) and self.error is None:
            self._finish()
        if self.phase is _Phase.DRAINING:
            self._drain()

    def _on_reply(self) -> None:
        try:
            reply = self.future.result()
        except Exception as error:
            return self._fail(f"{self.ctx} did not answer RequestShard: {rpc_error_text(error)}")
        if not reply.accepted:
            return self._fail(f"{self.ctx} refused the transfer: {reply.error}")
        try:
            if not 1 <= reply.message_bytes <= self.plan.message_bytes:
                raise ValueError(f"message_bytes {reply.message_bytes} outside [1, {self.plan.message_bytes}]")
            self._replan(reply.message_bytes)
            check_payloads(payload_descriptors(self.plan.messages, self.plan.kinds), reply.payloads)
            self.r.plane.connect(self.peer, bytes(reply.ucx_worker_address))
        except Exception as error:
            self._fail(f"{self.ctx}'s transfer plan is unusable: {type(error).__name__}: {error}")
            return self.stop("unusable plan")  # it accepted: it may be sending already
        self.phase = _Phase.RECEIVING

    def _replan(self, message_bytes: int) -> None:
        if message_bytes != self.plan.message_bytes:
            self.plan = ShardPlan.for_receiver(self.plan.spec, self.caches, self.handle.block_ids,
                                               self.handle.slot, message_bytes)
        self.recvs = [_Recv() for _ in self.plan.messages]
        self._kind_indices = {k: [m.index for m in self.plan.kind_messages(k)] for k in self.plan.kinds}

    # -- receiving ----------------------------------------------------------------------------
    def _post(self, limit: int) -> None:
        for index in range(min(limit, len(self.recvs))):
            recv = self.recvs[index]
            if recv.handle is not None:
                continue
            message = self.plan.messages[index]
            spans = self.plan.spans(message)
            buffer = spans[0]
            if len(spans) > 1:
                recv.staging = self.r.staging.try_acquire(self.request_id, message.nbytes)
                if recv.staging is None:
                    return  # staging full: post the rest on a later poll
                buffer = recv.staging[0]
            recv.handle = self.r.plane.recv_message(self.peer, wire_tag(self.tag_base, index), buffer)

    def _collect(self) -> None:
        for index, recv in enumerate(self.recvs):
            if recv.handle is None or recv.is_done:
                continue
            state = recv.handle.test()
            if state is TransferState.TRANSFERRING:
                continue
            recv.is_done = True
            if state is TransferState.COMPLETED and self.phase is _Phase.RECEIVING:
                if recv.staging is not None:
                    scatter(recv.staging[0], self.plan.spans(self.plan.messages[index]))
                if self.plan.messages[index].kind is PayloadKind.AUX:
                    self._check_aux()
            elif state is not TransferState.COMPLETED and self.error is None and self.phase is _Phase.RECEIVING:
                self._fail(f"receiving message {index} from {self.ctx} failed: {recv.handle.error}")
            if recv.staging is not None:
                self.r.staging.release(recv.staging[1])
                recv.staging = None

    def _check_aux(self) -> None:
        try:
            num_tokens, first = decode_aux(self.plan.aux)
        except ValueError as error:
            return self._fail(f"{self.ctx}: {error}")
        if num_tokens != self.plan.spec.num_tokens or first != list(self.params.first_gen_tokens):
            self._fail(f"{self.ctx} sent prompt length {num_tokens} and first tokens {first}; the request "
                       f"has {self.plan.spec.num_tokens} and {list(self.params.first_gen_tokens)}")

    def _finish(self) -> None:
        self.phase = _Phase.DONE
        self.r.plane.close_peer(self.peer)
        self.phase = _Phase.CLOSED
        self.r.send_ack(self, success=True, error="")

    def _fail(self, error: str) -> None:
        self.error = self.error or error

    # -- giving up ----------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """Give up (session settled without success): drain what was posted, then close."""
        if self.phase in (_Phase.DRAINING, _Phase.CLOSED, _Phase.DONE):
            return
        if self.phase is _Phase.REQUESTING and self.future is not None:
            self.future.cancel()
        self.phase = _Phase.DRAINING
        self.drain_end = self.r.clock.monotonic() + self.r.config.drain_timeout_s
        cancel = pb.CancelRequest(ctx_request_id=self.params.ctx_request_id, cp_rank=self.plan.spec.cp_rank,
                                  gen_rank=self.r.gen_rank, reason=self.error or reason)
        self.future = self.client.cancel_async(cancel)
        self.num_to_drain = -1  # unknown until the Cancel reply

    def _drain(self) -> None:
        if self.num_to_drain < 0 and self.future.done():
            try:
                reply = self.future.result()
            except Exception as error:  # ctx gone: nothing more can arrive
                logger.info("request %s: Cancel to %s failed (%s); closing", self.request_id, self.ctx,
                            rpc_error_text(error))
                return self._close()
            self.num_to_drain = reply.num_posted_messages if reply.known else 0
            try:
                if self.num_to_drain and not self.recvs:  # never saw the RequestShard reply
                    if not 1 <= reply.message_bytes <= self.plan.message_bytes:
                        raise ValueError(f"message_bytes {reply.message_bytes} out of range")
                    self._replan(reply.message_bytes)
                if self.num_to_drain and not self.r.plane.is_connected(self.peer):
                    self.r.plane.connect(self.peer, bytes(reply.ucx_worker_address))
            except Exception as error:
                logger.warning("request %s: cannot drain (%s); closing", self.request_id, error)
                return self._close()
            self.num_to_drain = min(self.num_to_drain, len(self.recvs))
            self._post(self.num_to_drain)
            self._collect()
        drained = self.num_to_drain >= 0 and all(r.is_done for r in self.recvs[: self.num_to_drain])
        if drained or self.r.clock.monotonic() >= self.drain_end:
            self._close()

    def _close(self) -> None:
        self.r.plane.close_peer(self.peer)  # cancels every receive still posted
        self.phase = _Phase.CLOSED

    # -- Stream protocol (task handles) -------------------------------------------------------
    def kind_state(self, kind: PayloadKind) -> TransferState:
        self.advance()
        if self.error is not None:
            return TransferState.FAILED
        if self.phase in (_Phase.RECEIVING, _Phase.CLOSED) and self.recvs and all(
                self.recvs[i].is_done for i in self._kind_indices[kind]):
            return TransferState.COMPLETED  # (the last one to land closes the stream first)
        return TransferState.TRANSFERRING

    def is_quiesced(self) -> bool:
        return self.phase is _Phase.CLOSED and all(r.handle is None or r.handle.is_quiesced() for r in self.recvs)

    def fail_unsent(self, error: str) -> None:
        """Fail before anything was requested: nothing can arrive, so it is closed at once."""
        self._fail(error)
        self.phase = _Phase.CLOSED


class KVReceiver:
    """One gen rank's receiver; the caller (the engine) allocates and frees the cache handles.

    This is the seam of `engine.spmd.KVReceiver`: `start` / `poll` / `cancel`. For a receiver
    that allocates and agrees over its CP group itself, see `group.CPGroupReceiver`.

    Args:
        config: transceiver settings (timeouts, message size, bounce pool).
        layout: this rank's layout with *global* head counts (as a ctx worker advertises it).
        cp_rank / cp_size: this rank's place in its CP group (defines the shard).
        gen_rank: this rank's id in the gen world (errors, logs).
    """

    def __init__(self, config: TransceiverConfig, layout: KVLayout, *, cp_rank: int = 0, cp_size: int = 1,
                 gen_rank: int = 0, clock: Clock | None = None) -> None:
        from helixserve.transceiver.sender import _bounce_pool
        from helixserve.transceiver.ucxx_backend import UcxxDataPlane

        check_layout(layout, layout, "gen", "gen")
        ShardSpec(layout, 1, cp_rank, cp_size)  # KDA heads divisible by cp_size
        self.config = config
        self.layout = layout
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.gen_rank = gen_rank
        self.clock: Clock = clock or MonotonicClock()
        self.poller = TransferPoller(clock=self.clock)
        self.plane = UcxxDataPlane(progress_thread=True)
        self.clients = ControlClients(config.rpc_timeout_s)
        self.staging = Staging(_bounce_pool(config))
        self.inbounds: dict[str, _Inbound] = {}
        self._reported: set[str] = set()
        self._acks: list = []
        self._tags = itertools.count(1)

    def start(self, request_id: str, handle: CacheHandle, caches: ModelCaches, ticket: DisaggregatedParams) -> None:
        """Receive `request_id`'s shard into `handle` (blocks and slot of `caches`).

        Transfer-level problems (layout mismatch, refused, unreachable, timeout) are reported by
        `poll`, never raised; a duplicate id or a handle too small for the prompt raises ValueError.
        """
        if request_id in self.inbounds:
            raise ValueError(f"request {request_id} is already being received here")
        session = ReceiverSession(request_id, timeout_s=self.config.timeout_s, clock=self.clock)
        inbound = _Inbound(self, request_id, ticket, handle, caches, next(self._tags))
        for kind in inbound.plan.kinds:
            session.add_task(0, kind, sum(m.nbytes for m in inbound.plan.kind_messages(kind)))
        self.poller.add(session)
        self.inbounds[request_id] = inbound
        for kind in inbound.plan.kinds:
            session.attach(0, kind, KindHandle(inbound, kind))  # anchors the deadline
        try:
            if not ticket.is_generation_only:
                raise ValueError("disaggregated_params must be generation_only")
            check_layout(self.layout, ticket.layout, "gen", inbound.ctx)
        except ValueError as error:
            return inbound.fail_unsent(str(error))
        inbound.request(session.remaining())

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
            self.clock.wait(None, 0.001)
        if not session.is_quiesced:
            logger.error("request %s: transfer not quiesced after cancel; a late write may land", request_id)
            self.inbounds[request_id]._close()
        self.forget(request_id, force=True)
        return True

    def progress(self, wait_num: int | None = 0, interval_s: float = 0.0) -> PollResult:
        """One bounded poller pass plus the drains of transfers that gave up."""
        self._drive()
        result = self.poller.poll(wait_num, interval_s)
        self._drive()
        return result

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
        self.inbounds.pop(request_id)
        self._reported.discard(request_id)

    def fail(self, request_id: str, reason: str) -> None:
        session = self.poller.sessions[request_id]
        if not session.state.is_settled:
            session.fail(reason)
            session.update()

    def error_of(self, request_id: str) -> str:
        session = self.poller.sessions[request_id]
        inbound = self.inbounds[request_id]
        return (f"request {request_id}: KV transfer from {inbound.ctx} to gen rank {self.gen_rank} "
                f"failed: {inbound.error or session.error}")

    @property
    def metrics(self) -> TransferMetrics:
        return self.poller.metrics

    def close(self) -> None:
        """Shut down: close every transfer (frees nothing: the caller owns the handles)."""
        for inbound in self.inbounds.values():
            inbound._close()
        self.plane.close()
        self.clients.close()

    def _drive(self) -> None:
        """Start draining transfers whose session ended without success; progress the drains."""
        for request_id, inbound in self.inbounds.items():
            session = self.poller.sessions[request_id]
            if session.state.is_settled and session.state is not TransferState.COMPLETED:
                inbound.stop(session.error or session.state.value)
            if inbound.phase is _Phase.DRAINING:
                inbound.advance()
        self._acks = [f for f in self._acks if not f.done()]

    def send_ack(self, inbound: _Inbound, success: bool, error: str) -> None:
        ack = pb.AckRequest(ctx_request_id=inbound.params.ctx_request_id, cp_rank=inbound.plan.spec.cp_rank,
                            gen_rank=self.gen_rank, success=success, error=error)
        self._acks.append(inbound.client.acknowledge_async(ack))
