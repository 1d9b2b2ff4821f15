"""A request the ctx holds for its gen worker, as the KV sender keeps it (see `sender` for the lifecycle)."""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.transceiver.base import SenderSession, TransferState
from helixserve.transceiver.outbound import Outbound, PulledShard
from helixserve.transceiver.polling import TransferMetrics


class SenderBusyError(TimeoutError):
    """The sender's state lock was not free within ``rpc_timeout_ms``: the command did not run."""


class HoldSession(SenderSession):
    """A held request: deadline anchored at hold; COMPLETED once every cp rank acknowledged
    (never before some rank said how many there are)."""

    def _is_complete(self) -> bool:
        return bool(self.expected_acks) and super()._is_complete()

    def _expired_outcome(self) -> tuple[TransferState, str]:
        expected = sorted(self.expected_acks)
        return TransferState.TIMEOUT, (
            f"request {self.request_id}: hold deadline passed after {self.timeout_s * 1e3:.0f} ms; "
            f"acknowledged by cp ranks {sorted(self.acked)} of {expected if expected else 'none (never requested)'}")


@dataclass(slots=True)
class Hold:
    session: HoldSession
    block_ids: list[int]
    slot: int | None
    num_prompt_tokens: int
    first_tokens: list[int]
    cp_size: int | None = None
    grant_serial: int = 0  # its granted pull's lease serial (0: none granted)
    outbounds: dict[int, Outbound | PulledShard] = field(default_factory=dict)
    is_quarantine_logged: bool = False


@dataclass(frozen=True, slots=True)
class SenderStats:
    num_held: int  # holds not freed yet (waiting, sending, or quarantined)
    num_quarantined: int  # settled, but a send may still read their cache
    num_freed: int
    metrics: TransferMetrics  # expired_holds = holds whose deadline passed
    num_granted: int = 0  # completed holds every cp rank copied on the grant (no RequestShard)
