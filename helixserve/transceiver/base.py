"""Transceiver core: poll states, transfer sessions and tasks (the data-plane seam is `plane`).

A **session** is one request's transfer on one rank: a `SenderSession` on a ctx rank, a
`ReceiverSession` on a gen rank. It owns **tasks**, one per (peer rank, payload kind): MLA KV
blocks, KDA recurrent state, conv state and aux data (first token, prompt length). Each task is
driven by one `TransferHandle` of a `DataPlane` backend (ucxx in deployments, the in-process fake
in fault-injection tests); the seam itself lives in `plane`, the states in `states` and the
factory `open_data_plane`, which picks the backend, in `backends`.

Session lifecycle (states are `TransferState`):

1. PENDING: created, tasks declared, nothing posted yet; no deadline yet.
2. TRANSFERRING: the first send / first receive request anchored the overall deadline
   (`now + timeout`, anchored once, never reset; shared by every task, aux included).
3. One of, checked in this order on each non-blocking `update()`:
   CANCELLED (a cancel was requested), FAILED (`fail()` was called, or any task failed, even
   with siblings pending),
   COMPLETED (every task completed, plus every ack on a sender), and only then the deadline:
   a receiver past its deadline is FAILED (cause: timeout); a sender past its deadline without
   every acknowledgement is TIMEOUT. A terminal state observed at the deadline boundary therefore
   wins over TIMEOUT.
4. Settled sessions stay in their state. Resources may be freed only once `is_quiesced` (no
   write can still be in flight); otherwise they are quarantined by the owner.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from helixserve.clock import Clock, MonotonicClock
from helixserve.config_transceiver import DEFAULT_KV_TRANSFER_TIMEOUT_MS, TransceiverConfig
from helixserve.transceiver.plane import DataPlane, TransferHandle
from helixserve.transceiver.states import TransferState

__all__ = [  # the data-plane seam lives in `plane`, the states in `states`; re-exported here
    "DataPlane", "PayloadKind", "ReceiverSession", "SenderSession", "TransceiverError", "TransferHandle",
    "TransferSession", "TransferState", "TransferTask",
]

logger = logging.getLogger(__name__)

# finite fallbacks for a missing / invalid overall timeout or blocking slice: the config's defaults
DEFAULT_TIMEOUT_S = DEFAULT_KV_TRANSFER_TIMEOUT_MS / 1000.0
DEFAULT_SLICE_S = TransceiverConfig.model_fields["slice_ms"].default / 1000.0


class PayloadKind(enum.Enum):
    """What a task moves."""

    KV_BLOCKS = "kv_blocks"
    KDA_STATE = "kda_state"
    CONV_STATE = "conv_state"
    AUX = "aux"
    DRAFT = "draft"  # a hidden drafter's prompt cache (layout.shard_segments)


class TransceiverError(RuntimeError):
    """A transfer-level failure with a message naming request, peer and cause."""


def resolve_timeout(timeout_s: float | None) -> float:
    """Overall timeout in seconds; None, non-positive, NaN or infinite -> DEFAULT_TIMEOUT_S."""
    if timeout_s is None or not math.isfinite(timeout_s) or timeout_s <= 0:
        logger.debug("timeout %r not usable; using finite default %.1fs", timeout_s, DEFAULT_TIMEOUT_S)
        return DEFAULT_TIMEOUT_S
    return float(timeout_s)


def resolve_slice(slice_s: float | None) -> float:
    """Blocking-wait slice in seconds; None, non-positive, NaN or infinite -> DEFAULT_SLICE_S."""
    if slice_s is None or not math.isfinite(slice_s) or slice_s <= 0:
        return DEFAULT_SLICE_S
    return float(slice_s)


@dataclass(slots=True)
class TransferTask:
    """One (peer, payload) piece of a session; `handle` is set when it is posted."""

    peer: int
    kind: PayloadKind
    nbytes: int = 0
    state: TransferState = TransferState.PENDING
    handle: TransferHandle | None = None
    error: str | None = None

    def refresh(self) -> TransferState:
        if self.handle is not None and not self.state.is_terminal:
            self.state = self.handle.test()
            if self.state is TransferState.FAILED:
                self.error = self.handle.error or "backend reported failure"
        return self.state

    @property
    def is_quiesced(self) -> bool:
        return self.handle is None or self.handle.is_quiesced()


TaskKey = tuple[int, PayloadKind]


@dataclass
class _Outcome:
    state: TransferState = TransferState.PENDING
    error: str | None = None
    is_timed_out: bool = False


class TransferSession(ABC):
    """One request's transfer on one rank. Not thread-safe except `cancel` and acks.

    Args:
        request_id: the request this transfer belongs to.
        timeout_s: overall deadline length; None/non-positive/infinite -> DEFAULT_TIMEOUT_S.
        clock: time source (inject a FakeClock in tests).
        wakeup: event set on cancel/ack so a poller waiting on it wakes early.
    """

    role: str = "session"

    def __init__(
        self,
        request_id: str,
        timeout_s: float | None = None,
        clock: Clock | None = None,
        wakeup: threading.Event | None = None,
    ) -> None:
        self.request_id = request_id
        self.timeout_s = resolve_timeout(timeout_s)
        self.clock: Clock = clock or MonotonicClock()
        self.wakeup = wakeup or threading.Event()
        self.tasks: dict[TaskKey, TransferTask] = {}
        self.deadline: float | None = None
        self.started_at: float | None = None
        self.settled_at: float | None = None
        self._outcome = _Outcome()
        self._cancel_reason: str | None = None
        self._fail_reason: str | None = None

    # -- declaration and posting -------------------------------------------------------------
    def add_task(self, peer: int, kind: PayloadKind, nbytes: int = 0) -> TransferTask:
        key = (peer, kind)
        if key in self.tasks:
            raise ValueError(f"request {self.request_id}: task {key} already declared")
        task = self.tasks[key] = TransferTask(peer, kind, nbytes)
        return task

    def anchor_deadline(self) -> float:
        """Anchor the overall deadline at the first send / receive request; later calls keep it."""
        if self.deadline is None:
            self.started_at = self.clock.monotonic()
            self.deadline = self.started_at + self.timeout_s
        return self.deadline

    def attach(self, peer: int, kind: PayloadKind, handle: TransferHandle) -> None:
        """Bind a posted operation to its task (re-posting a retry keeps the same deadline)."""
        task = self.tasks.get((peer, kind))
        if task is None:
            raise ValueError(f"request {self.request_id}: no task declared for {(peer, kind)}")
        if self._outcome.state.is_settled:
            handle.cancel()
            raise ValueError(f"request {self.request_id} is already {self._outcome.state.value}")
        self.anchor_deadline()
        task.handle, task.state, task.error = handle, TransferState.TRANSFERRING, None
        if self._outcome.state is TransferState.PENDING:
            self._outcome.state = TransferState.TRANSFERRING

    def cancel(self, reason: str = "cancelled") -> None:
        """Request cancellation; it is observed by the next `update()` (between wait slices)."""
        self._cancel_reason = reason
        self.wakeup.set()

    def fail(self, reason: str) -> None:
        """Fail the session (e.g. the control plane refused it, or its CP group agreed it failed);
        observed by the next `update()`, after a cancel and before task states."""
        self._fail_reason = reason
        self.wakeup.set()

    # -- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> TransferState:
        return self._outcome.state

    @property
    def error(self) -> str | None:
        return self._outcome.error

    @property
    def is_timed_out(self) -> bool:
        return self._outcome.is_timed_out

    @property
    def is_quiesced(self) -> bool:
        """True when no write of this session can still be in flight."""
        return all(task.is_quiesced for task in self.tasks.values())

    @property
    def nbytes(self) -> int:
        return sum(task.nbytes for task in self.tasks.values())

    def remaining(self) -> float:
        """Seconds left before the overall deadline (inf before the first send/receive)."""
        if self.deadline is None:
            return math.inf
        return self.deadline - self.clock.monotonic()

    def update(self) -> TransferState:
        """One non-blocking check; see the module docstring for the order of the rules."""
        if self._outcome.state.is_settled:
            return self._outcome.state
        if self._cancel_reason is not None:
            return self._settle(TransferState.CANCELLED, self._cancel_reason)
        if self._fail_reason is not None:
            return self._settle(TransferState.FAILED, self._fail_reason)
        for task in self.tasks.values():
            task.refresh()
        failed = [t for t in self.tasks.values() if t.state is TransferState.FAILED]
        if failed:
            first = failed[0]
            return self._settle(
                TransferState.FAILED,
                f"request {self.request_id}: {first.kind.value} transfer with peer rank "
                f"{first.peer} failed: {first.error}",
            )
        if self.tasks and self._is_complete():
            return self._settle(TransferState.COMPLETED, None)
        if self.deadline is not None and self.clock.monotonic() >= self.deadline:
            state, message = self._expired_outcome()
            self._outcome.is_timed_out = True
            return self._settle(state, message)
        return self._outcome.state

    def wait(self, timeout_s: float | None = None, slice_s: float | None = None) -> TransferState:
        """Block until settled or `timeout_s` passes, in slices of at most `slice_s`.

        Each wait is `min(slice, time left)`, so the overall deadline is never overshot;
        cancellation and completions are observed between slices. A missing or invalid
        `timeout_s` / `slice_s` falls back to finite defaults (never an unbounded wait).
        """
        slice_len = resolve_slice(slice_s)
        wait_end = self.clock.monotonic() + resolve_timeout(timeout_s)
        while True:
            self.wakeup.clear()
            state = self.update()
            now = self.clock.monotonic()
            if state.is_settled or now >= wait_end:
                return state
            remaining = min(wait_end, self.deadline if self.deadline is not None else math.inf) - now
            self.clock.wait(self.wakeup, min(slice_len, max(remaining, 0.0)))

    def _settle(self, state: TransferState, error: str | None) -> TransferState:
        self._outcome.state, self._outcome.error = state, error
        self.settled_at = self.clock.monotonic()
        if state is not TransferState.COMPLETED:
            for task in self.tasks.values():
                if task.handle is not None and not task.state.is_terminal:
                    task.handle.cancel()  # so the buffers quiesce
            logger.info("%s %s: %s", self.role, self.request_id, error)
        return state

    def _missing(self) -> list[str]:
        return [
            f"{t.kind.value}@rank{t.peer}" for t in self.tasks.values() if not t.state.is_terminal
        ]

    def _is_complete(self) -> bool:
        return all(t.state is TransferState.COMPLETED for t in self.tasks.values())

    @abstractmethod
    def _expired_outcome(self) -> tuple[TransferState, str]:
        """State and error once the overall deadline passed without success."""


class ReceiverSession(TransferSession):
    """Gen side: receives its shard from ctx peers. Past the deadline it is FAILED."""

    role = "receiver"

    def _expired_outcome(self) -> tuple[TransferState, str]:
        return TransferState.FAILED, (
            f"request {self.request_id}: KV transfer timed out after {self.timeout_s * 1e3:.0f} ms "
            f"waiting for {', '.join(self._missing()) or 'nothing posted'}"
        )


class SenderSession(TransferSession):
    """Ctx side: sends to gen receivers; COMPLETED only when every expected rank acknowledged.

    Past the deadline without every ack it is TIMEOUT; its blocks may be freed only when
    `is_quiesced`, otherwise the owner quarantines them.
    """

    role = "sender"

    def __init__(self, request_id: str, expected_acks: set[int] | None = None, **kwargs) -> None:
        super().__init__(request_id, **kwargs)
        self.expected_acks = set(expected_acks or ())
        self.acked: set[int] = set()
        self._ack_lock = threading.Lock()

    def acknowledge(self, rank: int) -> None:
        """Record a receiver's acknowledgement (thread-safe; called from the control plane)."""
        if rank not in self.expected_acks:
            raise ValueError(
                f"request {self.request_id}: ack from unexpected rank {rank}; "
                f"expected {sorted(self.expected_acks)}"
            )
        with self._ack_lock:
            self.acked.add(rank)
        self.wakeup.set()

    def _is_complete(self) -> bool:
        with self._ack_lock:
            acked = self.acked >= self.expected_acks
        return acked and super()._is_complete()

    def _expired_outcome(self) -> tuple[TransferState, str]:
        missing = sorted(self.expected_acks - self.acked)
        return TransferState.TIMEOUT, (
            f"request {self.request_id}: no acknowledgement from gen ranks {missing} within "
            f"{self.timeout_s * 1e3:.0f} ms (pending: {', '.join(self._missing()) or 'none'})"
        )
