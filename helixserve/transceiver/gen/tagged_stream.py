"""The tagged stream: a shard received as the ctx's UCX tagged messages.

Every receive is posted, on the worker, right after RequestShard went out: in place when the
message's bytes are one run of the pools, else into a staging buffer scattered on arrival. The
receiver's plan is the stream's cut, since the ctx cuts with exactly the receiver's
``max_message_bytes``, so the ctx's first send finds its receive waiting and the request costs
one control round trip, overlapped with the data. The ctx's reply is then checked against the
posted plan; the shard landed once every message did (its AUX checked against the ticket).

Giving up (the inbound's Cancel): the messages the ctx says it already posted are still received
(`drain`), because an unmatched rendezvous send would pin the ctx's cache; then every receive
still posted is retracted (`close`, see `retract`; the endpoint to the ctx worker is shared by
all requests and stays open). A stream the inbound switches to only to drain (a pull whose ctx
posted messages after all) posts nothing more than those.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

from helixserve.protocol import transfer_pb2 as pb
from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.layout import ShardPlan, wire_pack_bytes, wire_tag
from helixserve.transceiver.payloads import check_payloads, payload_descriptors
from helixserve.transceiver.plane import TransferHandle
from helixserve.transceiver.gen.transport import Progress, ShardOwner


@dataclass(slots=True)
class _Recv:
    handle: TransferHandle | None = None
    staging: object | None = None  # (buffer, reservation) when staged
    is_done: bool = False


def reply_cut(reply: pb.ShardReply | pb.CancelReply) -> tuple[int, int]:
    """The ``(message_bytes, pack_bytes)`` a ctx's reply says it cut with (pack 0: the 1 MiB default)."""
    return reply.message_bytes, wire_pack_bytes(reply.pack_bytes)


