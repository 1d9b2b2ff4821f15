"""The one owner of a gen world request's life on rank 0: :class:`GenRequestLife`.

The :class:`~helixserve.engine.spmd.driver.WorldDriver` (on the gen engine's thread) moves each
request through these states with typed events, and keeps no other record of where it is:

1. **AWAITING_CACHE** (:class:`Added` with KV from a ctx worker): queued for its CP group; the
   next plan carries its ``AddCommand``.
2. **RECEIVING** (:class:`Dispatched`): the plan went out; each rank of the group allocates its
   shard and receives it, and the group's ranks agree on the outcome among themselves, through
   the transceiver's consensus (:class:`~helixserve.transceiver.consensus.TransferConsensus`,
   one all-gather over the CP group per step): rank 0 only hears the group leader's result.
3. **DECODING** (:class:`DecodingStarted`: the group's first tokens, once every rank of the group
   had its shard; or :class:`Added` for a request without KV, prefilled by the group): in its
   group's scheduler.
4. **FINISHED** (terminal; the entry is dropped) on :class:`Finished` (the group finished or
   failed it, a failed transfer on any rank included) or :class:`Aborted`; a ``hold_cache``
   request finished by stop / length is **HELD** first, until :class:`Released` (or
   :class:`Aborted`).

Only AWAITING_CACHE .. DECODING are *live* (they count against their group's load). An event the
state does not allow raises :class:`IllegalTransitionError` naming the request, its state and the
event. Bookkeeping only: no torch, no collectives, no locks (one thread owns it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class GenState(enum.Enum):
    AWAITING_CACHE = "awaiting cache"
    RECEIVING = "receiving"
    DECODING = "decoding"
    HELD = "held"
    FINISHED = "finished"

    @property
    def is_live(self) -> bool:
        return self not in (GenState.HELD, GenState.FINISHED)


class IllegalTransitionError(RuntimeError):
    """An event the request's state does not allow (a bug in the driver, never the client's)."""

    def __init__(self, request_id: str, state: GenState | None, event: object) -> None:
        where = state.value if state is not None else "not in the world"
        super().__init__(f"gen request {request_id!r} is {where}: {type(event).__name__} not allowed")
        self.request_id, self.state, self.event = request_id, state, event


@dataclass(frozen=True, slots=True)
class Added:
    request_id: str
    dp_rank: int
    cost: int  # load on its CP group while live (prompt + max_tokens)
    has_kv: bool = False
    hold_cache: bool = False


@dataclass(frozen=True, slots=True)
class Dispatched:
    request_id: str


@dataclass(frozen=True, slots=True)
class DecodingStarted:
    request_id: str


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    keeps_cache: bool = False  # finished by stop / length: a hold_cache request is HELD


@dataclass(frozen=True, slots=True)
class Aborted:
    request_id: str


@dataclass(frozen=True, slots=True)
class Released:
    request_id: str


Event = Added | Dispatched | DecodingStarted | Finished | Aborted | Released


@dataclass(slots=True)
class GenRequestState:
    request_id: str
    dp_rank: int
    cost: int
    hold_cache: bool
    state: GenState


@dataclass(slots=True)
class GenRequestLife:
    """Every request of the world by id (see the module docstring)."""

    entries: dict[str, GenRequestState] = field(default_factory=dict)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    def get(self, request_id: str) -> GenRequestState | None:
        return self.entries.get(request_id)

    def state_of(self, request_id: str) -> GenState | None:
        entry = self.entries.get(request_id)
        return entry.state if entry is not None else None

    def in_state(self, state: GenState) -> list[GenRequestState]:
        return [e for e in self.entries.values() if e.state is state]

    def live_ids(self) -> list[str]:
        return [rid for rid, e in self.entries.items() if e.state.is_live]

    @property
    def num_live(self) -> int:
        return sum(e.state.is_live for e in self.entries.values())

    def apply(self, event: Event) -> tuple[GenState | None, GenState]:
        """Move the event's request; returns ``(before, after)`` (``before`` None: added)."""
        rid = event.request_id
        entry = self.entries.get(rid)
        if isinstance(event, Added):
            if entry is not None:
                raise ValueError(f"request id {rid!r} is already in the world ({entry.state.value})")
            state = GenState.AWAITING_CACHE if event.has_kv else GenState.DECODING
            self.entries[rid] = GenRequestState(rid, event.dp_rank, event.cost, event.hold_cache, state)
            return None, state
        if entry is None:
            raise IllegalTransitionError(rid, None, event)
        before = entry.state
        after = self._next(entry, event)
        if after is None:
            raise IllegalTransitionError(rid, before, event)
        entry.state = after
        if after is GenState.FINISHED:
            del self.entries[rid]
        return before, after

    @staticmethod
    def _next(entry: GenRequestState, event: Event) -> GenState | None:
        state = entry.state
        if isinstance(event, Dispatched):
            return GenState.RECEIVING if state is GenState.AWAITING_CACHE else None
        if isinstance(event, DecodingStarted):
            return GenState.DECODING if state is GenState.RECEIVING else None
        if isinstance(event, Finished):
            if not state.is_live:
                return None
            return GenState.HELD if event.keeps_cache and entry.hold_cache else GenState.FINISHED
        if isinstance(event, Aborted):
            return GenState.FINISHED if state is not GenState.FINISHED else None
        if isinstance(event, Released):
            return GenState.FINISHED if state is GenState.HELD else None
        return None
