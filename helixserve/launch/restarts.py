"""Bounded restarts (torch-free): how often something that died may be started again, and after
how long (:class:`~helixserve.config.RestartPolicy`). Used by ``helixserve launch`` for its
children and by a gen worker for its SPMD world."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from helixserve.config import RestartPolicy


class RestartBudget:
    """The restarts :class:`RestartPolicy` still allows: at most ``max_restarts`` within any
    ``window_s`` seconds, the k-th one of a window after ``backoff_s * 2**(k-1)`` seconds (capped
    at ``max_backoff_s``)."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._times: deque[float] = deque()
        self.num_restarts = 0  # over the whole life

    @property
    def num_recent(self) -> int:
        """Restarts within the last ``window_s`` seconds."""
        self._forget_old()
        return len(self._times)

    def next_delay(self) -> float | None:
        """A failure happened now: the backoff before restarting, or None when the window's
        restarts are spent (give up)."""
        self._forget_old()
        if len(self._times) >= self.policy.max_restarts:
            return None
        self._times.append(self._clock())
        self.num_restarts += 1
        delay = self.policy.backoff_s * 2 ** (len(self._times) - 1)
        return min(delay, self.policy.max_backoff_s)

    def describe(self) -> str:
        """E.g. ``restart 2 of at most 3 within 300 s``."""
        return (f"restart {len(self._times)} of at most {self.policy.max_restarts} within "
                f"{self.policy.window_s:g} s")

    def _forget_old(self) -> None:
        horizon = self._clock() - self.policy.window_s
        while self._times and self._times[0] < horizon:
            self._times.popleft()
