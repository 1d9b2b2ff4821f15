"""In-process fake data plane, only for fault injection and clock-driven tests of the logic.

Several `FakeDataPlane`s (one per simulated rank / worker) share one `FakeFabric`. It implements
the whole `DataPlane` seam, so the real `KVSender` and `KVReceiver` run over it
(``TransceiverConfig(backend="fake")``: `for_transceiver` joins the process's installed fabric,
see `install_fabric`):

- raw `post_send` / `post_recv`: a send and a receive with the same (source, destination, tag)
  match;
- messages (`send_message` / `recv_message` / `retract`), as UCX tag matching does: matched by
  the receiving *worker* and the wire tag, in posting order on both sides (a send nobody receives
  yet waits as an unexpected message); `retract` is a 0-byte message to ourselves, which ends the
  oldest posted receive of its tag without writing it. A message larger than its receive fails
  both sides (truncated); a send to a closed worker never completes (like an unmatched rendezvous).

Bytes are copied once, when the first side of a matched pair completes (after `latency_s` on the
injected clock). Faults are injected per (source rank, destination rank, tag) or wider: a handle
that never completes, fails, or never quiesces even after cancel (a peer that may still be
writing); a matched pair with one side failing fails both (a broken link).
"""

from __future__ import annotations

import enum
import threading
import warnings
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from helixserve.clock import Clock, MonotonicClock
from helixserve.transceiver.base import TransferState
from helixserve.transceiver.plane import DataPlane, TransferHandle


PRUNE_AT = 4096  # message ops tracked before the quiesced ones are dropped
ANY_SOURCE = -1  # src of a receive posted on the worker (recv_message(None, ...)): fault keys by src skip it


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
        self.on_complete: list[Callable[[], None]] = []

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


@dataclass
class _Message:
    """One posted message operation (a send, or a receive) of the message path."""

    handle: FakeHandle
    buffer: torch.Tensor  # flat uint8 view of the caller's memory
    src: int
    dst: int
    wire_tag: int
    is_send: bool


@dataclass
class _Delivery:
    """Copies a matched send into its receive exactly once, whichever side completes first
    (the sender may reuse its buffer as soon as its own side completed)."""

    send: torch.Tensor
    recv: torch.Tensor
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _is_done: bool = False

    def __call__(self) -> None:
        with self._lock:
            if not self._is_done:
                self._is_done = True
                if self.send.numel():
                    self.recv[: self.send.numel()].copy_(self.send)


def _flat(buffer: Any) -> torch.Tensor:
    """A flat uint8 tensor aliasing `buffer` (a contiguous tensor or a buffer-protocol object)."""
    if isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise ValueError(f"fake fabric: buffers must be contiguous, got strides {buffer.stride()}")
        return buffer.reshape(-1).view(torch.uint8)
    view = memoryview(buffer).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only send buffer is fine: it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _address_of(rank: int) -> bytes:
    return b"fake-fabric-worker-%06d" % rank  # >= 16 bytes, like a real worker address


class FakeFabric:
    """Shared matching table and fault script for a set of fake ranks (thread-safe)."""

    def __init__(self, clock: Clock | None = None, latency_s: float = 0.0) -> None:
        self.clock: Clock = clock or MonotonicClock()
        self.latency_s = latency_s
        self.wakeup = threading.Event()
        self._faults: dict[tuple[int | None, int | None, int | None], FakeFault] = {}
        self._sends: dict[tuple[int, int, int], _Posted] = {}
        self._recvs: dict[tuple[int, int, int], _Posted] = {}
        self._lock = threading.RLock()
        self._planes: dict[int, FakeDataPlane] = {}
        self._unexpected: dict[tuple[int, int], deque[_Message]] = {}  # (dst, wire tag): unmatched sends
        self._waiting: dict[tuple[int, int], deque[_Message]] = {}  # (dst, wire tag): unmatched receives
        self._messages: list[_Message] = []  # every message op not seen quiesced yet

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

    def plane(self, rank: int | None = None, wakeup: threading.Event | None = None) -> FakeDataPlane:
        """A new worker on this fabric (`rank` None: the next free one)."""
        with self._lock:
            if rank is None:
                rank = max(self._planes, default=-1) + 1
            plane = self._planes[rank] = FakeDataPlane(rank, self, wakeup)
        return plane

    def rank_of(self, address: bytes) -> int:
        with self._lock:
            for rank, plane in self._planes.items():
                if plane.address == address and not plane.is_closed:
                    return rank
        raise ConnectionError(f"fake fabric: no live worker at address {address!r}")

    def in_flight(self) -> list[str]:
        """Message operations that may still touch their buffer ("send 0->1 tag 0x..")."""
        with self._lock:
            self._messages = [m for m in self._messages if not m.handle.is_quiesced()]
            return [f"{'send' if m.is_send else 'recv'} {m.src}->{m.dst} tag {m.wire_tag:#x}"
                    for m in self._messages]

    def _notify(self) -> None:
        self.wakeup.set()
        for plane in list(self._planes.values()):
            plane.wakeup.set()

    def _post(self, src: int, dst: int, tag: int, buffer: memoryview, is_send: bool) -> FakeHandle:
        key = (src, dst, tag)
        with self._lock:
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
                delivery = _Delivery(_flat(send.buffer), _flat(recv.buffer))
                send.handle.on_complete.append(delivery)
                recv.handle.on_complete.append(delivery)
        self._notify()
        return handle

    def _post_message(self, src: int, dst: int, wire_tag: int, buffer: Any, is_send: bool) -> FakeHandle:
        flat = _flat(buffer)
        handle = FakeHandle(self.clock, self.fault_for(src, dst, wire_tag), self.latency_s, ready=False,
                            error=f"injected failure on src={src} dst={dst} tag={wire_tag:#x}")
        message = _Message(handle, flat, src, dst, wire_tag, is_send)
        with self._lock:
            if len(self._messages) >= PRUNE_AT:
                self._messages = [m for m in self._messages if not m.handle.is_quiesced()]
            self._messages.append(message)
            mine, theirs = (self._unexpected, self._waiting) if is_send else (self._waiting, self._unexpected)
            queue = theirs.get((dst, wire_tag))
            # cancelled or failed: never matches, except across a link broken by a FAIL fault, which
            # fails whatever meets it later too (else the order of posting would decide the outcome)
            while queue and queue[0].handle.test().is_terminal and queue[0].handle.fault is not FakeFault.FAIL:
                queue.popleft()
            if queue:
                other = queue.popleft()
                self._match(*((message, other) if is_send else (other, message)))
            elif is_send and self._planes[dst].is_closed:
                pass  # nobody will ever receive it: it stays in flight, like an unmatched rendezvous
            else:
                mine.setdefault((dst, wire_tag), deque()).append(message)
        self._notify()
        return handle

    @staticmethod
    def _match(send: _Message, recv: _Message) -> None:
        faults = (send.handle.fault, recv.handle.fault)
        if send.buffer.numel() > recv.buffer.numel():
            error = (f"message truncated: {send.buffer.numel()} bytes into a {recv.buffer.numel()}-byte "
                     f"receive (tag {send.wire_tag:#x})")
            send.handle.fail(error)
            recv.handle.fail(error)
        elif FakeFault.FAIL in faults:  # a broken link fails both sides
            for side in (send.handle, recv.handle):
                side.fault = FakeFault.FAIL
            if recv.src == ANY_SOURCE:  # a receive posted on the worker names the link it matched
                recv.handle._error = send.handle._error
        elif faults == (FakeFault.NONE, FakeFault.NONE):
            delivery = _Delivery(send.buffer, recv.buffer)
            for side in (send.handle, recv.handle):
                side.on_complete.append(delivery)
                side.ready = True

    def _close(self, rank: int) -> None:
        """A closed worker's posted receives end (cancelled), as closing UCX endpoints does."""
        with self._lock:
            for (dst, _), queue in self._waiting.items():
                if dst == rank:
                    for message in queue:
                        message.handle.cancel()
                    queue.clear()
        self._notify()


