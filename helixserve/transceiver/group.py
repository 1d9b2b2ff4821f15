"""A gen rank's receiver that allocates its shards and agrees with its CP group (consensus).

Per executor step, on every rank of the group (the ranks that share requests):

1. `begin(request_id, params)` for the requests the (broadcast) schedule assigned to the group in
   this step: the ctx layout is checked first (a mismatch raises `LayoutMismatchError` naming the
   fields; nothing is allocated), then the shard's blocks and slot are allocated in this rank's
   `CacheManager` (`CacheCapacityError` if they do not fit; the accounting is CP-group-uniform,
   so every rank raises alike) and the transfer starts.
2. `check()`: one bounded local poll, then ONE batched all-gather (`consensus.TransferConsensus`)
   of every rank's `[cancelled, failed, completed, quiesced]` plus the causes of failures:
   - `ready`: complete on every rank -> may start decoding (`EngineCore.add_prefilled_request`);
     the cache handle now belongs to the engine;
   - `failed`: failed or cancelled on any rank -> failed everywhere, reported once with the
     first rank's cause; a rank still receiving it stops (drains, then closes);
   - `freed`: failed/cancelled requests quiesced on every rank: their blocks were freed.

Every rank must call `check` the same number of times (once per step): it is a collective.

The servers do not run this class: a gen world's engine allocates through its scheduler and
agrees through `engine.kv_intake.RankTransfers`, over the same `KVReceiver` and the same
`TransferConsensus`. This is the transceiver's own driver of both, for its multi-rank tests
without an engine; `bench/transceiver.py` measures the engine's driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.cache_layout import ModelCaches
from helixserve.kvcache.manager import CacheHandle, CacheManager
from helixserve.protocol.disagg import DisaggregatedParams
from helixserve.transceiver.base import TransferState
from helixserve.transceiver.consensus import LocalStatus, TransferConsensus
from helixserve.transceiver.control import target
from helixserve.transceiver.layout import check_layout
from helixserve.transceiver.receiver import KVReceiver


@dataclass(slots=True)
class ReadyRequest:
    """A request whose shard is complete on every rank of the group; it may start decoding."""

    request_id: str
    handle: CacheHandle
    prompt_token_ids: list[int]
    first_gen_tokens: list[int]


@dataclass(slots=True)
class TransferCheck:
    """One `check()`; identical on every rank of the group."""

    ready: list[ReadyRequest] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # newly failed/cancelled -> one cause
    freed: list[str] = field(default_factory=list)


class CPGroupReceiver:
    """Allocating, consensus-checked receiver of one gen rank.

    Args:
        receiver: this rank's `KVReceiver` (its cp_rank / cp_size must match `cache_manager`).
        cache_manager / caches: this rank's cache accounting and pools.
        consensus: the group's consensus (None: a group of one, e.g. cp = 1).
    """

    def __init__(self, receiver: KVReceiver, cache_manager: CacheManager, caches: ModelCaches,
                 consensus: TransferConsensus | None = None) -> None:
        if (receiver.cp_rank, receiver.cp_size) != (cache_manager.cp_rank, cache_manager.cp_size):
            raise ValueError(f"receiver is cp {receiver.cp_rank}/{receiver.cp_size}, the cache manager "
                             f"{cache_manager.cp_rank}/{cache_manager.cp_size}")
        self.receiver = receiver
        self.cache_manager = cache_manager
        self.caches = caches
        self.consensus = consensus or TransferConsensus(is_local=True)
        self._reported: set[str] = set()

    def begin(self, request_id: str, params: DisaggregatedParams) -> CacheHandle:
        """Allocate and start receiving (see stage 1 of the module docstring)."""
        self.consensus.mark_active()  # every rank of the group calls begin in the same step
        if not params.is_generation_only:
            raise ValueError(f"request {request_id}: disaggregated_params must be generation_only")
        check_layout(self.receiver.layout, params.layout, "gen", f"ctx worker {target(params.ctx_endpoint)}")
        handle = self.cache_manager.allocate(request_id, len(params.prompt_token_ids))
        try:
            self.receiver.start(request_id, handle, self.caches, params)
        except BaseException:
            self.cache_manager.free(request_id)
            raise
        return handle

    def check(self) -> TransferCheck:
        """One bounded local poll + one consensus collective; see the module docstring."""
        rx = self.receiver
        rx.progress()
        sessions = rx.poller.sessions
        by_state = {state: [rid for rid, s in sessions.items() if s.state is state] for state in TransferState}
        status = LocalStatus.of(
            cancelled=by_state[TransferState.CANCELLED],
            failed=by_state[TransferState.FAILED] + by_state[TransferState.TIMEOUT],
            completed=by_state[TransferState.COMPLETED],
            quiesced=[rid for rid, s in sessions.items() if s.state.is_settled and s.is_quiesced])
        errors = {rid: rx.error_of(rid) for rid in status.failed | status.cancelled}
        agreed = self.consensus.check(status, errors)
        out = TransferCheck()
        for request_id in sorted(agreed.failed | agreed.cancelled):
            if request_id in sessions:
                rx.fail(request_id, f"request {request_id} failed on another rank of the CP group")
            if request_id not in self._reported:
                self._reported.add(request_id)
                out.failed[request_id] = agreed.errors.get(request_id) or f"request {request_id}: KV transfer failed"
        for request_id in sorted(agreed.ready):
            inbound = rx.inbounds[request_id]
            rx.forget(request_id)
            out.ready.append(ReadyRequest(request_id, inbound.handle, list(inbound.params.prompt_token_ids),
                                          list(inbound.params.first_gen_tokens)))
        for request_id in sorted(agreed.retirable & set(sessions)):
            rx.forget(request_id)
            self.cache_manager.free(request_id)
            self._reported.discard(request_id)
            out.freed.append(request_id)
        return out

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel a transfer (client gone); a later `check` reports it failed and frees it.
        Call on every rank of the group (or on one: the group still agrees it is cancelled)."""
        session = self.receiver.poller.sessions.get(request_id)
        if session is None:
            return False
        session.cancel(reason)
        return True

    def close(self) -> None:
        self.receiver.close()
