"""One receiver's shard stream of one request, on the ctx side (owned by the sender thread).

Messages are posted in stream order, at most `window_bytes` in flight (always at least one
message); a message whose bytes are one
contiguous run of the cache is sent in place, others are gathered into a staging (bounce)
buffer first, released when its send completes. `stop()` posts nothing more; the stream is
quiesced once every posted send has completed (a rendezvous send the receiver never matches
never completes: its cache then stays quarantined, see `sender`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.layout import ShardPlan, wire_tag
from helixserve.transceiver.plane import DataPlane, TransferHandle
from helixserve.transceiver.stream import Staging


@dataclass(slots=True)
class _Sent:
    handle: TransferHandle | None = None
    staging: tuple | None = None  # (buffer, reservation) of a gathered message
    is_done: bool = False


class Outbound:
    """One receiver's shard stream of one request (touched by the sender thread only)."""

    def __init__(self, request_id: str, cp_rank: int, plan: ShardPlan, peer: Hashable, tag_base: int, who: str,
                 staging: Staging, window_bytes: int) -> None:
        self.request_id = request_id
        self.cp_rank = cp_rank
        self.plan = plan
        self.peer = peer
        self.tag_base = tag_base
        self.who = who
        self.staging = staging
        self.window_bytes = window_bytes
        self.inflight_bytes = 0
        self.sent = [_Sent() for _ in plan.messages]
        self.inflight: list[int] = []
        self.num_posted = 0
        self.error: str | None = None
        self.is_stopped = False
        self._kind_indices = {k: [m.index for m in plan.kind_messages(k)] for k in plan.kinds}

    @property
    def has_work(self) -> bool:
        pending = not self.is_stopped and self.error is None and self.num_posted < len(self.sent)
        return pending or bool(self.inflight)

    def pump(self, plane: DataPlane) -> None:
        while not self.is_stopped and self.error is None and self.num_posted < len(self.sent):
            nbytes = self.plan.messages[self.num_posted].nbytes
            if self.inflight and self.inflight_bytes + nbytes > self.window_bytes:
                return
            if not self._post(plane, self.num_posted):
                return
            self.inflight.append(self.num_posted)
            self.inflight_bytes += nbytes
            self.num_posted += 1

    def _post(self, plane: DataPlane, index: int) -> bool:
        message = self.plan.messages[index]
        sent = self.sent[index]
        try:
            buffer = self.plan.in_place(message)
            if buffer is None:
                staged = self.staging.try_acquire(self.request_id, message.nbytes, self.plan.device(message))
                if staged is None:
                    return False  # bounce pool full: retry on a later tick
                sent.staging = staged
                buffer = staged[0]
                self.plan.gather(message, buffer)
                if buffer.is_cuda:  # the send must not start before the gather kernel ran
                    torch.cuda.current_stream(buffer.device).synchronize()
            sent.handle = plane.send_message(self.peer, wire_tag(self.tag_base, index), buffer)
        except Exception as error:
            self._unstage(sent)
            self.error = f"posting message {index} to {self.who} failed: {type(error).__name__}: {error}"
            return False
        return True

    def advance(self) -> None:
        still = []
        for index in self.inflight:
            sent = self.sent[index]
            state = sent.handle.test()
            if state is TransferState.TRANSFERRING:
                still.append(index)
                continue
            self._unstage(sent)
            self.inflight_bytes -= self.plan.messages[index].nbytes
            if state is TransferState.COMPLETED:
                sent.is_done = True
            elif self.error is None:
                self.error = f"sending message {index} to {self.who} failed: {sent.handle.error}"
        self.inflight = still

    def _unstage(self, sent: _Sent) -> None:
        if sent.staging is not None:
            self.staging.release(sent.staging[1], sent.staging[0])
            sent.staging = None

    def kind_state(self, kind: PayloadKind) -> TransferState:
        if self.error is not None:
            return TransferState.FAILED
        if all(self.sent[i].is_done for i in self._kind_indices[kind]):
            return TransferState.COMPLETED
        return TransferState.TRANSFERRING

    def is_quiesced(self) -> bool:
        return all(self.sent[i].handle.is_quiesced() for i in self.inflight)

    def stop(self, reason: str) -> None:
        self.is_stopped = True


class PulledShard:
    """One receiver's shard that it copies out of our pools itself (`pull`): nothing is sent.

    The cache must stay held while the receiver may still read it: until that receiver
    acknowledged or cancelled (it does either only after its copy ended), or, if it never does,
    until `release_at` (its own deadline, as its RequestShard stated it, plus the drain time).
    The session's acknowledgements decide success, as for a tagged stream.
    """

    has_work = False
    num_posted = 0
    error: str | None = None

    def __init__(self, plan: ShardPlan, release_at: float, clock) -> None:  # noqa: ANN001 (a Clock)
        self.plan = plan
        self.release_at = release_at
        self.clock = clock
        self.is_released = False
        self.is_stopped = False

    def pump(self, plane: DataPlane) -> None:
        pass

    def advance(self) -> None:
        pass

    def release(self) -> None:
        """The receiver said it no longer reads (its Ack or Cancel)."""
        self.is_released = True

    def kind_state(self, kind: PayloadKind) -> TransferState:
        return TransferState.COMPLETED  # nothing to send; the acknowledgement completes the session

    def is_quiesced(self) -> bool:
        return self.is_released or self.clock.monotonic() >= self.release_at

    def stop(self, reason: str) -> None:
        self.is_stopped = True
