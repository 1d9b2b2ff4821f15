"""Injectable clocks (stdlib only, a leaf): every deadline and wait in the transceiver and the
ctx worker's request lifecycle goes through a `Clock`.

Production code uses `MonotonicClock`; tests use `FakeClock`, whose time only moves when code
waits on it (or a test advances it), so timing tests need no sleeps and are deterministic.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    """Monotonic time plus one bounded wait primitive."""

    def monotonic(self) -> float:
        """Seconds on a monotonic scale (only differences are meaningful)."""
        ...

    def wait(self, event: threading.Event | None, timeout: float) -> bool:
        """Block until `event` is set or `timeout` seconds pass (never longer).

        Returns True when the event is set. `event=None` is a plain bounded sleep.
        """
        ...


SPIN_BELOW_S = 0.0001  # a real wait shorter than this spins (a sleep oversleeps it: Linux's 50 µs timer slack)


class MonotonicClock:
    """The real clock: `time.monotonic` and `threading.Event.wait`. A wait under SPIN_BELOW_S
    spins instead (`time.sleep(0)` between looks, which lets other threads take the GIL): the
    pulled copy's probe (`receiver.PULL_TICK_S`) waits tens of µs, which a timed sleep stretches
    to ~60-150 µs."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event | None, timeout: float) -> bool:
        timeout = max(0.0, timeout)
        if 0 < timeout < SPIN_BELOW_S:
            end = time.monotonic() + timeout
            while event is None or not event.is_set():
                if time.monotonic() >= end:
                    return False
                time.sleep(0)
            return True
        if event is None:
            if timeout > 0:
                time.sleep(timeout)
            return False
        return event.wait(timeout)


class FakeClockRunaway(RuntimeError):
    """A loop waited on a FakeClock more often than the test allowed (a would-be hang)."""


class FakeClock:
    """Virtual time for tests.

    `wait(event, timeout)` does not sleep: it advances virtual time to the earliest of
    `now + timeout` and the moment a scheduled callback sets `event`, firing every callback due on
    the way (in time order). Each wait's requested timeout is recorded in `waits`, so tests can
    assert that no wait exceeded a slice. `max_waits` turns an accidental infinite loop into an
    error instead of a hung test.
    """

    def __init__(self, start: float = 0.0, max_waits: int = 1_000_000) -> None:
        self._now = start
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.waits: list[float] = []
        self.max_waits = max_waits

    def monotonic(self) -> float:
        return self._now

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run `fn` once virtual time reaches `when` (during a wait or `advance`)."""
        heapq.heappush(self._timers, (when, next(self._seq), fn))

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self.call_at(self._now + delay, fn)

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, firing due callbacks."""
        self._run_until(self._now + max(0.0, seconds), None)

    def advance_to(self, when: float) -> None:
        """Move time forward to `when` exactly (never back), firing due callbacks."""
        self._run_until(max(self._now, when), None)

    def wait(self, event: threading.Event | None, timeout: float) -> bool:
        self.waits.append(timeout)
        if len(self.waits) > self.max_waits:
            raise FakeClockRunaway(f"more than {self.max_waits} waits on the fake clock")
        if event is not None and event.is_set():
            return True
        self._run_until(self._now + max(0.0, timeout), event)
        return event.is_set() if event is not None else False

    def _run_until(self, target: float, event: threading.Event | None) -> None:
        while self._timers and self._timers[0][0] <= target:
            when, _, fn = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            fn()
            if event is not None and event.is_set():
                return
        self._now = max(self._now, target)
