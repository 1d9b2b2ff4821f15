"""Ending a gen rank's posted receives without closing the shared endpoint (`DataPlane.retract`;
see `ucxx_backend` for why UCX needs it).

A receive into a request's blocks must end before those blocks are freed. When the request gives
up, each of its still-posted receives is *retracted*: a 0-byte self-message with its tag
completes it without writing. If the ctx may still send that message (it said it posted it, or
it could not be asked), a *sink* receive of the same tag into scratch memory is posted first, so
the late message lands there: the ctx's send completes (an unmatched rendezvous send would pin
the ctx's cache for good) and the message never lingers unexpected. UCX matches receives in
posting order, so the retraction ends the request's receive, not the sink.

A sink lives at most `sink_lifetime_s`; then it is retracted too (its scratch is dropped once the
retraction completed). Every wait here is bounded; nothing blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from helixserve.clock import Clock
from helixserve.transceiver.plane import DataPlane, TransferHandle

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sink:
    handle: TransferHandle
    scratch: torch.Tensor
    wire_tag: int
    expires_at: float
    retraction: TransferHandle | None = None


class Retractor:
    """Retracts receives and keeps the sinks of one receiver's data plane (engine thread only)."""

    def __init__(self, plane: DataPlane, clock: Clock, sink_lifetime_s: float) -> None:
        self.plane = plane
        self.clock = clock
        self.sink_lifetime_s = sink_lifetime_s
        self.sinks: list[_Sink] = []

    def retract(self, peer: Hashable | None, wire_tag: int, nbytes: int, may_still_arrive: bool) -> TransferHandle:
        """End the posted receive of `wire_tag`; with `may_still_arrive`, absorb a late message."""
        if may_still_arrive:  # (peer None: the sink is posted on the worker, see DataPlane.recv_message)
            scratch = torch.empty(nbytes, dtype=torch.uint8)
            handle = self.plane.recv_message(peer, wire_tag, scratch)
            self.sinks.append(_Sink(handle, scratch, wire_tag, self.clock.monotonic() + self.sink_lifetime_s))
        return self.plane.retract(wire_tag)

    def prune(self) -> None:
        """Drop sinks that got their message; retract the ones past their lifetime."""
        now, kept = self.clock.monotonic(), []
        for sink in self.sinks:
            if sink.handle.test().is_terminal:
                continue
            if sink.retraction is None and now >= sink.expires_at:
                logger.info("sink for tag %#x expired without its message; retracting it", sink.wire_tag)
                sink.retraction = self.plane.retract(sink.wire_tag)
            kept.append(sink)
        self.sinks = kept
