"""Block-stored / block-removed events of a prefix pool, kept in a bounded ring (torch-free).

:class:`~helixserve.kvcache.prefix_index.PrefixBlockPool` records an event when a block is named
by its content (``stored``) and when it loses its name (``removed``: evicted for a new block,
unpublished, or reset). Each event has a sequence number, one more than the last. A reader (the
router, through the ctx worker's ``GET /v1/prefix_events``) asks for the events after the last
number it saw: :meth:`PrefixEventLog.since` answers them, or, when some of them have left the
ring (or the number is not one this log gave), a *resync*: every key cached now, which replaces
what the reader knew. ``epoch`` names this log: a restarted worker has a new one, so a reader
drops the blocks it learnt from the old one.

The pool records from the engine thread and the worker's HTTP loop reads from another: one lock.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from dataclasses import dataclass
from enum import Enum

BlockKey = bytes


class PrefixEventKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(slots=True, frozen=True)
class PrefixEvent:
    seq: int
    kind: PrefixEventKind
    key: BlockKey


@dataclass(slots=True, frozen=True)
class PrefixEvents:
    """What :meth:`PrefixEventLog.since` answers: ``events`` after the reader's number, or (a
    resync) ``blocks``, the keys cached now, oldest first. ``seq``: the number to ask from next."""

    epoch: str
    seq: int
    is_resync: bool
    events: tuple[PrefixEvent, ...] = ()
    blocks: tuple[BlockKey, ...] = ()


class PrefixEventLog:
    """The last ``capacity`` events and the set of keys cached now (module docstring)."""

    def __init__(self, capacity: int, epoch: str | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"the prefix event ring needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.epoch = epoch or secrets.token_hex(8)
        self._ring: deque[PrefixEvent] = deque(maxlen=capacity)
        self._seq = 0  # the last event's number (0: none yet)
        self._live: dict[BlockKey, None] = {}  # cached keys, in the order they were stored
        self._lock = threading.Lock()

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def num_cached(self) -> int:
        return len(self._live)

    def stored(self, key: BlockKey) -> None:
        with self._lock:
            self._live[key] = None
            self._append(PrefixEventKind.STORED, key)

    def removed(self, key: BlockKey) -> None:
        with self._lock:
            self._live.pop(key, None)
            self._append(PrefixEventKind.REMOVED, key)

    def _append(self, kind: PrefixEventKind, key: BlockKey) -> None:
        self._seq += 1
        self._ring.append(PrefixEvent(self._seq, kind, key))

    def since(self, since: int | None, max_blocks: int | None = None) -> PrefixEvents:
        """The events numbered after ``since``; a resync when ``since`` is None, ahead of this
        log, or older than the ring's first event (``max_blocks``: a resync lists at most the
        newest that many keys)."""
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        with self._lock:
            first_kept = self._seq - len(self._ring)  # every event after this one is in the ring
            if since is not None and first_kept <= since <= self._seq:
                skip = since - first_kept
                events = tuple(self._ring[i] for i in range(skip, len(self._ring)))
                return PrefixEvents(self.epoch, self._seq, False, events=events)
            keys = list(self._live)
            if max_blocks is not None:
                keys = keys[-max_blocks:]
            return PrefixEvents(self.epoch, self._seq, True, blocks=tuple(keys))
