"""The poll state of a transfer (a task, a session, one data-plane operation): a leaf that the
data-plane seam (:mod:`.plane`), its backends and the sessions (:mod:`.base`) all import."""

from __future__ import annotations

import enum


class TransferState(enum.Enum):
    """Poll state of a task or session. Terminal: COMPLETED, FAILED, CANCELLED.

    TIMEOUT is reported (a sender whose deadline passed without acknowledgement) but is not a
    success; like the terminal states it is *settled*: it never changes again.
    """

    PENDING = "pending"
    TRANSFERRING = "transferring"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def is_settled(self) -> bool:
        return self in _TERMINAL or self is TransferState.TIMEOUT


_TERMINAL = frozenset({TransferState.COMPLETED, TransferState.FAILED, TransferState.CANCELLED})
