"""One request's shard coming into a gen rank (owned by the engine thread; see `receiver`).

The inbound owns the request's life on this rank: its deadline, the conversation with the ctx
worker (RequestShard through `ask`, Cancel, Acknowledge), its outcome (the error the CP group's
consensus reads through `kind_state`) and when nothing can write into its handle any more
(`is_quiesced`). The bytes move through one transport at a time (see `transport`): the granted
pull, the asked pull or the tagged stream, picked at `request` (a usable grant, else pools this
rank has open, else the tagged stream); `switch_to` hands off between them at the documented
points, logging both.

Phases: TRANSFERRING (its transport moves the bytes) -> DONE (all landed, AUX checked,
acknowledged). Giving up: DRAINING (the transport's own in-flight work ended, a launched copy
waited for within ``drain_timeout_ms``; Cancel sent; the messages the ctx says it already posted
are still received, by the tagged stream, because an unmatched rendezvous send would pin the
ctx's cache) -> CLOSED (every receive still posted is retracted, see `retract`; the endpoint to
the ctx worker is shared by all requests and stays open). A RequestShard the ctx refused goes
straight to CLOSED (its posted receives retracted): nothing was or will be sent for it, and a
Cancel would stop the hold for whichever rank holds it. A ctx whose control connection closes
while this rank waits on it (it died) fails the request at once; giving up then goes straight
to CLOSED, sinks posted: no drain.
"""

from __future__ import annotations

import enum
import logging
from concurrent.futures import Future

import torch

from helixserve.cache_layout import ModelCaches
from helixserve.kvcache.manager import CacheHandle
from helixserve.protocol import transfer_pb2 as pb
from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.control import rpc_error_text, target
from helixserve.transceiver.gen.asked_pull import AskedPull
from helixserve.transceiver.gen.granted_pull import GrantedPull
from helixserve.transceiver.gen.tagged_stream import TaggedStream
from helixserve.transceiver.gen.transport import Progress, ShardTransport
from helixserve.transceiver.layout import ShardPlan, ShardSpec, decode_aux, default_pack_bytes
from helixserve.transceiver.layout_match import asked_layout
from helixserve.transceiver.ticket import KVTicket

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    TRANSFERRING = "transferring"  # its transport moves the bytes
    DONE = "done"  # every byte landed
    DRAINING = "draining"  # gave up: waiting for the Cancel reply / the already-posted messages
    CLOSED = "closed"  # receives retracted: nothing can write once they ended


