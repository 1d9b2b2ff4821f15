"""In-process fake data plane, only for fault injection and clock-driven tests of the logic.

Several `FakeDataPlane`s (one per simulated rank) share one `FakeFabric`; a send and a receive
with the same (source, destination, tag) match and, once their latency has passed on the
injected clock, the bytes are copied. Faults are injected per (source, destination, tag) or
plane-wide: a handle that never completes, fails, or never quiesces even after cancel (a peer
that may still be writing).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from helixserve.transceiver.base import DataPlane, TransferHandle, TransferState
from helixserve.transceiver.clock import Clock, MonotonicClock


class FakeFault(enum.Enum):
    NONE = "none"  # completes `latency_s` after both sides are posted
    NEVER_COMPLETE = "never_complete"  # stays TRANSFERRING forever (quiesces on cancel)
    FAIL = "fail"  # fails `latency_s` after posting
    STUCK = "stuck"  # never completes and never quiesces, even after cancel


class FakeHandle(TransferHandle):
    """A scripted operation. Tests may also drive it directly with `complete()` / `fail()`."""

    def __init__(
        self,
        clock: Clock,
        fault: FakeFault = FakeFault.NONE,
        latency_s: float = 0.0,
        error: str = "injected failure",
        ready: bool = True,
    ) -> None:
        self.clock = clock
        self.fault = fault
        self.posted_at = clock.monotonic()
        self.latency_s = latency_s
        self.ready = ready  # False until the matching peer operation is posted
        self._error = error
        self._forced: TransferState | None = None
        self.is_cancel_requested = False
        self.on_complete: list = []

    def complete(self) -> None:
        self._forced = TransferState.COMPLETED

    def fail(self, error: str | None = None) -> None:
        self._forced = TransferState.FAILED
        self._error = error or self._error

    def test(self) -> TransferState:
        if self._forced is not None:
            return self._forced_state()
        if self.is_cancel_requested:
            return TransferState.CANCELLED
        due = self.clock.monotonic() >= self.posted_at + self.latency_s
        if self.fault is FakeFault.FAIL and due:
            return self._set(TransferState.FAILED)
        if self.fault is FakeFault.NONE and due and self.ready:
            return self._set(TransferState.COMPLETED)
        return TransferState.TRANSFERRING

    def is_quiesced(self) -> bool:
        if self.fault is FakeFault.STUCK:
            return False
        state = self._forced or self.test()
        return state.is_terminal

    def cancel(self) -> None:
        self.is_cancel_requested = True

    @property
    def error(self) -> str | None:  # type: ignore[override]
        return self._error if self._forced is TransferState.FAILED else None

    def _set(self, state: TransferState) -> TransferState:
        self._forced = state
        return self._forced_state()

    def _forced_state(self) -> TransferState:
        assert self._forced is not None
        if self._forced is TransferState.COMPLETED:
            while self.on_complete:
                self.on_complete.pop()()
        return self._forced


@dataclass
class _Posted:
    handle: FakeHandle
    buffer: memoryview


class FakeFabric:
    """Shared matching table and fault script for a set of fake ranks."""

    def __init__(self, clock: Clock | None = None, latency_s: float = 0.0) -> None:
        self.clock: Clock = clock or MonotonicClock()
        self.latency_s = latency_s
        self.wakeup = threading.Event()
        self._faults: dict[tuple[int | None, int | None, int | None], FakeFault] = {}
        self._sends: dict[tuple[int, int, int], _Posted] = {}
        self._recvs: dict[tuple[int, int, int], _Posted] = {}

    def inject(
        self, fault: FakeFault, src: int | None = None, dst: int | None = None, tag: int | None = None
    ) -> None:
        """Script `fault` for operations matching (src, dst, tag); None matches anything."""
        self._faults[(src, dst, tag)] = fault

    def fault_for(self, src: int, dst: int, tag: int) -> FakeFault:
        for key in ((src, dst, tag), (src, dst, None), (src, None, None), (None, dst, None),
                    (None, None, tag), (None, None, None)):
            if key in self._faults:
                return self._faults[key]
        return FakeFault.NONE

    def plane(self, rank: int) -> FakeDataPlane:
        return FakeDataPlane(rank, self)

    def _post(self, src: int, dst: int, tag: int, buffer: memoryview, is_send: bool) -> FakeHandle:
        key = (src, dst, tag)
        mine, theirs = (self._sends, self._recvs) if is_send else (self._recvs, self._sends)
        if key in mine:
            raise ValueError(f"fake fabric: operation {key} already posted")
        handle = FakeHandle(self.clock, self.fault_for(src, dst, tag), self.latency_s, ready=False,
                            error=f"injected failure on src={src} dst={dst} tag={tag}")
        mine[key] = _Posted(handle, buffer)
        peer = theirs.get(key)
        if peer is not None:
            send, recv = (mine[key], peer) if is_send else (peer, mine[key])
            if send.buffer.nbytes != recv.buffer.nbytes:
                msg = f"size mismatch {send.buffer.nbytes} != {recv.buffer.nbytes} for {key}"
                send.handle.fail(msg)
                recv.handle.fail(msg)
            send.handle.ready = recv.handle.ready = True
            recv.handle.on_complete.append(lambda: recv.buffer.cast("B").__setitem__(
                slice(None), send.buffer.cast("B")))
        self.wakeup.set()
        return handle


class FakeDataPlane(DataPlane):
    """One simulated rank's view of a `FakeFabric`."""

    def __init__(self, rank: int, fabric: FakeFabric) -> None:
        self.rank = rank
        self.fabric = fabric
        self.wakeup = fabric.wakeup

    def post_send(self, peer: int, tag: int, buffer: memoryview) -> TransferHandle:
        return self.fabric._post(self.rank, peer, tag, memoryview(buffer), is_send=True)

    def post_recv(self, peer: int, tag: int, buffer: memoryview) -> TransferHandle:
        return self.fabric._post(peer, self.rank, tag, memoryview(buffer), is_send=False)

    def close(self) -> None:
        pass
