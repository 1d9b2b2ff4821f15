"""The one owner of a ctx request's life: :class:`CtxRequestLife`, a table of explicit states.

A ``context_only`` request passes these states; each move is one typed event, and nothing else
records where a ctx request is:

1. **PREFILLING** (:class:`Admitted`): admitted into the engine with its cache held on finish.
   A second request with an id in the table is refused (:class:`DuplicateRequestError`, 400)
   before it reaches the engine: a refused request never touches the holder's cache.
2. **HELD** (:class:`Prefilled`): the prompt is in the cache and the first token known; the
   hold deadline starts (a hold never offered is freed by :class:`Expired` past it).
3. **SENDING** (:class:`Offered`): the KV sender took it; from now on only the sender decides
   when the cache may be freed (every gen rank acknowledged, cancelled, or its own deadline,
   and only once no send can still read the blocks).
4. **RELEASED** (terminal; the entry is dropped): :class:`SenderFreed` from SENDING;
   :class:`Finished` from PREFILLING (refused, failed, aborted) or HELD (finished at its first
   token, or the sender did not take it); :class:`Expired`, :class:`ReleaseRequested` or
   :class:`CancelRequested` from HELD; :class:`Stopped` from any state (the worker stops).

A :class:`Transition` says whether the move freed a cache the engine still holds
(:attr:`Transition.frees_held_cache`: leaving HELD or SENDING for RELEASED); its owner releases
the engine's hold in the same engine-thread call, so the table and the scheduler's holds never
disagree. Leaving PREFILLING never frees anything: the engine's own abort or failure did.

Threads: the table is bookkeeping only (no engine, no locks); :mod:`.ctx_requests` applies every event
on the engine thread. Events that name an admission (``token``) apply only to that admission, so
a stale event of an earlier request with the same id changes nothing. An event the state does not
allow raises :class:`IllegalTransitionError` naming the request, its state and the event.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from helixserve.clock import Clock, MonotonicClock
from helixserve.engine.errors import DuplicateRequestIdError


class CtxState(enum.Enum):
    PREFILLING = "prefilling"
    HELD = "held"
    SENDING = "sending"
    RELEASED = "released"


class ReleaseCause(enum.Enum):
    REFUSED = "refused by the engine"
    FAILED = "failed or aborted before its first token"
    FINISHED = "finished at its first token"
    OFFER_FAILED = "the KV sender did not take it"
    SENT = "freed by the KV sender"
    EXPIRED = "not offered within the hold deadline"
    RELEASED = "released by the router"
    CANCELLED = "cancelled (client gone)"
    STOPPED = "the ctx worker stopped"


class IllegalTransitionError(RuntimeError):
    """An event the request's state does not allow (a bug in the caller, never the client's)."""

    def __init__(self, request_id: str, state: CtxState | None, event: object) -> None:
        where = state.value if state is not None else "not in the table"
        super().__init__(f"ctx request {request_id!r} is {where}: {type(event).__name__} not allowed")
        self.request_id, self.state, self.event = request_id, state, event


class DuplicateRequestError(DuplicateRequestIdError):
    """A request with this id is alive on this ctx worker (a 400 ``duplicate_request_id`` to the
    client, through ``serving.engine_errors``)."""


# -- events ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    token: int  # this admission (see the module docstring)


@dataclass(frozen=True, slots=True)
class Prefilled:
    request_id: str
    token: int
    first_gen_tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Offered:
    request_id: str
    token: int


@dataclass(frozen=True, slots=True)
class Finished:
    """The handler is done with it before the sender took it (see :class:`ReleaseCause`)."""

    request_id: str
    token: int
    cause: ReleaseCause


@dataclass(frozen=True, slots=True)
class SenderFreed:
    request_id: str


@dataclass(frozen=True, slots=True)
class Expired:
    request_id: str


@dataclass(frozen=True, slots=True)
class ReleaseRequested:
    """The router is done with the admission ``token`` (the ctx answer's ``ctx_admission``): a
    late release never frees a later request that reused the id."""

    request_id: str
    token: int


@dataclass(frozen=True, slots=True)
class CancelRequested:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stopped:
    request_id: str


Event = (Admitted | Prefilled | Offered | Finished | SenderFreed | Expired | ReleaseRequested
         | CancelRequested | Stopped)


# events that name an id which may have left (or never entered) the table: nothing happens
_NO_OPS_WHEN_ABSENT = (Prefilled, Offered, Finished, ReleaseRequested, CancelRequested)


@dataclass(slots=True)
class CtxRequestState:
    request_id: str
    token: int
    state: CtxState = CtxState.PREFILLING
    first_gen_tokens: tuple[int, ...] = ()
    deadline: float = float("inf")  # clock() time after which a HELD entry expires
    is_cancelled: bool = False  # the client left while it was prefilling


@dataclass(frozen=True, slots=True)
class Transition:
    request_id: str
    before: CtxState | None  # None: the event changed nothing (see ``apply``)
    after: CtxState | None
    cause: ReleaseCause | None = None

    @property
    def frees_held_cache(self) -> bool:
        """The engine holds this request's cache and must release it now."""
        return self.after is CtxState.RELEASED and self.before in (CtxState.HELD, CtxState.SENDING)


@dataclass(slots=True)
class CtxRequestLife:
    """Every live ctx request's state by request id (see the module docstring)."""

    timeout_s: float  # hold deadline of a HELD entry not offered
    clock: Clock = field(default_factory=MonotonicClock)
    entries: dict[str, CtxRequestState] = field(default_factory=dict)
    num_released: int = 0  # held caches freed (any cause)
    num_expired: int = 0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"hold timeout must be > 0 s, got {self.timeout_s}")

    @property
    def num_live(self) -> int:
        return len(self.entries)

    def state_of(self, request_id: str) -> CtxState | None:
        entry = self.entries.get(request_id)
        return entry.state if entry is not None else None

    def get(self, request_id: str) -> CtxRequestState | None:
        return self.entries.get(request_id)

    def due(self) -> list[str]:
        """HELD entries past their deadline (for :class:`Expired`)."""
        now = self.clock.monotonic()
        return [rid for rid, e in self.entries.items() if e.state is CtxState.HELD and e.deadline <= now]

    def apply(self, event: Event) -> Transition:
        """Move the event's request. A :class:`Transition` with ``before is None`` when the event
        names an admission no longer in the table (stale) or an id a caller named that is not
        here (release / cancel): nothing to do."""
        rid = event.request_id
        entry = self.entries.get(rid)
        if isinstance(event, Admitted):
            if entry is not None:
                raise DuplicateRequestError(f"request id {rid!r} is already {entry.state.value} here", request_id=rid)
            self.entries[rid] = CtxRequestState(rid, event.token)
            return Transition(rid, None, CtxState.PREFILLING)
        if entry is None or getattr(event, "token", entry.token) != entry.token:
            if isinstance(event, _NO_OPS_WHEN_ABSENT):  # stale admission, or a caller's id
                return Transition(rid, None, None)
            raise IllegalTransitionError(rid, None, event)
        return self._move(entry, event)

    def _move(self, entry: CtxRequestState, event: Event) -> Transition:
        state = entry.state
        if isinstance(event, Prefilled) and state is CtxState.PREFILLING:
            if entry.is_cancelled:  # the engine's abort freed it
                return self._release(entry, ReleaseCause.CANCELLED)
            entry.first_gen_tokens = tuple(event.first_gen_tokens)
            entry.deadline = self.clock.monotonic() + self.timeout_s
            return self._to(entry, CtxState.HELD)
        if isinstance(event, Offered) and state is CtxState.HELD:
            return self._to(entry, CtxState.SENDING)
        if isinstance(event, Finished) and state in (CtxState.PREFILLING, CtxState.HELD):
            return self._release(entry, event.cause)
        if isinstance(event, SenderFreed) and state is CtxState.SENDING:
            return self._release(entry, ReleaseCause.SENT)
        if isinstance(event, Expired) and state is CtxState.HELD:
            return self._release(entry, ReleaseCause.EXPIRED)
        if isinstance(event, (ReleaseRequested, CancelRequested)) and state is not CtxState.HELD:
            if isinstance(event, CancelRequested) and state is CtxState.PREFILLING:
                entry.is_cancelled = True
            return Transition(entry.request_id, state, state)  # the engine / the sender frees it
        if isinstance(event, ReleaseRequested):
            return self._release(entry, ReleaseCause.RELEASED)
        if isinstance(event, CancelRequested):
            return self._release(entry, ReleaseCause.CANCELLED)
        if isinstance(event, Stopped):
            return self._release(entry, ReleaseCause.STOPPED)
        raise IllegalTransitionError(entry.request_id, state, event)

    def _to(self, entry: CtxRequestState, state: CtxState) -> Transition:
        before, entry.state = entry.state, state
        return Transition(entry.request_id, before, state)

    def _release(self, entry: CtxRequestState, cause: ReleaseCause) -> Transition:
        del self.entries[entry.request_id]
        transition = Transition(entry.request_id, entry.state, CtxState.RELEASED, cause)
        entry.state = CtxState.RELEASED
        if transition.frees_held_cache:
            self.num_released += 1
            self.num_expired += cause is ReleaseCause.EXPIRED
        return transition
