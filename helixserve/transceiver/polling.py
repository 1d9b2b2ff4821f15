"""Bounded, local polling of transfer sessions (no collective here; see consensus.py).

`TransferPoller.poll(wait_num, interval_s)`:

- clamps `wait_num` to the number of live (not yet settled) sessions; with none it returns at
  once;
- otherwise sweeps every live session (non-blocking `update()`) and returns as soon as
  `completed + failed >= wait_num` (failed here counts every non-success end: FAILED, CANCELLED,
  TIMEOUT), or when the monotonic deadline `now + interval_s` passes, whichever comes first;
- between sweeps it waits at most `tick_s` (~1 ms) or until the wakeup event is set, so an idle
  loop never sleeps a whole interval and a busy one never spins hot;
- `wait_num=0` is one non-blocking sweep; `wait_num=None` blocks until every live session is
  settled, still in bounded slices (each session's own finite deadline bounds it).

The executor calls `poll` once per step with a small interval, so decode steps of other requests
never wait on a transfer.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from helixserve.clock import Clock, MonotonicClock
from helixserve.transceiver.base import TransferSession, TransferState

logger = logging.getLogger(__name__)

# internal tick: a poller's longest wait between two sweeps (a completion's wakeup ends it earlier)
DEFAULT_TICK_S = 0.001


@dataclass(slots=True)
class PollResult:
    """Request ids by state after one poll, over every session the poller holds.

    `quiesced`: settled sessions with no write in flight (their buffers may be freed);
    `quarantined`: settled without success but a write may still be in flight (never reuse).
    """

    completed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    quiesced: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    num_sweeps: int = 0
    num_target: int = 0


@dataclass(slots=True)
class TransferMetrics:
    """Counters exported to the metrics endpoint."""

    bytes_transferred: int = 0
    seconds_transferred: float = 0.0
    in_flight: int = 0
    completed: int = 0
    failures: int = 0
    timeouts: int = 0
    cancellations: int = 0
    expired_holds: int = 0


class TransferPoller:
    """Holds one rank's sessions and polls them with a bounded budget.

    Args:
        clock: time source (FakeClock in tests).
        tick_s: longest wait between two non-blocking sweeps (~1 ms).
        wakeup: event that data planes / sessions set when something may have changed;
            shared with every added session.
    """

    def __init__(
        self,
        clock: Clock | None = None,
        tick_s: float = DEFAULT_TICK_S,
        wakeup: threading.Event | None = None,
    ) -> None:
        if not math.isfinite(tick_s) or tick_s <= 0:
            raise ValueError(f"tick_s must be finite and > 0, got {tick_s!r}")
        self.clock: Clock = clock or MonotonicClock()
        self.tick_s = tick_s
        self.wakeup = wakeup or threading.Event()
        self.sessions: dict[str, TransferSession] = {}
        self.metrics = TransferMetrics()
        self._counted: set[str] = set()

    def add(self, session: TransferSession) -> None:
        if session.request_id in self.sessions:
            raise ValueError(f"request {session.request_id} already has a session on this rank")
        session.wakeup = self.wakeup
        self.sessions[session.request_id] = session

    def __len__(self) -> int:
        return len(self.sessions)

    def live_sessions(self) -> list[TransferSession]:
        return [s for s in self.sessions.values() if not s.state.is_settled]

    def cancel(self, request_ids: Iterable[str], reason: str) -> None:
        """Cancel local sessions (e.g. those the group agreed are cancelled or failed)."""
        for request_id in request_ids:
            session = self.sessions.get(request_id)
            if session is not None and not session.state.is_settled:
                session.cancel(reason)

    def retire(self, request_id: str) -> TransferSession:
        """Forget a settled, quiesced session (its buffers may then be freed or reused)."""
        session = self.sessions.get(request_id)
        if session is None:
            raise KeyError(f"no session for request {request_id}")
        if not session.state.is_settled:
            raise ValueError(f"request {request_id} is still {session.state.value}; cancel first")
        if not session.is_quiesced:
            raise ValueError(
                f"request {request_id}: a write may still be in flight; keep it quarantined"
            )
        self._counted.discard(request_id)
        return self.sessions.pop(request_id)

    def poll(self, wait_num: int | None = 0, interval_s: float = 0.0,
             ready: Callable[[], bool] | None = None, ready_tick_s: float = 0.0) -> PollResult:
        """Bounded local poll; see the module docstring for the exact semantics. `ready`: a cheap
        probe of completions that set no wakeup (a device copy's event), asked every
        `ready_tick_s` between two sweeps; when it says True the next sweep runs at once, else
        sweeps stay a tick apart (a sweep updates every live session: at high concurrency it is
        the expensive part)."""
        if wait_num is not None and wait_num < 0:
            raise ValueError(f"wait_num must be >= 0 or None, got {wait_num}")
        live = self.live_sessions()
        target = len(live) if wait_num is None else min(wait_num, len(live))
        num_sweeps = 0
        if live:
            end = self._poll_end(live, wait_num, interval_s)
            while True:
                self.wakeup.clear()
                for session in live:
                    session.update()
                num_sweeps += 1
                if sum(s.state.is_settled for s in live) >= target:
                    break
                now = self.clock.monotonic()
                if now >= end:
                    break
                self._wait(min(self.tick_s, end - now), ready, ready_tick_s)
        return self._result(num_sweeps, target)

    def _wait(self, timeout: float, ready: Callable[[], bool] | None, ready_tick_s: float) -> None:
        """`timeout` seconds, or until the wakeup, or (probed every `ready_tick_s`) `ready()`."""
        if ready is None or ready_tick_s <= 0:
            self.clock.wait(self.wakeup, timeout)
            return
        until = self.clock.monotonic() + timeout
        while True:
            left = until - self.clock.monotonic()
            if left <= 0 or self.clock.wait(self.wakeup, min(ready_tick_s, left)) or ready():
                return

    def _poll_end(self, live: list[TransferSession], wait_num: int | None, interval_s: float) -> float:
        now = self.clock.monotonic()
        if wait_num is None:
            # every session settles by its own finite deadline; bound unanchored ones the same way
            return now + max(min(s.remaining(), s.timeout_s) for s in live) + self.tick_s
        if interval_s is None or not math.isfinite(interval_s) or interval_s < 0:
            raise ValueError(f"interval_s must be finite and >= 0, got {interval_s!r}")
        return now + interval_s

    def _result(self, num_sweeps: int, target: int) -> PollResult:
        result = PollResult(num_sweeps=num_sweeps, num_target=target)
        buckets = {
            TransferState.COMPLETED: result.completed,
            TransferState.FAILED: result.failed,
            TransferState.CANCELLED: result.cancelled,
            TransferState.TIMEOUT: result.timed_out,
        }
        for request_id, session in self.sessions.items():
            state = session.state
            buckets.get(state, result.pending).append(request_id)
            if state.is_settled:
                (result.quiesced if session.is_quiesced else result.quarantined).append(request_id)
                self._count(session)
        self.metrics.in_flight = len(result.pending)
        return result

    def _count(self, session: TransferSession) -> None:
        if session.request_id in self._counted:
            return
        self._counted.add(session.request_id)
        m, state = self.metrics, session.state
        if state is TransferState.COMPLETED:
            m.completed += 1
            m.bytes_transferred += session.nbytes
            if session.started_at is not None and session.settled_at is not None:
                m.seconds_transferred += session.settled_at - session.started_at
        elif state is TransferState.CANCELLED:
            m.cancellations += 1
        else:
            m.failures += 1
            if session.is_timed_out:
                m.timeouts += 1
            if state is TransferState.TIMEOUT:
                m.expired_holds += 1