class TaggedStream:
    """The receives of one shard's tagged messages (see the module docstring).

    `cut`: ``(message_bytes, pack_bytes)`` of the ctx's messages (None: not known yet: `start`
    asks for the inbound's own, a drain learns it from the Cancel reply). `is_live`: it receives the shard
    (False: it only drains what was posted)."""

    name: ClassVar[str] = "tagged stream"
    pulls: ClassVar[bool] = False
    has_asked: ClassVar[bool] = True
    copy = None  # (nothing is copied out of the ctx's pools)
    moves_draft: ClassVar[bool] = True  # every segment of the shard is a message

    def __init__(self, inbound: ShardOwner, cut: tuple[int, int] | None, *, is_live: bool = True) -> None:
        self.inbound = inbound
        self.plan: ShardPlan = inbound.plan
        self.recvs: list[_Recv] = []
        self.pending: deque[int] = deque()  # posted, not landed yet, in post order
        self._kind_indices: dict[PayloadKind, list[int]] = {}
        self.future: Future | None = None  # RequestShard
        self.peer: Hashable | None = None  # the plane's shared endpoint to the ctx worker, once known
        self.is_answered = False  # the ctx's reply checked against the posted plan
        self.is_live = is_live
        if cut is not None:
            self._replan(cut)

    def _replan(self, cut: tuple[int, int]) -> None:
        if cut != self.plan.cut:
            inbound = self.inbound
            self.plan = ShardPlan.for_receiver(self.plan.spec, inbound.caches, inbound.handle.block_ids,
                                               inbound.handle.slot, *cut, draft_blocks=inbound.draft_blocks)
        self.recvs = [_Recv() for _ in self.plan.messages]
        self.pending = deque()
        self._kind_indices = {k: [m.index for m in self.plan.kind_messages(k)] for k in self.plan.kinds}

    # -- receiving ----------------------------------------------------------------------------
    def start(self, deadline_s: float) -> bool:
        self.future = self.inbound.ask(deadline_s)
        self._replan(self.inbound.plan.cut)  # the cut asked for
        self.post(len(self.recvs))  # while the request travels (maps our memory on the way)
        return True

    def advance(self) -> Progress | None:
        if self.future is not None and not self.is_answered and self.future.done():
            self._on_reply()
        if self.is_live:
            self.post(len(self.recvs))
        self.collect()
        if self.is_live and self.is_answered and self.inbound.error is None and all(r.is_done for r in self.recvs):
            return Progress.LANDED
        return None

    def _on_reply(self) -> None:
        inbound = self.inbound
        reply = inbound.answer(self.future)
        if reply is None:
            return
        if reply.HasField("pull"):
            inbound.fail(f"{inbound.ctx}'s pull shard is unusable: ValueError: it answered with a pull this "
                         "rank did not ask for")
            return inbound.stop("unusable pull shard")  # it accepted: it keeps the blocks until told
        self.take_reply(reply)

    def take_reply(self, reply: pb.ShardReply) -> None:
        """Check the ctx's accepted reply against the posted plan (an untrusted plan is refused)."""
        inbound = self.inbound
        try:
            if reply_cut(reply) != self.plan.cut:  # our receives are posted with our cut
                raise ValueError(f"cut (message_bytes, pack_bytes) {reply_cut(reply)} != the {self.plan.cut} asked for")
            check_payloads(payload_descriptors(self.plan.messages, self.plan.kinds), reply.payloads)
            self.peer = inbound.r.plane.connect_worker(bytes(reply.ucx_worker_address))
        except Exception as error:
            inbound.fail(f"{inbound.ctx}'s transfer plan is unusable: {type(error).__name__}: {error}")
            return inbound.stop("unusable plan")  # it accepted: it may be sending already
        self.is_answered = True

    def post(self, limit: int) -> None:
        """Post the receives of the first `limit` messages not posted yet."""
        inbound = self.inbound
        for index in range(min(limit, len(self.recvs))):
            recv = self.recvs[index]
            if recv.handle is not None:
                continue
            message = self.plan.messages[index]
            try:
                buffer = self.plan.in_place(message)
                if buffer is None:
                    recv.staging = inbound.r.staging.try_acquire(inbound.request_id, message.nbytes,
                                                                 self.plan.device(message))
                    if recv.staging is None:
                        return  # staging full: post the rest on a later poll
                    buffer = recv.staging[0]
                recv.handle = inbound.r.plane.recv_message(None, wire_tag(inbound.tag_base, index), buffer)
            except Exception as error:
                if recv.staging is not None:
                    inbound.r.staging.release(recv.staging[1], recv.staging[0])
                    recv.staging = None
                return inbound.fail(f"posting the receive of message {index} failed: {type(error).__name__}: {error}")
            self.pending.append(index)

    def collect(self) -> None:
        """Land completed receives, testing from the oldest posted one and stopping at the first
        still in flight: messages complete in stream order, so a poll costs O(1), not O(stream)."""
        inbound = self.inbound
        while self.pending:
            index = self.pending[0]
            recv = self.recvs[index]
            state = recv.handle.test()
            if state is TransferState.TRANSFERRING:
                return
            self.pending.popleft()
            recv.is_done = True
            if state is TransferState.COMPLETED and self.is_live:
                if recv.staging is not None:
                    self.plan.scatter(recv.staging[0], self.plan.messages[index])
                if self.plan.messages[index].kind is PayloadKind.AUX:
                    inbound.check_aux(self.plan.aux)
            elif state is not TransferState.COMPLETED and inbound.error is None and self.is_live:
                inbound.fail(f"receiving message {index} from {inbound.ctx} failed: {recv.handle.error}")
            if recv.staging is not None:
                inbound.r.staging.release(recv.staging[1], recv.staging[0])
                recv.staging = None

    def awaits_ctx(self) -> bool:
        return True  # its answer, then its messages

    # -- giving up ----------------------------------------------------------------------------
    def stop(self) -> None:
        if self.future is not None and not self.is_answered:
            self.future.cancel()
        self.is_live = False

    def expect(self, num_posted: int, reply: pb.CancelReply) -> int:
        """The Cancel `reply` says the ctx posted its first `num_posted` messages: plan their
        receives if none were (the ctx's cut) and reach its worker; how many will be drained.
        ValueError when the reply's cut cannot be received."""
        if not self.recvs:  # never asked: the ctx cut with its own message size
            if not 1 <= reply.message_bytes <= self.plan.message_bytes:
                raise ValueError(f"message_bytes {reply.message_bytes} out of range")
            self._replan(reply_cut(reply))
        if self.peer is None:
            self.peer = self.inbound.r.plane.connect_worker(bytes(reply.ucx_worker_address))
        return min(num_posted, len(self.recvs))

    def drain(self, limit: int) -> bool:
        self.post(limit)
        self.collect()
        return limit >= 0 and all(r.is_done for r in self.recvs[:limit])

    def close(self, may_still_send: int | None) -> None:
        inbound = self.inbound
        limit = len(self.recvs) if may_still_send is None else may_still_send
        for index in self.pending:
            recv = self.recvs[index]
            if recv.handle.test().is_terminal:
                continue
            inbound.r.retractor.retract(None, wire_tag(inbound.tag_base, index), self.plan.messages[index].nbytes,
                                        may_still_arrive=index < limit)
        self.is_live = False
        self.collect()

    # -- state ----------------------------------------------------------------------------------
    def kind_state(self, kind: PayloadKind) -> TransferState:
        if self.is_answered and self.recvs and all(self.recvs[i].is_done for i in self._kind_indices[kind]):
            return TransferState.COMPLETED  # (the last one to land closes the stream first)
        return TransferState.TRANSFERRING

    def is_quiesced(self) -> bool:
        self.collect()  # releases the staging of retracted receives as they end
        return not self.pending and all(r.handle is None or r.handle.is_quiesced() for r in self.recvs)
