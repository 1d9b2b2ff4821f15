"""The data-plane seam: the only interface the KV sender and receiver use to move bytes.

A `DataPlane` is one rank's endpoint of a tagged-message fabric (ucxx in deployments, the
in-process fake in tests). The transfer path calls exactly these methods:

- `for_transceiver(config, wakeup, host, peer_hosts)`: the plane of a KV sender or receiver
  (built only through `backends.open_data_plane`, which picks the class by
  `TransceiverConfig.backend`);
- `address`: this worker's address, handed to peers through the control plane;
- `connect_worker(address)`: the shared, long-lived endpoint to a peer worker (its key);
- `send_message` / `recv_message`: one message with a caller-built 64-bit wire tag; receives are
  matched by the *worker* in posting order, whatever endpoint posted them, so a receive may be
  posted with ``peer=None`` (on the worker itself) before the sender's address is known;
- `retract(wire_tag)`: end this worker's oldest posted receive of `wire_tag` without writing it;
- `close()`: close every endpoint (posted receives end).

`post_send` / `post_recv` move one buffer between ranks by (peer rank, tag): the chunked raw
form the backends' own tests and benchmarks use. Every operation returns a `TransferHandle`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

from helixserve.config_transceiver import TransceiverConfig
from helixserve.transceiver.states import TransferState


class TransferHandle(ABC):
    """One posted data-plane operation (a send or a receive of one task's bytes).

    `test()` is non-blocking: it makes progress where the backend needs it and returns the
    current state (PENDING/TRANSFERRING until it is terminal). `is_quiesced()` is True when the
    backend can no longer touch the buffer (finished, or cancelled and acknowledged by UCX).
    """

    error: str | None = None

    @abstractmethod
    def test(self) -> TransferState: ...

    @abstractmethod
    def is_quiesced(self) -> bool: ...

    @abstractmethod
    def cancel(self) -> None:
        """Ask the backend to abort; the handle quiesces later (check `is_quiesced`)."""


class DataPlane(ABC):
    """A backend that moves bytes between workers by tag (see the module docstring).

    `wakeup` is set whenever an operation may have finished, so pollers can wait on it
    instead of spinning. Buffers are contiguous host (or device) byte buffers or tensors.
    """

    wakeup: threading.Event

    @classmethod
    @abstractmethod
    def for_transceiver(cls, config: TransceiverConfig, wakeup: threading.Event,
                        host: str | None = None, peer_hosts: tuple[str, ...] = ()) -> DataPlane:
        """A KV sender's or receiver's plane; completions set `wakeup`; `host`: where it serves
        (a sender); `peer_hosts`: the hosts it will reach (a receiver, which serves nowhere: a
        backend that binds per network interface takes the one on the route to them)."""

    @property
    @abstractmethod
    def address(self) -> bytes:
        """This worker's address, for peers (carried by the control plane)."""

    @abstractmethod
    def connect_worker(self, address: bytes) -> Hashable:
        """The shared endpoint to the worker at `address` (opened on first use); returns its key."""

    @abstractmethod
    def send_message(self, peer: Hashable, wire_tag: int, buffer: Any) -> TransferHandle:
        """Send `buffer` as exactly one message tagged `wire_tag` to `peer` (a `connect_worker` key)."""

    @abstractmethod
    def recv_message(self, peer: Hashable | None, wire_tag: int, buffer: Any) -> TransferHandle:
        """Receive exactly one message tagged `wire_tag` into `buffer` (`peer` None: posted on the
        worker, matched whichever worker sends it)."""

    @abstractmethod
    def retract(self, wire_tag: int) -> TransferHandle:
        """End this worker's oldest posted receive of `wire_tag` without writing its buffer."""

    @abstractmethod
    def post_send(self, peer: int, tag: int, buffer: Any) -> TransferHandle: ...

    @abstractmethod
    def post_recv(self, peer: int, tag: int, buffer: Any) -> TransferHandle: ...

    @abstractmethod
    def close(self) -> None: ...
