"""helixserve.transceiver: KV / KDA-state transfer between ctx and gen ranks.

Core logic (backend-free): `states` (poll states), `base` (sessions, tasks), `polling` (bounded
local poll), `consensus` (one batched all-gather per check over the CP group), `bounce` (staging
pool, fan-in scatter, untrusted-plan validation). Backends are picked by
`TransceiverConfig.backend` through `backends.open_data_plane` (the one factory; `plane` declares
the `DataPlane` seam, all the sender and receiver use), which imports them lazily: `ucxx_backend`
(UCX via ucxx) and `fake` (in-process: fault injection, the real sender and receiver in tests).

Transfer path: `segments` (a shard's stream types), `layout` (which bytes a receiver gets, the
message plan), `memory_map` (each side's memory map),
`control` (the KVTransfer gRPC service's shared pieces), `grant` (a pull grant's MAC) and `cuda_ipc`
(pools exported and opened). Each side's own modules live in its subpackage, which never imports
the other: `ctx` (what a ctx worker runs: `sender.KVSender`, with `hold`, `outbound`,
`grant_issue`, `shard_request`, `control_server`) and `gen` (what a gen rank runs:
`receiver.KVReceiver`, with `inbound` and its transports behind `transport` (`granted_pull`,
`asked_pull`, `tagged_stream`), `pull`, `retract`, `control_client`; a gen world's ranks
allocate and agree through `engine.kv_intake`). Those are imported on first use (they need gRPC
and ucxx).
"""

from helixserve.clock import Clock, FakeClock, MonotonicClock
from helixserve.config_transceiver import TransceiverBackendKind, TransceiverConfig
from helixserve.transceiver.base import (
    DataPlane,
    PayloadKind,
    ReceiverSession,
    SenderSession,
    TransferHandle,
    TransferSession,
    TransferState,
)
from helixserve.transceiver.backends import load_data_plane, open_data_plane
from helixserve.transceiver.polling import PollResult, TransferMetrics, TransferPoller

_LAZY = {
    "KVSender": "ctx.sender", "SenderStats": "ctx.sender", "KVReceiver": "gen.receiver",
    "LayoutMismatchError": "layout_match", "layout_for": "layout",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"helixserve.transceiver.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'helixserve.transceiver' has no attribute {name!r}")


__all__ = [
    "Clock", "DataPlane", "FakeClock", "KVReceiver", "KVSender", "LayoutMismatchError",
    "MonotonicClock", "PayloadKind", "PollResult", "ReceiverSession", "SenderSession",
    "SenderStats", "TransceiverBackendKind", "TransceiverConfig", "TransferHandle",
    "TransferMetrics", "TransferPoller", "TransferSession", "TransferState", "layout_for", "load_data_plane",
    "open_data_plane",
]