class FakeDataPlane(DataPlane):
    """One simulated worker's view of a `FakeFabric` (rank = its id in fault keys)."""

    def __init__(self, rank: int, fabric: FakeFabric, wakeup: threading.Event | None = None) -> None:
        self.rank = rank
        self.fabric = fabric
        self.wakeup = wakeup or fabric.wakeup
        self.is_closed = False
        self._address = _address_of(rank)

    @classmethod
    def for_transceiver(cls, config: Any, wakeup: threading.Event, host: str | None = None,
                        peer_hosts: tuple[str, ...] = ()) -> FakeDataPlane:
        """A new worker on the installed fabric (see `install_fabric`); hosts play no part."""
        return installed_fabric().plane(wakeup=wakeup)

    @property
    def address(self) -> bytes:
        return self._address

    def connect_worker(self, address: bytes) -> Hashable:
        return ("worker", self.fabric.rank_of(bytes(address)))

    def send_message(self, peer: Hashable, wire_tag: int, buffer: Any) -> TransferHandle:
        return self.fabric._post_message(self.rank, self._peer_rank(peer), wire_tag, buffer, is_send=True)

    def recv_message(self, peer: Hashable | None, wire_tag: int, buffer: Any) -> TransferHandle:
        src = ANY_SOURCE if peer is None else self._peer_rank(peer)  # matching is by (dst, tag) anyway
        return self.fabric._post_message(src, self.rank, wire_tag, buffer, is_send=False)

    def retract(self, wire_tag: int) -> TransferHandle:
        return self.fabric._post_message(self.rank, self.rank, wire_tag, torch.empty(0, dtype=torch.uint8),
                                         is_send=True)

    def post_send(self, peer: int, tag: int, buffer: Any) -> TransferHandle:
        return self.fabric._post(self.rank, peer, tag, memoryview(buffer), is_send=True)

    def post_recv(self, peer: int, tag: int, buffer: Any) -> TransferHandle:
        return self.fabric._post(peer, self.rank, tag, memoryview(buffer), is_send=False)

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.fabric._close(self.rank)

    def _peer_rank(self, peer: Hashable) -> int:
        if not (isinstance(peer, tuple) and len(peer) == 2 and peer[0] == "worker" and isinstance(peer[1], int)):
            raise ValueError(f"fake rank {self.rank}: {peer!r} is not a connect_worker() key")
        return peer[1]


_installed: FakeFabric | None = None
_installed_lock = threading.Lock()


def installed_fabric() -> FakeFabric:
    """The fabric `FakeDataPlane.for_transceiver` joins (a fresh one if none was installed)."""
    global _installed
    with _installed_lock:
        if _installed is None:
            _installed = FakeFabric()
        return _installed


def install_fabric(fabric: FakeFabric | None) -> FakeFabric | None:
    """Make `fabric` the one new transceiver planes join (None: a fresh one next time); returns
    the previous one, so a test can put it back."""
    global _installed
    with _installed_lock:
        previous, _installed = _installed, fabric
    return previous
