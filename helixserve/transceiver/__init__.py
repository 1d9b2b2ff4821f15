"""helixserve.transceiver: KV / KDA-state transfer between ctx and gen ranks.

Core logic (backend-free): `base` (poll states, sessions, tasks, data-plane interface),
`polling` (bounded local poll), `consensus` (one batched all-gather per check over the CP
group), `bounce` (staging pool, fan-in scatter, untrusted-plan validation). Backends are picked
by `TransceiverBackendKind` through `load_data_plane`, which imports them lazily: `ucxx_backend`
(UCX via ucxx) and `fake` (in-process, fault injection for tests only).
"""

from helixserve.transceiver.base import (
    DataPlane,
    PayloadKind,
    ReceiverSession,
    SenderSession,
    TransferHandle,
    TransferSession,
    TransferState,
    load_data_plane,
)
from helixserve.transceiver.clock import Clock, FakeClock, MonotonicClock
from helixserve.transceiver.config import TransceiverBackendKind, TransceiverConfig
from helixserve.transceiver.polling import PollResult, TransferMetrics, TransferPoller

__all__ = [
    "Clock", "DataPlane", "FakeClock", "MonotonicClock", "PayloadKind", "PollResult",
    "ReceiverSession", "SenderSession", "TransceiverBackendKind", "TransceiverConfig",
    "TransferHandle", "TransferMetrics", "TransferPoller", "TransferSession", "TransferState",
    "load_data_plane",
]
