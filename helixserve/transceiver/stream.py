"""Pieces shared by the sender and receiver streams: per-kind task handles and staging buffers.

A shard transfer (one request, one receiver) is one ordered stream of UCX messages (see
`layout`). A session still has one task per payload kind; each task's handle is a `KindHandle`
that asks the stream object (`outbound.Outbound` or `inbound.Inbound`) for that kind's state, so
the session rules of `base` (deadline, first failure wins, quiescence) apply unchanged.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from helixserve.config_transceiver import TransceiverConfig
from helixserve.transceiver.base import PayloadKind, TransferState
from helixserve.transceiver.plane import TransferHandle
from helixserve.transceiver.bounce import BouncePool, Reservation, bounce_pool_bytes


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
    later, never overwrite); without one (bouncing off) buffers are plain tensors, a few of which
    are kept for reuse (a fresh one would page-fault on every gather). A message of device memory
    is staged on its own device (the pool is host memory): a cache on a GPU never bounces through
    the host.
    """

    MAX_SPARE = 8

    def __init__(self, pool: BouncePool | None) -> None:
        self.pool = pool
        self._spare: dict[torch.device, list[torch.Tensor]] = {}

    def try_acquire(self, owner: str, nbytes: int,
                    device: torch.device | None = None) -> tuple[torch.Tensor, Reservation | None] | None:
        device = torch.device("cpu") if device is None else device
        if self.pool is None or device.type != "cpu":
            spare = self._spare.setdefault(device, [])
            for i, buffer in enumerate(spare):
                if buffer.numel() >= nbytes:
                    return spare.pop(i)[:nbytes], None
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        if nbytes > self.pool.capacity_bytes:
            raise ValueError(f"request {owner}: a {nbytes}-byte message exceeds the "
                             f"{self.pool.capacity_bytes}-byte bounce pool; lower message_bytes")
        reservation = self.pool.try_reserve(owner, nbytes)
        if reservation is None:
            return None
        return self.pool.view(reservation)[:nbytes], reservation

    def release(self, reservation: Reservation | None, buffer: torch.Tensor | None = None) -> None:
        """Give a buffer back (`reservation` from the pool; `buffer`, optionally, otherwise)."""
        if reservation is not None and self.pool is not None:
            self.pool.release(reservation)
        elif buffer is not None and reservation is None:
            spare = self._spare.setdefault(buffer.device, [])
            if len(spare) < self.MAX_SPARE:
                spare.append(buffer if buffer._base is None else buffer._base)

    def quarantine(self, reservation: Reservation | None, reason: str) -> None:
        if reservation is not None and self.pool is not None:
            self.pool.quarantine(reservation, reason)


def staging_for(config: TransceiverConfig) -> Staging:
    """Staging per the config: a bounce pool (sized in chunks, at most half the free memory) or
    fresh buffers when bouncing is off."""
    try:
        free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free_bytes = 1 << 34
    capacity = bounce_pool_bytes(config.bounce_size_bytes, config.chunk_bytes, free_bytes)
    return Staging(BouncePool(capacity) if capacity else None)
