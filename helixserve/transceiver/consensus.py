"""CP-group consensus on transfer outcomes: one batched all-gather per check.

Which group: gen with attention DP -> the CP group (x PP when PP > 1); gen without attention
DP -> the whole gen world; ctx with TP > 1 -> its TP group. A group of size 1 (plain attention
DP, cp = 1) needs no collective.

Each check gathers every rank's `[cancelled, failed, completed, quiesced]` request-id lists (plus,
optionally, an error message per failed request, so every rank reports the same cause) in ONE
`all_gather_object` call, then:

    cancelled = union over ranks
    failed    = union - cancelled
    completed = intersection - cancelled - failed
    quiesced  = intersection

A request starts decoding only when it is in `completed` (present on every rank); a rank's local
timeout leaves it out of `completed` there, so no rank starts it, and once that rank reports it
failed it fails everywhere. Cancelled or failed requests are retired (cache freed) only when also
`quiesced` on every rank (`ConsensusResult.retirable`).

Skipping: the collective is skipped only while the group's sticky "has ever had a session" flag
is unset. The flag must be set from information every rank of the group already shares (the
scheduler broadcasts each step's new requests to the whole group), by calling `mark_active()` in
the same step on every rank; a rank must never skip a collective its peers enter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from helixserve.transceiver.polling import PollResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalStatus:
    """One rank's report for a check (request ids)."""

    cancelled: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    completed: frozenset[str] = frozenset()
    quiesced: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls,
        cancelled: Iterable[str] = (),
        failed: Iterable[str] = (),
        completed: Iterable[str] = (),
        quiesced: Iterable[str] = (),
    ) -> LocalStatus:
        return cls(frozenset(cancelled), frozenset(failed), frozenset(completed), frozenset(quiesced))

    @classmethod
    def from_poll(cls, result: PollResult) -> LocalStatus:
        """Map a local poll: FAILED and TIMEOUT both report as failed."""
        return cls.of(
            result.cancelled, [*result.failed, *result.timed_out], result.completed, result.quiesced
        )

    @property
    def is_empty(self) -> bool:
        return not (self.cancelled or self.failed or self.completed or self.quiesced)

    def encode(self) -> tuple[list[str], list[str], list[str], list[str]]:
        return (sorted(self.cancelled), sorted(self.failed), sorted(self.completed),
                sorted(self.quiesced))


@dataclass(frozen=True, slots=True)
class ConsensusResult:
    """Group-wide agreement after one check; identical on every rank of the group."""

    cancelled: frozenset[str]
    failed: frozenset[str]
    completed: frozenset[str]
    quiesced: frozenset[str]
    is_skipped: bool = False
    errors: Mapping[str, str] = field(default_factory=dict)  # failed/cancelled id -> first cause

    @property
    def ready(self) -> frozenset[str]:
        """Requests every rank has fully received: these may start decoding."""
        return self.completed

    @property
    def retirable(self) -> frozenset[str]:
        """Cancelled or failed requests quiesced on every rank: their cache may be freed."""
        return (self.cancelled | self.failed) & self.quiesced


EMPTY_RESULT = ConsensusResult(frozenset(), frozenset(), frozenset(), frozenset(), is_skipped=True)


def combine(reports: list[tuple]) -> ConsensusResult:
    """Apply the union/intersection rules to every rank's encoded report.

    A report is `(cancelled, failed, completed, quiesced)` id lists, optionally followed by an
    `{id: error}` dict; the agreed error of a request is the first one in rank order.
    """
    sets = [[frozenset(ids) for ids in report[:4]] for report in reports]
    cancelled = frozenset().union(*(s[0] for s in sets))
    failed = frozenset().union(*(s[1] for s in sets)) - cancelled
    completed = frozenset.intersection(*(s[2] for s in sets)) - cancelled - failed
    quiesced = frozenset.intersection(*(s[3] for s in sets))
    errors: dict[str, str] = {}
    for report in reports:
        for request_id, error in (report[4] if len(report) > 4 else {}).items():
            if request_id in failed | cancelled:
                errors.setdefault(request_id, error)
    return ConsensusResult(cancelled, failed, completed, quiesced, errors=errors)


class TransferConsensus:
    """Agreement on transfer outcomes over a process group (a CPU/gloo group).

    Args:
        group: the consensus group (None = the default world when initialized, else size 1).
        is_local: a group of one (no collective ever), e.g. a cp = 1 rank inside a bigger world.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, is_local: bool = False) -> None:
        self.group = group
        if is_local:  # a group of one by construction (cp = 1), whatever torch.distributed holds
            if group is not None:
                raise ValueError("a local consensus takes no process group")
            self.group_size = 1
        elif dist.is_available() and dist.is_initialized():
            self.group_size = dist.get_world_size(group)
        elif group is not None:
            raise ValueError("a consensus process group was given but torch.distributed is not initialized")
        else:
            self.group_size = 1
        self.is_active = False
        self.num_collectives = 0

    def mark_active(self) -> None:
        """Set the sticky flag; call in the same step on every rank (from shared schedule info)."""
        self.is_active = True

    def check(self, status: LocalStatus, errors: Mapping[str, str] | None = None) -> ConsensusResult:
        """One consensus check: at most one collective (none for a group of size 1).

        `errors` (optional): this rank's cause for requests it reports failed or cancelled;
        they travel in the same all-gather.

        Raises:
            ValueError: `status` has something to report while the group was never marked
                active (skipping would leave this rank's peers out of sync).
        """
        if self.group_size == 1:  # combine([report]) without encoding it
            failed = status.failed - status.cancelled
            causes = {rid: e for rid, e in (errors or {}).items() if rid in failed or rid in status.cancelled}
            return ConsensusResult(status.cancelled, failed, status.completed - status.cancelled - failed,
                                   status.quiesced, errors=causes)
        report = (*status.encode(), dict(errors)) if errors else status.encode()
        if not self.is_active:
            if not status.is_empty:
                raise ValueError(
                    "consensus check with a non-empty report before mark_active(): every rank "
                    f"of the group must mark it active in the same step; report={status}"
                )
            return EMPTY_RESULT
        gathered: list[object] = [None] * self.group_size
        dist.all_gather_object(gathered, report, group=self.group)
        self.num_collectives += 1
        return combine(gathered)  # type: ignore[arg-type]
