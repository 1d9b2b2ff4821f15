"""A warning a hostile caller can trigger at will, logged at most once per interval with the
number of times it happened since (torch-free, imports nothing of the package)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# one line per this many seconds per throttled message, whatever the callers' rate
THROTTLE_INTERVAL_S = 10.0


class ThrottledLog:
    """``log(key, msg, *args)`` writes the first occurrence of ``key`` at once, then at most one
    line per ``interval_s`` carrying ``(and N more since)``. Thread-safe (gRPC handlers run on a
    pool). ``counts`` keeps every occurrence, logged or not."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING,
                 interval_s: float = THROTTLE_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._level = level
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next_at: dict[str, float] = {}
        self._num_suppressed: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def log(self, key: str, msg: str, *args: object) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            now = self._clock()
            if now < self._next_at.get(key, float("-inf")):
                self._num_suppressed[key] = self._num_suppressed.get(key, 0) + 1
                return
            self._next_at[key] = now + self._interval_s
            num_suppressed = self._num_suppressed.pop(key, 0)
        if num_suppressed:
            msg += " (and %d more in the last %.0f s)"
            args = (*args, num_suppressed, self._interval_s)
        self._logger.log(self._level, msg, *args)
