"""Pieces shared by the sender and receiver streams: per-kind task handles and staging buffers.

A shard transfer (one request, one receiver) is one ordered stream of UCX messages (see
`layout`). A session still has one task per payload kind; each task's handle is a `KindHandle`
that asks the stream object (`sender._Outbound` or `receiver._Inbound`) for that kind's state, so
the session rules of `base` (deadline, first failure wins, quiescence) apply unchanged.
"""

from __future__ import annotations

from typing import Protocol

import torch

from helixserve.transceiver.base import PayloadKind, TransferHandle, TransferState
from helixserve.transceiver.bounce import BouncePool, Reservation


class Stream(Protocol):
    error: str | None

    def kind_state(self, kind: PayloadKind) -> TransferState: ...
    def is_quiesced(self) -> bool: ...
    def stop(self, reason: str) -> None: ...


class KindHandle(TransferHandle):
    """The handle of one payload kind's task: a view on its stream."""

    def __init__(self, stream: Stream, kind: PayloadKind) -> None:
        self.stream = stream
        self.kind = kind

    @property
    def error(self) -> str | None:  # type: ignore[override]
        return self.stream.error

    def test(self) -> TransferState:
        return self.stream.kind_state(self.kind)

    def is_quiesced(self) -> bool:
        return self.stream.is_quiesced()

    def cancel(self) -> None:
        self.stream.stop("the transfer session ended")


class Staging:
    """Staging buffers for gathered (sender) or scattered (receiver) messages.

    With a `BouncePool` buffers are first-fit regions of it (a full pool makes the caller retry
    later, never overwrite); without one (bouncing off) each buffer is a fresh tensor.
    """

    def __init__(self, pool: BouncePool | None) -> None:
        self.pool = pool

    def try_acquire(self, owner: str, nbytes: int) -> tuple[torch.Tensor, Reservation | None] | None:
        if self.pool is None:
            return torch.empty(nbytes, dtype=torch.uint8), None
        if nbytes > self.pool.capacity_bytes:
            raise ValueError(f"request {owner}: a {nbytes}-byte message exceeds the "
                             f"{self.pool.capacity_bytes}-byte bounce pool; lower message_bytes")
        reservation = self.pool.try_reserve(owner, nbytes)
        if reservation is None:
            return None
        return self.pool.view(reservation)[:nbytes], reservation

    def release(self, reservation: Reservation | None) -> None:
        if reservation is not None and self.pool is not None:
            self.pool.release(reservation)

    def quarantine(self, reservation: Reservation | None, reason: str) -> None:
        if reservation is not None and self.pool is not None:
            self.pool.quarantine(reservation, reason)