class Inbound:
    """One request's shard coming into this rank (engine thread only)."""

    def __init__(self, receiver, request_id: str, ticket: KVTicket,  # noqa: ANN001 (a KVReceiver)
                 handle: CacheHandle, caches: ModelCaches, tag_base: int, device: torch.device | None) -> None:
        self.r = receiver
        self.request_id = request_id
        self.handle = handle
        self.caches = caches
        self.ticket = ticket
        self.tag_base = tag_base
        self.ctx = f"ctx worker {target(ticket.ctx_endpoint)}"
        self.client = receiver.clients.get(ticket.ctx_endpoint)
        self.num_losses = self.client.num_losses  # its connection closing from now on: ctx gone
        takes_draft = _takes_draft(receiver, ticket, caches, handle)
        # (a ctx world's rank: the part it holds; the CP group's leader: the drafter's prompt cache)
        layout = asked_layout(receiver.layout, ticket.layout, takes_draft)
        spec = ShardSpec(layout, ticket.num_prompt_tokens, receiver.cp_rank, receiver.cp_size, layout.ctx_rank)
        message_bytes, pack_bytes = receiver.config.message_bytes, receiver.config.pack_bytes
        if pack_bytes is None:
            pack_bytes = default_pack_bytes(message_bytes, device)
        self.draft_blocks = caches.draft.block_table(request_id) if takes_draft and caches.draft is not None else []
        self.plan = ShardPlan.for_receiver(spec, caches, handle.block_ids, handle.slot, message_bytes, pack_bytes,
                                           self.draft_blocks)
        self.device = device  # the one device of `caches` (None: several or none)
        self.phase = Phase.TRANSFERRING
        self.error: str | None = None
        self.deadline_at = 0.0
        self.transport: ShardTransport = TaggedStream(self, None)  # until `request` (nothing planned or posted)
        self.retired: list[ShardTransport] = []  # handed off from, in order
        self.cancel_future: Future | None = None
        self.drain_end: float | None = None
        self.num_to_drain = 0

    # -- transferring ---------------------------------------------------------------------------
    def request(self, deadline_s: float) -> None:
        """Start moving the shard: the granted pull when the ticket's grant is usable, else ask
        (to pull when this rank has the ctx's pools open, else for the tagged stream)."""
        self.deadline_at = self.r.clock.monotonic() + deadline_s
        pools = None
        if self.device is not None:  # (CUDA devices; a ctx world's rank: that rank's pools)
            pools = self.r.pools.get(target(self.ticket.ctx_endpoint), self.client, self.device)
        if pools is not None and self.ticket.pull_grant is not None:
            granted = GrantedPull(self, pools, self.ticket.pull_grant)
            if granted.start(deadline_s):
                self.transport = granted
                return
        if pools is not None:
            self.transport = AskedPull(self, pools)
        self.transport.start(deadline_s)

    def ask(self, deadline_s: float, pull_epoch: int | None = None) -> Future:
        """Send RequestShard (`pull_epoch`: the ctx's pools this rank has open); its future,
        whose end wakes the poller. The request is on its way when this returns."""
        handle, spec = self.handle, self.plan.spec
        req = pb.ShardRequest(
            ctx_request_id=self.ticket.ctx_request_id, gen_rank=self.r.gen_rank, cp_rank=spec.cp_rank,
            cp_size=spec.cp_size, layout_json=spec.layout.model_dump_json(), ucx_worker_address=self.r.plane.address,
            tag_base=self.tag_base, num_prompt_tokens=spec.num_tokens, max_message_bytes=self.plan.message_bytes,
            pack_bytes=self.plan.pack_bytes, deadline_ms=int(deadline_s * 1e3), dst_block_ids=handle.block_ids,
            dst_slot=-1 if handle.slot is None else handle.slot)
        if pull_epoch is not None:
            req.pull_epoch = pull_epoch
        future = self.client.request_shard_async(req, timeout_s=deadline_s)
        future.add_done_callback(lambda _: self.r.poller.wakeup.set())
        return future

    def answer(self, future: Future) -> pb.ShardReply | None:
        """The ctx's accepted reply to RequestShard; None once the request failed (no answer) or
        closed (refused)."""
        try:
            reply = future.result()
        except Exception as error:
            self.fail(f"{self.ctx} did not answer RequestShard: {rpc_error_text(error)}")
            return None
        if not reply.accepted:  # final (see KVSender.request_shard): no stream exists for us, so
            # no Cancel: it would stop the hold for the rank that holds it (e.g. a duplicate's)
            self.fail_unsent(f"{self.ctx} refused the transfer: {reply.error}")
            return None
        return reply

    def advance(self) -> None:
        """Non-blocking progress of whatever phase the shard is in."""
        if self.phase is Phase.TRANSFERRING:
            if self.error is None and self.transport.awaits_ctx() and self.is_ctx_gone:
                self.fail(f"{self.ctx} went away mid-transfer (its control connection closed)")
            self._move()
        if self.phase is Phase.DRAINING:
            self._drain()

    def _move(self) -> None:
        while self.phase is Phase.TRANSFERRING:
            progress = self.transport.advance()
            if progress is None:
                return
            if progress is Progress.LANDED:
                return self._finish()
            self._hand_off(progress)

    def _hand_off(self, progress: Progress) -> None:
        transport = self.transport
        if progress is Progress.REVOKED:
            assert isinstance(transport, GrantedPull)
            asked = AskedPull(self, transport.pools)
            self.switch_to(asked, f"{self.ctx} freed the granted blocks during the copy")
            asked.start(max(self.deadline_at - self.r.clock.monotonic(), 0.0))
        elif progress is Progress.STREAMED:
            assert isinstance(transport, AskedPull) and transport.reply is not None
            stream = TaggedStream(self, self.plan.cut)
            self.switch_to(stream, f"{self.ctx} answered with the tagged stream (its pools' epoch changed)")
            stream.take_reply(transport.reply)

    def switch_to(self, transport: ShardTransport, reason: str) -> None:
        """Continue with `transport` (a hand-off, see `transport`); the one left stays in
        `retired` until the end (the inbound is quiesced once each of them is)."""
        logger.info("request %s: %s -> %s: %s", self.request_id, self.transport.name, transport.name, reason)
        self.retired.append(self.transport)
        self.transport = transport

    def check_aux(self, aux: torch.Tensor) -> None:
        """The ctx holds this request's prefill: its AUX names the ticket's prompt length and first tokens."""
        try:
            num_tokens, first = decode_aux(aux)
        except ValueError as error:
            return self.fail(f"{self.ctx}: {error}")
        if num_tokens != self.plan.spec.num_tokens or first != list(self.ticket.first_gen_tokens):
            # the cause goes to the client: it must tell nothing of what ctx holds (its true first
            # tokens belong to another request's answer); the details stay in this log
            logger.warning("%s: %s holds prompt length %d, first tokens %s; the request has %d, %s",
                           self.request_id, self.ctx, num_tokens, first, self.plan.spec.num_tokens,
                           list(self.ticket.first_gen_tokens))
            self.fail(f"{self.ctx} holds a different prefill under ctx_request_id "
                      f"{self.ticket.ctx_request_id!r} than this request describes")
        return None

    def _finish(self) -> None:
        self.phase = Phase.DONE  # every byte landed: nothing can write any more
        draft = self.caches.draft
        if draft is not None and self.plan.spec.takes_draft and self.transport.moves_draft:
            draft.received.add(self.request_id)  # (a pull out of a ctx exporting no drafter cache: none)
        self.r.send_ack(self, success=True, error="")

    def fail(self, error: str) -> None:
        self.error = self.error or error

    def fail_unsent(self, error: str) -> None:
        """Fail where nothing was or will be sent (never requested, or refused): closed at once,
        its posted receives retracted (no sink: no message can come)."""
        self.fail(error)
        self.close(may_still_send=0)

    # -- giving up ----------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """Give up (session settled without success): drain what was posted, then close."""
        if self.phase is Phase.DONE:
            return self.close()  # complete here, failed elsewhere: nothing in flight
        if self.phase in (Phase.DRAINING, Phase.CLOSED):
            return None
        self.transport.stop()
        if self.is_ctx_gone:  # nothing more can come from it, and nobody is left to tell
            return self.close(may_still_send=None)  # (a sink still absorbs a straggler)
        self.phase = Phase.DRAINING
        self.drain_end = self.r.clock.monotonic() + self.r.config.drain_timeout_s
        cancel = pb.CancelRequest(ctx_request_id=self.ticket.ctx_request_id, cp_rank=self.plan.spec.cp_rank,
                                  gen_rank=self.r.gen_rank, reason=self.error or reason)
        self.cancel_future = self.client.cancel_async(cancel)
        self.num_to_drain = -1  # unknown until the Cancel reply
        return None

    def _drain(self) -> None:
        drained = self.transport.drain(self.num_to_drain)
        if self.is_ctx_gone:
            return self.close(may_still_send=None)
        if self.num_to_drain < 0 and self.cancel_future.done():
            try:
                reply = self.cancel_future.result()
            except Exception as error:  # ctx gone or stuck: what it posted may still come
                logger.info("request %s: Cancel to %s failed (%s); closing", self.request_id, self.ctx,
                            rpc_error_text(error))
                return self.close(may_still_send=None)
            if not self._expect_posted(reply):
                return None
            drained = self.transport.drain(self.num_to_drain)
        if drained or self.r.clock.monotonic() >= self.drain_end:
            self.close(may_still_send=max(self.num_to_drain, 0))
        return None

    def _expect_posted(self, reply: pb.CancelReply) -> bool:
        """Take the Cancel reply's count of messages the ctx posted; False once closed instead."""
        num_posted = reply.num_posted_messages if reply.known else 0
        if not num_posted:
            self.num_to_drain = 0
            return True
        stream = self.transport
        if not isinstance(stream, TaggedStream):  # it chose the tagged stream after all: drain what it posted
            stream = TaggedStream(self, self.plan.cut if stream.has_asked else None, is_live=False)
            self.switch_to(stream, f"{self.ctx} posted {num_posted} message(s) before the Cancel")
        try:
            self.num_to_drain = stream.expect(num_posted, reply)
        except Exception as error:
            logger.warning("request %s: cannot drain (%s); closing", self.request_id, error)
            self.close(may_still_send=None)
            return False
        return True

    def close(self, may_still_send: int | None = 0) -> None:
        """Retract every receive still posted. Messages below `may_still_send` (None: any) may
        still come from the ctx: a sink absorbs each of them (see `retract`)."""
        self.transport.close(may_still_send)
        self.phase = Phase.CLOSED

    @property
    def is_ctx_gone(self) -> bool:
        """The connection to the ctx worker closed since this shard began (see `control`)."""
        return self.client.is_lost_since(self.num_losses)

    # -- Stream protocol (task handles) -------------------------------------------------------
    def kind_state(self, kind: PayloadKind) -> TransferState:
        self.advance()
        if self.error is not None:
            return TransferState.FAILED
        if self.phase in (Phase.TRANSFERRING, Phase.DONE):
            return self.transport.kind_state(kind)
        return TransferState.TRANSFERRING

    def is_quiesced(self) -> bool:
        if self.phase not in (Phase.DONE, Phase.CLOSED):
            return False
        return all(t.is_quiesced() for t in (*self.retired, self.transport))


def _takes_draft(receiver, ticket: KVTicket, caches: ModelCaches, handle: CacheHandle) -> bool:  # noqa: ANN001
    """Whether this rank asks for the drafter's prompt cache: it holds the drafter (the CP group's
    leader, ``caches.draft``) and the ctx built the same drafter's (``layout.draft``). A leader
    whose ctx built none, or another drafter's, rebuilds it (the drafter's zero-feature prefill),
    logged once per ctx and drafter."""
    own = receiver.layout.draft
    if own is None or caches.draft is None or handle.slot is None or ticket.layout.ctx_tp_size != 1:
        return False
    if ticket.layout.draft == own:
        return True
    seen = (target(ticket.ctx_endpoint), ticket.layout.draft)
    if seen not in receiver.draft_fallbacks:
        receiver.draft_fallbacks.add(seen)
        logger.warning("ctx worker %s sends no prompt cache of the drafter %s (its layout names %s): the drafter's "
                       "cache of its prompts is rebuilt here from the prompt tokens, its drafts may differ from an "
                       "aggregated run's", seen[0], own.model, ticket.layout.draft)
    return False
