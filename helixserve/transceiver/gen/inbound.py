"""One request's shard stream into a gen rank (owned by the engine thread; see `receiver`).

Phases: REQUESTING (RequestShard in flight; every receive is already posted, on the worker, right
after the request went out: in place when the message's bytes are one run of the pools, else into
a staging buffer scattered on arrival; the receiver's plan is the stream's cut, since the ctx cuts
with exactly the receiver's ``max_message_bytes``, so the ctx's first send finds its receive
waiting and the request costs one control round trip, overlapped with the data) -> RECEIVING (the
ctx's reply checked against the posted plan) -> DONE (all landed, AUX checked, acknowledged). Giving up: DRAINING (Cancel sent; the messages
the ctx says it already posted are still received, because an unmatched rendezvous send would
pin the ctx's cache) -> CLOSED (every receive still posted is retracted, see `retract`; the
endpoint to the ctx worker is shared by all requests and stays open). A RequestShard the ctx
refused goes straight to CLOSED (its posted receives retracted): nothing was or will be sent for
it, and a Cancel would stop the hold for whichever rank holds it. A ctx whose control connection
closes mid-stream (it died) fails it at once and goes straight to CLOSED, sinks posted: no drain.

Pulled (`pull`, `cuda_ipc`): when this rank holds the ctx's opened pools, RequestShard names their
epoch and no receive is posted; a ctx that answers with `pull` sends nothing: the shard is copied
out of its pools by one unit-copy launch (PULLING; no memory map of either side), then acknowledged (DONE). A ctx that answers
with the tagged stream instead (it restarted: another epoch) gets the receives posted then. Giving
up while PULLING first waits (bounded) for the launched copy, so nothing writes once it returns.

Granted (`grant`, `lease`): when the request carries the ctx's `PullGrant` for pools this rank has
open, with a matching MAC and its lease word held, the copy is launched at `request` (PULLING at
once: no RequestShard, no round trip before the copy). Once it ended the lease word is read
again: still held, the shard is acknowledged (DONE); not, and the copy is thrown away and the
rank asks with RequestShard (REQUESTING), which rewrites every byte or is refused.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.kvcache.manager import CacheHandle
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import PullGrant
from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.control import rpc_error_text, target
from helixserve.transceiver.cuda_ipc import RemotePools
from helixserve.transceiver.grant import grant_matches
from helixserve.transceiver.payloads import check_payloads, payload_descriptors
from helixserve.transceiver.layout import ShardPlan, ShardSpec, decode_aux, scatter, wire_tag
from helixserve.transceiver.plane import TransferHandle
from helixserve.transceiver.gen.pull import Pull, pull_pair
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    REQUESTING = "requesting"  # RequestShard in flight
    RECEIVING = "receiving"  # receives posted
    PULLING = "pulling"  # the copy out of the ctx's pools is launched
    DONE = "done"  # every message landed
    DRAINING = "draining"  # gave up: waiting for the Cancel reply / the already-posted messages
    CLOSED = "closed"  # receives retracted: nothing can write once they ended


@dataclass(slots=True)
class _Recv:
    handle: TransferHandle | None = None
    staging: object | None = None  # (buffer, reservation) when staged
    is_done: bool = False


class Inbound:
    """One request's shard stream into this rank (engine thread only)."""

    def __init__(self, receiver, request_id: str, ticket: KVTicket,
                 handle: CacheHandle, caches: ModelCaches, tag_base: int, device: torch.device | None) -> None:
        self.r = receiver
        self.request_id = request_id
        self.handle = handle
        self.caches = caches
        self.ticket = ticket
        self.tag_base = tag_base
        self.peer: Hashable | None = None  # the plane's shared endpoint to the ctx worker, once known
        self.ctx = f"ctx worker {target(ticket.ctx_endpoint)}"
        self.client = receiver.clients.get(ticket.ctx_endpoint)
        self.num_losses = self.client.num_losses  # its connection closing from now on: ctx gone
        spec = ShardSpec(receiver.layout, ticket.num_prompt_tokens, receiver.cp_rank, receiver.cp_size)
        self.plan = ShardPlan.for_receiver(spec, caches, handle.block_ids, handle.slot,
                                           receiver.config.message_bytes)
        self.phase = Phase.REQUESTING
        self.recvs: list[_Recv] = []
        self._pending: deque[int] = deque()
        self.error: str | None = None
        self.future = None  # RequestShard, then Cancel
        self.drain_end: float | None = None
        self.num_to_drain = 0
        self._kind_indices: dict[PayloadKind, list[int]] = {}
        self.device = device  # the one device of `caches` (None: several or none)
        self.pools: RemotePools | None = None  # asked to pull from these
        self.pull: Pull | None = None
        self.grant: PullGrant | None = None  # the granted pull in flight
        self.deadline_at = 0.0

    # -- requesting ---------------------------------------------------------------------------
    def request(self, deadline_s: float) -> None:
        self.deadline_at = self.r.clock.monotonic() + deadline_s
        if self.device is not None and self.device.type == "cuda":
            self.pools = self.r.pools.get(target(self.ticket.ctx_endpoint), self.client, self.device)
            if self.ticket.pull_grant is not None and self._start_granted(self.ticket.pull_grant):
                return
        self._request_shard(deadline_s)

    def _request_shard(self, deadline_s: float) -> None:
        handle = self.handle
        req = pb.ShardRequest(
            ctx_request_id=self.ticket.ctx_request_id, gen_rank=self.r.gen_rank,
            cp_rank=self.plan.spec.cp_rank, cp_size=self.plan.spec.cp_size,
            layout_json=self.r.layout.model_dump_json(), ucx_worker_address=self.r.plane.address,
            tag_base=self.tag_base, num_prompt_tokens=self.plan.spec.num_tokens,
            max_message_bytes=self.plan.message_bytes, deadline_ms=int(deadline_s * 1e3),
            dst_block_ids=handle.block_ids, dst_slot=-1 if handle.slot is None else handle.slot)
        if self.pools is not None:
            req.pull_epoch = self.pools.epoch
        self.future = self.client.request_shard_async(req, timeout_s=deadline_s)
        self.future.add_done_callback(lambda _: self.r.poller.wakeup.set())
        self._replan(self.plan.message_bytes)
        self._post(len(self.recvs))  # while the request travels (maps our memory on the way)

    def advance(self) -> None:
        """Non-blocking progress of whatever phase the stream is in."""
        if self.phase in (Phase.REQUESTING, Phase.RECEIVING) and self.error is None and self.is_ctx_gone:
            self._fail(f"{self.ctx} went away mid-transfer (its control connection closed)")
        if self.phase is Phase.REQUESTING and self.future.done():
            self._on_reply()
        if self.phase in (Phase.REQUESTING, Phase.RECEIVING, Phase.DRAINING):
            self._post(self.num_to_drain if self.phase is Phase.DRAINING else len(self.recvs))
        self._collect()
        if self.phase is Phase.RECEIVING and all(r.is_done for r in self.recvs) and self.error is None:
            self._finish()
        if self.phase is Phase.PULLING and self.pull.is_done() and self.error is None:
            if self.grant is not None and not self._still_granted():
                return
            self._finish()
        if self.phase is Phase.DRAINING:
            self._drain()

    def _on_reply(self) -> None:
        try:
            reply = self.future.result()
        except Exception as error:
            return self._fail(f"{self.ctx} did not answer RequestShard: {rpc_error_text(error)}")
        if not reply.accepted:  # final (see KVSender.request_shard): no stream exists for us, so
            # no Cancel: it would stop the hold for the rank that holds it (e.g. a duplicate's)
            return self.fail_unsent(f"{self.ctx} refused the transfer: {reply.error}")
        if reply.HasField("pull"):
            return self._start_pull(reply.pull)
        if self.pools is not None:  # it chose the tagged stream: it restarted, describe it again
            self.r.pools.forget(target(self.ticket.ctx_endpoint))
            self.pools = None
        try:
            if reply.message_bytes != self.plan.message_bytes:  # our receives are posted with our cut
                raise ValueError(f"message_bytes {reply.message_bytes} != the {self.plan.message_bytes} asked for")
            check_payloads(payload_descriptors(self.plan.messages, self.plan.kinds), reply.payloads)
            self.peer = self.r.plane.connect_worker(bytes(reply.ucx_worker_address))
        except Exception as error:
            self._fail(f"{self.ctx}'s transfer plan is unusable: {type(error).__name__}: {error}")
            return self.stop("unusable plan")  # it accepted: it may be sending already
        self.phase = Phase.RECEIVING

    def _replan(self, message_bytes: int) -> None:
        if message_bytes != self.plan.message_bytes:
            self.plan = ShardPlan.for_receiver(self.plan.spec, self.caches, self.handle.block_ids,
                                               self.handle.slot, message_bytes)
        self.recvs = [_Recv() for _ in self.plan.messages]
        self._pending: deque[int] = deque()  # posted, not landed yet, in post order
        self._kind_indices = {k: [m.index for m in self.plan.kind_messages(k)] for k in self.plan.kinds}

    # -- pulling ------------------------------------------------------------------------------
    def _start_granted(self, grant: PullGrant) -> bool:
        """Launch the granted copy now; False (nothing launched) when the grant is not usable."""
        pools = self.pools
        if pools is None or pools.lease is None or grant.epoch != pools.epoch:
            return False  # not opened (yet), or from another export of that ctx: ask
        spec = self.plan.spec
        if not grant_matches(pools.grant_key, grant, self.ticket.ctx_request_id, spec.num_tokens,
                             self.ticket.first_gen_tokens):
            logger.warning("request %s: %s's pull grant does not match the request; asking instead",
                           self.request_id, self.ctx)
            return False
        if not pools.lease.holds(grant.serial):
            return False  # freed already: RequestShard gets the ctx's own answer
        try:
            self.pull = self._launch(grant.block_ids, None if grant.slot < 0 else grant.slot)
        except Exception as error:  # noqa: BLE001 (nothing launched: ask instead)
            logger.warning("request %s: %s's pull grant is unusable (%s: %s); asking instead", self.request_id,
                           self.ctx, type(error).__name__, error)
            return False
        self.grant = grant
        self.phase = Phase.PULLING
        return True

    def _still_granted(self) -> bool:
        """After the granted copy ended: the ctx still held the blocks then. If not, the copy is
        thrown away (nothing was acknowledged) and the rank asks with RequestShard."""
        if self.pools is not None and self.pools.lease is not None and self.pools.lease.holds(self.grant.serial):
            return True
        logger.info("request %s: %s freed the granted blocks during the copy; asking instead",
                    self.request_id, self.ctx)
        self.grant, self.pull, self.phase = None, None, Phase.REQUESTING
        self._request_shard(max(self.deadline_at - self.r.clock.monotonic(), 0.0))
        return False

    def _launch(self, src_block_ids: Sequence[int], src_slot: int | None) -> Pull:
        """Launch the copy of this rank's shard out of the ctx's opened pools, whose request
        holds logical block b at ``src_block_ids[b]`` and its KDA state at `src_slot`."""
        pair = pull_pair(self.pools.pairs, self.r.layout, self.pools.caches, self.caches, self.plan.spec.num_local_heads)
        groups = pair.groups(self.plan.spec, src_block_ids, src_slot, self.handle.block_ids, self.handle.slot)
        return Pull(pair, groups, self.device)

    def _start_pull(self, shard: pb.PullShard) -> None:
        try:
            if self.pools is None:
                raise ValueError("it answered with a pull this rank did not ask for")
            self._check_aux(torch.tensor(list(shard.aux), dtype=torch.int64))
            if self.error is not None:
                return self.stop("the ctx holds another prefill")
            self.pull = self._launch(list(shard.src_block_ids), None if shard.src_slot < 0 else int(shard.src_slot))
            self.r.num_pulled += 1
        except Exception as error:
            self._fail(f"{self.ctx}'s pull shard is unusable: {type(error).__name__}: {error}")
            return self.stop("unusable pull shard")  # it accepted: it keeps the blocks until told
        self.phase = Phase.PULLING

    # -- receiving ----------------------------------------------------------------------------
    def _post(self, limit: int) -> None:
        if self.pools is not None:
            return  # asked to pull: nothing is sent to this rank
        for index in range(min(limit, len(self.recvs))):
            recv = self.recvs[index]
            if recv.handle is not None:
                continue
            message = self.plan.messages[index]
            try:
                spans = self.plan.spans(message)
                buffer = spans[0]
                if len(spans) > 1:
                    recv.staging = self.r.staging.try_acquire(self.request_id, message.nbytes, spans[0].device)
                    if recv.staging is None:
                        return  # staging full: post the rest on a later poll
                    buffer = recv.staging[0]
                recv.handle = self.r.plane.recv_message(None, wire_tag(self.tag_base, index), buffer)
            except Exception as error:
                if recv.staging is not None:
                    self.r.staging.release(recv.staging[1], recv.staging[0])
                    recv.staging = None
                return self._fail(f"posting the receive of message {index} failed: {type(error).__name__}: {error}")
            self._pending.append(index)

    def _collect(self) -> None:
        """Land completed receives, testing from the oldest posted one and stopping at the first
        still in flight: messages complete in stream order, so a poll costs O(1), not O(stream)."""
        while self._pending:
            index = self._pending[0]
            recv = self.recvs[index]
            state = recv.handle.test()
            if state is TransferState.TRANSFERRING:
                return
            self._pending.popleft()
            recv.is_done = True
            is_live = self.phase in (Phase.REQUESTING, Phase.RECEIVING)
            if state is TransferState.COMPLETED and is_live:
                if recv.staging is not None:
                    scatter(recv.staging[0], self.plan.spans(self.plan.messages[index]))
                if self.plan.messages[index].kind is PayloadKind.AUX:
                    self._check_aux(self.plan.aux)
            elif state is not TransferState.COMPLETED and self.error is None and is_live:
                self._fail(f"receiving message {index} from {self.ctx} failed: {recv.handle.error}")
            if recv.staging is not None:
                self.r.staging.release(recv.staging[1], recv.staging[0])
                recv.staging = None

    def _check_aux(self, aux: torch.Tensor) -> None:
        try:
            num_tokens, first = decode_aux(aux)
        except ValueError as error:
            return self._fail(f"{self.ctx}: {error}")
        if num_tokens != self.plan.spec.num_tokens or first != list(self.ticket.first_gen_tokens):
            # the cause goes to the client: it must tell nothing of what ctx holds (its true first
            # tokens belong to another request's answer); the details stay in this log
            logger.warning("%s: %s holds prompt length %d, first tokens %s; the request has %d, %s",
                           self.request_id, self.ctx, num_tokens, first, self.plan.spec.num_tokens,
                           list(self.ticket.first_gen_tokens))
            self._fail(f"{self.ctx} holds a different prefill under ctx_request_id "
                       f"{self.ticket.ctx_request_id!r} than this request describes")

    def _finish(self) -> None:
        self.r.num_granted += self.grant is not None
        self.phase = Phase.DONE  # every receive completed: nothing can write any more
        self.r.send_ack(self, success=True, error="")

    def _fail(self, error: str) -> None:
        self.error = self.error or error

    # -- giving up ----------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """Give up (session settled without success): drain what was posted, then close."""
        if self.phase is Phase.DONE:
            return self._close()  # complete here, failed elsewhere: nothing in flight
        if self.phase in (Phase.DRAINING, Phase.CLOSED):
            return
        if self.pull is not None and not self.pull.wait(self.r.config.drain_timeout_s):
            logger.error("request %s: the copy out of %s's pools did not end within %.1f s", self.request_id,
                         self.ctx, self.r.config.drain_timeout_s)
        if self.phase is Phase.REQUESTING and self.future is not None:
            self.future.cancel()
        if self.is_ctx_gone:  # nothing more can come from it, and nobody is left to tell
            return self._close(may_still_send=None)  # (a sink still absorbs a straggler)
        self.phase = Phase.DRAINING
        self.drain_end = self.r.clock.monotonic() + self.r.config.drain_timeout_s
        cancel = pb.CancelRequest(ctx_request_id=self.ticket.ctx_request_id, cp_rank=self.plan.spec.cp_rank,
                                  gen_rank=self.r.gen_rank, reason=self.error or reason)
        self.future = self.client.cancel_async(cancel)
        self.num_to_drain = -1  # unknown until the Cancel reply

    def _drain(self) -> None:
        if self.is_ctx_gone:
            return self._close(may_still_send=None)
        if self.num_to_drain < 0 and self.future.done():
            try:
                reply = self.future.result()
            except Exception as error:  # ctx gone or stuck: what it posted may still come
                logger.info("request %s: Cancel to %s failed (%s); closing", self.request_id, self.ctx,
                            rpc_error_text(error))
                return self._close(may_still_send=None)
            self.num_to_drain = reply.num_posted_messages if reply.known else 0
            if self.num_to_drain:
                self.pools = None  # it chose the tagged stream after all: drain what it posted
            try:
                if self.num_to_drain and not self.recvs:  # never saw the RequestShard reply
                    if not 1 <= reply.message_bytes <= self.plan.message_bytes:
                        raise ValueError(f"message_bytes {reply.message_bytes} out of range")
                    self._replan(reply.message_bytes)
                if self.num_to_drain and self.peer is None:
                    self.peer = self.r.plane.connect_worker(bytes(reply.ucx_worker_address))
            except Exception as error:
                logger.warning("request %s: cannot drain (%s); closing", self.request_id, error)
                return self._close(may_still_send=None)
            self.num_to_drain = min(self.num_to_drain, len(self.recvs))
            self._post(self.num_to_drain)
            self._collect()
        drained = self.num_to_drain >= 0 and all(r.is_done for r in self.recvs[: self.num_to_drain])
        if drained or self.r.clock.monotonic() >= self.drain_end:
            self._close(may_still_send=max(self.num_to_drain, 0))

    def _close(self, may_still_send: int | None = 0) -> None:
        """Retract every receive still posted. Messages below `may_still_send` (None: any) may
        still come from the ctx: a sink absorbs each of them (see `retract`)."""
        limit = len(self.recvs) if may_still_send is None else may_still_send
        for index in self._pending:
            recv = self.recvs[index]
            if recv.handle.test().is_terminal:
                continue
            self.r.retractor.retract(None, wire_tag(self.tag_base, index), self.plan.messages[index].nbytes,
                                     may_still_arrive=index < limit)
        self.phase = Phase.CLOSED
        self._collect()

    @property
    def is_ctx_gone(self) -> bool:
        """The connection to the ctx worker closed since this stream began (see `control`)."""
        return self.client.is_lost_since(self.num_losses)

    # -- Stream protocol (task handles) -------------------------------------------------------
    def kind_state(self, kind: PayloadKind) -> TransferState:
        self.advance()
        if self.error is not None:
            return TransferState.FAILED
        if self.phase is Phase.DONE and self.pull is not None:
            return TransferState.COMPLETED
        if self.phase in (Phase.RECEIVING, Phase.DONE) and self.recvs and all(
                self.recvs[i].is_done for i in self._kind_indices[kind]):
            return TransferState.COMPLETED  # (the last one to land closes the stream first)
        return TransferState.TRANSFERRING

    def is_quiesced(self) -> bool:
        if self.phase is Phase.CLOSED:
            self._collect()  # releases the staging of retracted receives as they end
        done = self.phase in (Phase.DONE, Phase.CLOSED) and (self.pull is None or self.pull.is_done())
        return done and not self._pending and all(r.handle is None or r.handle.is_quiesced() for r in self.recvs)

    def fail_unsent(self, error: str) -> None:
        """Fail where nothing was or will be sent (never requested, or refused): closed at once,
        its posted receives retracted (no sink: no message can come)."""
        self._fail(error)
        self._close(may_still_send=0)
