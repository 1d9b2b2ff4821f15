"""ctx side: serves finished prefills' held caches over UCX, negotiated by the KVTransfer service.

Lifecycle of one held request (a `Hold`):

1. **Held**: `hold(request_id, handle, num_prompt_tokens, first_gen_tokens)` (engine thread, once
   the prefill finished with ``hold_cache``) registers it; its hold deadline starts now.
2. **Requested**: a gen rank's RequestShard is checked (known request, layout, prompt length, CP
   geometry, no duplicate) and accepted; the rank's shard becomes an outbound stream.
3. **Sending**: the sender thread posts each stream's messages in order, at most `send_window_bytes`
   in flight per stream, round-robin over streams (one huge request cannot monopolize the link).
   Runs that are contiguous in the cache are sent in place; others are gathered into staging
   (bounce) buffers first.
4. **Settled**: every expected gen rank (the cp ranks this ctx rank sends part of their shard:
   ``0..cp_size-1`` at ``ctx_tp_size`` 1, see :func:`~helixserve.transceiver.fan.targets`) acknowledged -> COMPLETED; a
   Cancel, a negative ack or `cancel()` -> CANCELLED; the hold deadline passed first -> TIMEOUT
   (an expired hold, counted). Streams of a settled hold post nothing more.
5. **Freed**: once no posted send can still read the cache (quiesced), `on_free(request_id)` runs
   and the request is forgotten. Until then it is *quarantined*: a UCX rendezvous send whose
   receiver died is never matched and cannot be cancelled, so those blocks are never reused.

Granted pulls (`grant`, `lease`): when the pools are exported, `hold` grants a pull and returns the
`PullGrant` that the ctx's answer carries: a gen rank on this host that opened our pools copies
the blocks at once, without RequestShard, and acknowledges (with its cp_size) once its copy
ended; the grant's lease word is zeroed before the blocks are freed, whatever frees them, so a
copy that overlapped a free is detected by the gen rank and thrown away.

Pulled shards (`cuda_ipc`): a gen rank on this host that opened our pools (DescribePools) asks
with their epoch; its shard is then a `PulledShard`: nothing is sent, the reply carries the block
table, slot and AUX words, and the blocks stay held until that rank acknowledged or cancelled
(it copies first), or its stated deadline plus the drain time passed.

Threads: every hold and stream is guarded by one state lock. The sender thread takes it for
each pass (post what the windows allow, settle what the poller reports) and waits outside it. A
gRPC handler or the engine thread runs its command on its own thread holding the lock, waiting for
it at most ``rpc_timeout_ms``: a handler that cannot have it answers "busy", which therefore never
has an effect. (No queue to the sender thread: that would cost two more thread hand-offs per
RequestShard.) ucxx's own thread progresses the UCX worker.

Cache safety (the engine thread runs concurrently): the sender reads the engine's cache tensors
from its own thread, in place, without a lock. That is safe because a held request's blocks and
state slot stay allocated to it, so the engine neither writes nor reallocates them, until
`on_free` runs; the sender never touches them after that. `on_free` is called on the sender
thread and must be thread-safe (e.g. ``CtxRequests.post(SenderFreed(...))``, which hands the
release to the engine thread).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from pydantic import ValidationError

from helixserve.cache_layout import ModelCaches
from helixserve.clock import MonotonicClock
from helixserve.config_transceiver import TransceiverConfig
from helixserve.kvcache.manager import CacheHandle
from helixserve.protocol import transfer_pb2 as pb
from helixserve.protocol.disagg import KVLayout, PullGrant, TransceiverEndpoint
from helixserve.transceiver import fan
from helixserve.transceiver.backends import open_data_plane
from helixserve.transceiver.base import TransferState
from helixserve.transceiver.ctx.control_server import SERVER_STOP_GRACE_S, ControlServer
from helixserve.transceiver.cuda_ipc import PoolExport
from helixserve.transceiver.ctx.grant_issue import GRANT_TASK, adopt_cp_group, grant_hold
from helixserve.transceiver.cache_check import check_caches
from helixserve.transceiver.layout import ShardPlan, wire_pack_bytes
from helixserve.transceiver.layout_match import check_layout
from helixserve.transceiver.ctx.outbound import Outbound, PulledShard
from helixserve.transceiver.payloads import payload_descriptors
from helixserve.transceiver.ctx.hold import Hold, HoldSession, SenderBusyError, SenderStats  # noqa: F401 (re-exported)
from helixserve.transceiver.plane import DataPlane
from helixserve.transceiver.polling import TransferPoller
from helixserve.transceiver.ctx.shard_request import check_shard_request
from helixserve.transceiver.stream import KindHandle, staging_for

logger = logging.getLogger(__name__)

# internal ticks of the sender thread's wait (a completion or a gRPC call wakes it earlier)
ACTIVE_TICK_S = 0.0005  # while messages are in flight or queued
IDLE_TICK_S = 0.01  # while nothing is in flight
STOP_JOIN_S = 5.0  # internal: a stopping sender waits this long for its thread (shutdown only)


class KVSender:
    """The ctx worker's transceiver: a KVTransfer gRPC service plus a UCX sender thread.

    Args:
        config: transceiver settings (message size, window, timeouts, bounce pool).
        layout: this worker's cache layout; every RequestShard must carry an equal one.
        caches: the engine's cache tensors (read in place; see the module docstring).
        on_free: called on the sender thread with a request id once its cache may be freed.
        host / port: where the control plane listens (port 0: any free port).
        advertise_host: host put in `endpoint` (default `host`).
        hold_timeout_s: default hold deadline (default: the transfer timeout).
    """

    def __init__(self, config: TransceiverConfig, layout: KVLayout, caches: ModelCaches,
                 on_free: Callable[[str], None], *, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, hold_timeout_s: float | None = None) -> None:
        check_layout(layout, layout, "ctx", "ctx")  # its rank of its ctx world can split the heads
        check_caches(layout, caches, layout.num_kda_heads // layout.ctx_tp_size)
        self.config = config
        self.layout = layout
        self.caches = caches
        self.on_free = on_free
        self.hold_timeout_s = hold_timeout_s or config.timeout_s
        self._wakeup = threading.Event()
        self.poller = TransferPoller(wakeup=self._wakeup)
        self.plane: DataPlane = open_data_plane(config, self._wakeup, host)  # config.backend picks it
        self.staging = staging_for(config)
        # a pull copies one ctx's pools holding every head: a rank of a ctx world sends its part
        self._export = PoolExport(caches, enabled=config.cuda_ipc)
        self._clock = MonotonicClock()
        self._server = ControlServer(self, host, port, config=config)
        self._advertise_host = advertise_host or host
        self._holds: dict[str, Hold] = {}
        self._lock = threading.Lock()  # guards the holds, their streams and the poller
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._is_stopping = False
        self._num_freed = 0
        self._num_granted = 0
        self._rotation = itertools.count()
        self._serials = itertools.count(1)  # lease serials of granted pulls
        self._layout_json = layout.model_dump_json()
        self.endpoint: TransceiverEndpoint | None = None

    # -- public API (any thread) -------------------------------------------------------------

    def start(self) -> TransceiverEndpoint:
        self._thread.start()
        port = self._server.start()
        self.endpoint = TransceiverEndpoint(host=self._advertise_host, port=port)
        logger.info("KV sender listening on %s:%d", self._advertise_host, port)
        return self.endpoint

    def hold(self, request_id: str, handle: CacheHandle, num_prompt_tokens: int,
             first_gen_tokens: Sequence[int], *, hold_timeout_s: float | None = None) -> PullGrant | None:
        """Offer a finished prefill for its gen worker (call on the engine thread, right after it finished
        with hold_cache). `handle` is read now: it is this ctx rank's (cp_rank ``ctx_rank`` of
        ``ctx_tp_size``: block_ids[k] holds logical block ``ctx_rank + k*ctx_tp_size``). Returns
        the pull granted for it (None: the pools are not exported), for the ctx's answer."""
        lay = self.layout
        if ((handle.cp_rank, handle.cp_size) != (lay.ctx_rank, lay.ctx_tp_size) or handle.num_tokens < num_prompt_tokens
                or num_prompt_tokens < 1):
            raise ValueError(f"request {request_id}: ctx rank {lay.ctx_rank} of {lay.ctx_tp_size} cannot hold a "
                             f"cp_rank={handle.cp_rank} cp_size={handle.cp_size} handle of {handle.num_tokens} "
                             f"tokens for {num_prompt_tokens} prompt tokens")
        hold = Hold(
            HoldSession(request_id, timeout_s=hold_timeout_s or self.hold_timeout_s),
            list(handle.block_ids), handle.slot, num_prompt_tokens, list(first_gen_tokens))
        return self._locked(self._do_hold, hold)

    def cancel(self, request_id: str, reason: str = "cancelled by the ctx worker") -> bool:
        """Stop serving a hold (client gone); its cache is freed once quiesced. False if unknown."""
        return self._locked(self._do_cancel, request_id, reason)

    def stats(self) -> SenderStats:
        return self._locked(self._do_stats)

    def stop(self, timeout_s: float = STOP_JOIN_S) -> None:
        """Stop serving: free what is quiesced, leave the rest (logged), close UCX and gRPC."""
        self._server.stop(grace_s=min(SERVER_STOP_GRACE_S, timeout_s))
        self._is_stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._export.close()  # revokes every grant: nothing granted is read after this
        self.plane.close()

    # -- gRPC handlers (gRPC threads) ---------------------------------------------------------

    def request_shard(self, request: pb.ShardRequest) -> pb.ShardReply:
        """``accepted=False`` is final: no stream exists or will exist for this request, so the
        gen rank closes without a Cancel (which would stop the hold of whoever holds it)."""
        return self._answer(self._do_request_shard, request, pb.ShardReply(accepted=False, error=(
            f"ctx sender busy: no answer within {self.config.rpc_timeout_s:.1f}s")))

    def cancel_shard(self, request: pb.CancelRequest) -> pb.CancelReply:
        return self._answer(self._do_cancel_shard, request, pb.CancelReply(known=False))

    def acknowledge(self, request: pb.AckRequest) -> pb.AckReply:
        return self._answer(self._do_acknowledge, request, pb.AckReply(known=False, error="ctx sender busy"))

    def describe_pools(self, request: pb.PoolsRequest) -> pb.PoolsReply:
        """DescribePools (gRPC thread): the pools as CUDA IPC handles, or why not (`cuda_ipc`)."""
        return self._export.describe(request)

    def _answer(self, fn, request, busy_reply):  # noqa: ANN001, ANN202
        try:
            return self._locked(fn, request)
        except SenderBusyError:
            return busy_reply  # it did not run: "busy" has no effect

    def _locked(self, fn: Callable, *args):  # noqa: ANN202
        """``fn(*args)`` on this thread holding the state lock, waited for at most
        ``rpc_timeout_ms`` (SenderBusyError: it did not run); the sender thread is woken after,
        so that a stream it opened starts at once."""
        if self._is_stopping or not self._thread.is_alive():
            raise RuntimeError("the KV sender is not running")
        if not self._lock.acquire(timeout=self.config.rpc_timeout_s):
            raise SenderBusyError(f"the KV sender's state stayed locked for {self.config.rpc_timeout_s:.1f} s")
        try:
            return fn(*args)
        finally:
            self._lock.release()
            self._wakeup.set()

    # -- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._is_stopping:
                self._wakeup.clear()  # before the pass: a command's wake-up during it is kept
                with self._lock:
                    is_busy = self._pump()
                    self._settle(self.poller.poll(wait_num=0))
                    wait_s = ACTIVE_TICK_S if is_busy else self._idle_wait()
                self._wakeup.wait(wait_s)
        except Exception:
            logger.exception("KV sender thread crashed; holds stay held until their owner frees them")
        finally:
            with self._lock:
                self._settle(self.poller.poll(wait_num=0))

    def _pump(self) -> bool:
        streams = [ob for p in self._holds.values() for ob in p.outbounds.values()]
        if streams:  # round-robin: a different stream posts first each tick
            start = next(self._rotation) % len(streams)
            streams = streams[start:] + streams[:start]
        for outbound in streams:
            outbound.advance()
            outbound.pump(self.plane)
        return any(ob.has_work for ob in streams)

    def _idle_wait(self) -> float:
        remaining = [p.session.remaining() for p in self._holds.values() if not p.session.state.is_settled]
        return max(ACTIVE_TICK_S, min([IDLE_TICK_S, *remaining]))

    def _settle(self, result) -> None:
        settled = [*result.completed, *result.failed, *result.cancelled, *result.timed_out]
        for request_id in settled:
            hold = self._holds.get(request_id)
            if hold is None:
                continue
            for outbound in hold.outbounds.values():
                outbound.stop("hold settled")
            if hold.session.is_quiesced:
                self._free(request_id, hold)
            elif not hold.is_quarantine_logged:
                hold.is_quarantine_logged = True
                logger.warning("request %s %s but a send may still read its cache: quarantined",
                               request_id, hold.session.state.value)

    def _free(self, request_id: str, hold: Hold) -> None:
        if hold.grant_serial and self._export.lease is not None:
            self._export.lease.revoke(hold.grant_serial)  # before the blocks can be reused
        self.poller.retire(request_id)
        del self._holds[request_id]
        self._num_freed += 1
        if hold.session.state is TransferState.COMPLETED and hold.grant_serial and not hold.outbounds:
            self._num_granted += 1
        if hold.session.state is not TransferState.COMPLETED:
            logger.info("ctx request %s freed: %s", request_id, hold.session.error)
        try:
            self.on_free(request_id)
        except Exception:
            logger.exception("on_free(%s) raised", request_id)

    # -- commands (any thread, holding the state lock) ----------------------------------------

    def _do_hold(self, hold: Hold) -> None:
        request_id = hold.session.request_id
        if request_id in self._holds:
            raise ValueError(f"request {request_id} is already held for its gen worker")
        hold.session.anchor_deadline()  # the hold deadline starts at hold
        self.poller.add(hold.session)
        self._holds[request_id] = hold
        if self._export.lease is None or self.layout.ctx_tp_size > 1:  # a ctx world's gen ranks ask each rank
            return None
        return grant_hold(self._export, hold, next(self._serials), self._layout_json)

    def _do_cancel(self, request_id: str, reason: str) -> bool:
        hold = self._holds.get(request_id)
        if hold is None:
            return False
        self._stop_hold(hold, reason)
        return True

    def _stop_hold(self, hold: Hold, reason: str) -> None:
        if not hold.session.state.is_settled:
            hold.session.cancel(reason)
        for outbound in hold.outbounds.values():
            outbound.stop(reason)

    def _do_stats(self) -> SenderStats:
        quarantined = sum(p.session.state.is_settled for p in self._holds.values())
        return SenderStats(len(self._holds), quarantined, self._num_freed, replace(self.poller.metrics),
                           self._num_granted)

    def _do_cancel_shard(self, request: pb.CancelRequest) -> pb.CancelReply:
        hold = self._holds.get(request.ctx_request_id)
        if hold is None:
            return pb.CancelReply(known=False)
        self._stop_hold(hold, f"gen rank {request.gen_rank} (cp_rank {request.cp_rank}) "
                                  f"cancelled: {request.reason}")
        outbound = hold.outbounds.get(request.cp_rank)
        if isinstance(outbound, PulledShard):
            outbound.release()  # the receiver cancels only once its copy ended (it posted nothing)
        if outbound is None:
            return pb.CancelReply(known=True, num_posted_messages=0)
        return pb.CancelReply(known=True, num_posted_messages=outbound.num_posted,
                              message_bytes=outbound.plan.message_bytes, pack_bytes=outbound.plan.pack_bytes,
                              ucx_worker_address=self.plane.address)

    def _do_acknowledge(self, request: pb.AckRequest) -> pb.AckReply:
        hold = self._holds.get(request.ctx_request_id)
        if hold is None:
            return pb.AckReply(known=False, error=f"ctx request {request.ctx_request_id} is not held here")
        pulled = hold.outbounds.get(request.cp_rank)
        if isinstance(pulled, PulledShard):
            pulled.release()  # the receiver acknowledges only once its copy ended
        if not request.success:
            self._stop_hold(hold, f"gen rank {request.gen_rank} (cp_rank {request.cp_rank}) gave up: "
                                      f"{request.error}")
            return pb.AckReply(known=True)
        if hold.cp_size is None and hold.grant_serial:  # a granted pull: no RequestShard came first
            error = adopt_cp_group(hold, request.cp_rank, request.cp_size, self.layout)
            if error:
                return pb.AckReply(known=True, error=error)
        try:
            hold.session.acknowledge(request.cp_rank)
        except ValueError as error:
            return pb.AckReply(known=True, error=str(error))
        return pb.AckReply(known=True)

    def _do_request_shard(self, request: pb.ShardRequest) -> pb.ShardReply:
        who = f"gen rank {request.gen_rank} (cp_rank {request.cp_rank} of {request.cp_size})"
        hold = self._holds.get(request.ctx_request_id)
        try:
            if hold is None:
                raise ValueError(f"ctx request {request.ctx_request_id} is not held here (never held, "
                                 "already picked up and freed, cancelled, or expired)")
            spec = check_shard_request(hold, request, who, self.layout, self.config.message_bytes)
            # the receiver's cut: its receives are posted with it (one it cannot use is refused here)
            plan = ShardPlan.for_sender(spec, self.caches, hold.block_ids, hold.slot, hold.first_tokens,
                                        request.max_message_bytes, wire_pack_bytes(request.pack_bytes))
        except (ValueError, ValidationError) as error:
            logger.warning("refused %s's hold of %s: %s", who, request.ctx_request_id, error)
            return pb.ShardReply(accepted=False, error=str(error))
        if self._export.names(request.pull_epoch):
            release_at = self._clock.monotonic() + request.deadline_ms / 1e3 + self.config.drain_timeout_s
            return self._accept(hold, request, plan, PulledShard(plan, release_at, self._clock), pull=pb.PullShard(
                src_block_ids=hold.block_ids, src_slot=-1 if hold.slot is None else hold.slot,
                aux=plan.aux.tolist()))
        # One long-lived endpoint per gen worker, shared by its requests (tags tell them apart):
        # per-request endpoints between the same two workers get paired arbitrarily by UCX, and
        # closing one cancelled another request's transfer.
        try:
            peer = self.plane.connect_worker(bytes(request.ucx_worker_address))
        except Exception as error:
            return pb.ShardReply(accepted=False, error=f"cannot reach {who}'s UCX worker: "
                                                       f"{type(error).__name__}: {error}")
        outbound = Outbound(request.ctx_request_id, request.cp_rank, plan, peer, request.tag_base, who,
                            self.staging, self.config.send_window_bytes)
        return self._accept(hold, request, plan, outbound)

    def _accept(self, hold: Hold, request: pb.ShardRequest, plan: ShardPlan, outbound: Outbound | PulledShard,
                pull: pb.PullShard | None = None) -> pb.ShardReply:
        session = hold.session
        if hold.grant_serial:  # this rank asked after all: its tasks count its bytes
            session.tasks[GRANT_TASK].nbytes = 0
        hold.cp_size = request.cp_size
        session.expected_acks = set(fan.targets(self.layout.num_blocks(hold.num_prompt_tokens), self.layout.num_kda_heads,
                                                self.layout.ctx_rank, self.layout.ctx_tp_size, request.cp_size))
        for kind in plan.kinds:
            session.add_task(request.cp_rank, kind, sum(m.nbytes for m in plan.kind_messages(kind)))
            session.attach(request.cp_rank, kind, KindHandle(outbound, kind))
        hold.outbounds[request.cp_rank] = outbound
        return pb.ShardReply(accepted=True, ucx_worker_address=self.plane.address, message_bytes=plan.message_bytes,
                             pack_bytes=plan.pack_bytes, payloads=payload_descriptors(plan.messages, plan.kinds), pull=pull)

