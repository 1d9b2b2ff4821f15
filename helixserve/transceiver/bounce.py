"""Bounce buffers: a fixed staging pool for non-contiguous KV blocks, with fan-in scatter.

- The pool is sized in whole chunks, clamped to a share of free memory, with a one-chunk floor;
  a requested size of 0, None or negative turns bouncing off (`bounce_pool_bytes` returns 0).
- Slots are allocated first-fit and reuse holes freed out of order; a full pool makes the caller
  wait (bounded, on the injected clock), it never overwrites a live region.
- Fan-in (`FanInReservation`): several writers (ctx ranks) into one reservation get disjoint
  bases. The scatter into the destination blocks runs only when every writer is terminal and all
  succeeded; a failed writer fails the request, and the region is still released only after every
  writer has finished. A region a peer might still write into is quarantined, never reused.
- A scatter plan from a peer is untrusted (`validate_scatter_plan`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helixserve.clock import Clock, MonotonicClock
from helixserve.kvcache.pools import host_zeros
from helixserve.transceiver.base import TransferState, resolve_slice, resolve_timeout

logger = logging.getLogger(__name__)


class BouncePoolFullError(TimeoutError):
    """No region of the requested size became free within the bounded wait."""


class ScatterPlanError(ValueError):
    """A peer's scatter plan is malformed or hostile."""


def bounce_pool_bytes(
    requested_bytes: int | None, chunk_bytes: int, free_bytes: int, max_share: float = 0.5
) -> int:
    """Pool size: `requested_bytes` rounded up to whole chunks, clamped to `max_share` of
    `free_bytes`, never below one chunk. 0, None or negative `requested_bytes` -> 0 (off)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if not 0 < max_share <= 1:
        raise ValueError(f"max_share must be in (0, 1], got {max_share}")
    if requested_bytes is None or requested_bytes <= 0:
        return 0
    num_chunks = math.ceil(requested_bytes / chunk_bytes)
    max_chunks = int(max(free_bytes, 0) * max_share) // chunk_bytes
    return max(1, min(num_chunks, max_chunks)) * chunk_bytes


@dataclass(frozen=True, slots=True)
class Reservation:
    """A region [offset, offset + nbytes) of the pool held by one request."""

    request_id: str
    offset: int
    nbytes: int


class BouncePool:
    """Fixed staging buffer with first-fit allocation.

    Args:
        capacity_bytes: pool size (use `bounce_pool_bytes`); > 0.
        align: every region starts and is sized on this boundary.
        buffer: optional backing uint8 tensor (pinned host or device); allocated if None.
    """

    def __init__(
        self,
        capacity_bytes: int,
        align: int = 256,
        clock: Clock | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        if capacity_bytes <= 0 or align <= 0:
            raise ValueError(f"capacity_bytes and align must be > 0, got {capacity_bytes}, {align}")
        self.capacity_bytes = capacity_bytes
        self.align = align
        self.clock: Clock = clock or MonotonicClock()
        if buffer is None:
            buffer = host_zeros((capacity_bytes,), torch.uint8)  # huge pages: faster UCX copies
        if buffer.dtype != torch.uint8 or buffer.numel() < capacity_bytes:
            raise ValueError(f"buffer must be uint8 with >= {capacity_bytes} elements")
        self.buffer = buffer
        self.freed = threading.Event()
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, nbytes), sorted
        self._live: dict[int, Reservation] = {}
        self._quarantined: dict[int, Reservation] = {}
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def quarantined(self) -> list[Reservation]:
        return list(self._quarantined.values())

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def try_reserve(self, request_id: str, nbytes: int) -> Reservation | None:
        """First-fit reservation, or None when no hole is large enough right now."""
        size = self._rounded(nbytes)
        if nbytes <= 0 or size > self.capacity_bytes:
            raise ValueError(
                f"request {request_id}: cannot reserve {nbytes} bytes in a {self.capacity_bytes}-byte pool"
            )
        with self._lock:
            for i, (offset, hole) in enumerate(self._free):
                if hole >= size:
                    if hole == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, hole - size)
                    reservation = Reservation(request_id, offset, size)
                    self._live[offset] = reservation
                    return reservation
        return None

    def reserve(
        self, request_id: str, nbytes: int, timeout_s: float | None, slice_s: float | None = None
    ) -> Reservation:
        """Reserve, waiting (bounded, in slices) for space to be released; never overwrites.

        Raises:
            BouncePoolFullError: nothing large enough was freed within `timeout_s`.
        """
        deadline = self.clock.monotonic() + resolve_timeout(timeout_s)
        slice_len = resolve_slice(slice_s)
        while True:
            self.freed.clear()
            reservation = self.try_reserve(request_id, nbytes)
            if reservation is not None:
                return reservation
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                raise BouncePoolFullError(
                    f"request {request_id}: no {nbytes}-byte bounce region free within "
                    f"{resolve_timeout(timeout_s):.3f}s (free {self.free_bytes} of "
                    f"{self.capacity_bytes} bytes, {len(self._quarantined)} quarantined)"
                )
            self.clock.wait(self.freed, min(slice_len, remaining))

    def view(self, reservation: Reservation) -> torch.Tensor:
        return self.buffer[reservation.offset : reservation.offset + reservation.nbytes]

    def release(self, reservation: Reservation) -> None:
        """Return a live region to the pool (coalescing with neighbouring holes)."""
        with self._lock:
            if self._live.get(reservation.offset) is not reservation:
                raise ValueError(f"{reservation} is not a live reservation of this pool")
            del self._live[reservation.offset]
            self._insert_hole(reservation.offset, reservation.nbytes)
        self.freed.set()

    def quarantine(self, reservation: Reservation, reason: str) -> None:
        """Hold a region a peer might still write into; it is never handed out until
        `release_quarantined` is called once the peer is known to be quiesced."""
        with self._lock:
            if self._live.pop(reservation.offset, None) is not reservation:
                raise ValueError(f"{reservation} is not a live reservation of this pool")
            self._quarantined[reservation.offset] = reservation
        logger.warning("quarantined bounce region %s: %s", reservation, reason)

    def release_quarantined(self, reservation: Reservation) -> None:
        with self._lock:
            if self._quarantined.pop(reservation.offset, None) is not reservation:
                raise ValueError(f"{reservation} is not quarantined in this pool")
            self._insert_hole(reservation.offset, reservation.nbytes)
        self.freed.set()

    def _insert_hole(self, offset: int, nbytes: int) -> None:
        holes = sorted([*self._free, (offset, nbytes)])
        merged: list[tuple[int, int]] = []
        for start, size in holes:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged


@dataclass(frozen=True, slots=True)
class ScatterEntry:
    """Copy `nbytes` from the writer's region at `src_offset` to block `dst_block` at `dst_offset`."""

    src_offset: int
    dst_block: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ScatterPlan:
    """Where one writer's bytes go (sent by a peer: untrusted)."""

    request_id: str
    writer: int
    entries: tuple[ScatterEntry, ...]


@dataclass(frozen=True, slots=True)
class ScatterTarget:
    """The destination the receiver owns for one request: its block ids and block size."""

    request_id: str
    block_ids: frozenset[int]
    block_bytes: int


def _find_overlap(intervals: list[tuple[int, int]]) -> tuple[int, int] | None:
    ordered = sorted(intervals)
    for (a_start, a_end), (b_start, b_end) in zip(ordered, ordered[1:]):
        if b_start < a_end:
            return (a_start, a_end), (b_start, b_end)  # type: ignore[return-value]
    return None


def validate_scatter_plan(
    plan: ScatterPlan,
    writer_bytes: dict[int, int],
    target: ScatterTarget,
    accepted: dict[int, ScatterPlan],
) -> None:
    """Reject a malformed or hostile plan with a clear error (raises ScatterPlanError).

    Checks: request id, unknown or duplicate writer, entry sizes and offsets in range of the
    writer's region and of a block, destination blocks owned by this request, no overlap of
    source ranges or of destination ranges (also against already accepted writers' plans), and
    that the entries cover exactly the writer's declared byte count.
    """
    who = f"scatter plan of writer {plan.writer} for request {plan.request_id}"
    if plan.request_id != target.request_id:
        raise ScatterPlanError(f"{who} was sent for request {target.request_id}")
    if plan.writer not in writer_bytes:
        raise ScatterPlanError(f"{who}: unknown writer (expected {sorted(writer_bytes)})")
    if plan.writer in accepted:
        raise ScatterPlanError(f"{who}: duplicate writer, a plan was already accepted")
    size = writer_bytes[plan.writer]
    for e in plan.entries:
        if e.nbytes <= 0:
            raise ScatterPlanError(f"{who}: wrong size {e.nbytes} in {e}")
        if e.src_offset < 0 or e.src_offset + e.nbytes > size:
            raise ScatterPlanError(f"{who}: source range of {e} outside the writer's {size} bytes")
        if e.dst_block not in target.block_ids:
            raise ScatterPlanError(f"{who}: block {e.dst_block} belongs to another request")
        if e.dst_offset < 0 or e.dst_offset + e.nbytes > target.block_bytes:
            raise ScatterPlanError(f"{who}: destination range of {e} outside a {target.block_bytes}-byte block")
    overlap = _find_overlap([(e.src_offset, e.src_offset + e.nbytes) for e in plan.entries])
    if overlap:
        raise ScatterPlanError(f"{who}: overlapping source ranges {overlap}")
    dst = [(e.dst_block, e.dst_offset, e.dst_offset + e.nbytes)
           for p in (*accepted.values(), plan) for e in p.entries]
    for block in {d[0] for d in dst}:
        overlap = _find_overlap([(s, t) for b, s, t in dst if b == block])
        if overlap:
            raise ScatterPlanError(f"{who}: overlapping destination ranges {overlap} in block {block}")
    covered = sum(e.nbytes for e in plan.entries)
    if covered != size:
        raise ScatterPlanError(f"{who}: wrong size, entries cover {covered} of {size} bytes")


@dataclass
class _Writer:
    nbytes: int
    base: int
    state: TransferState = TransferState.PENDING
    is_quiesced: bool = True


@dataclass
class FanInReservation:
    """One request's bounce region shared by several writers with disjoint bases.

    Lifecycle: writers write into `writer_view(w)` and send a plan (`accept_plan`); the owner
    reports each writer's end with `writer_done`; `advance(block_view)` scatters and releases
    once every writer is terminal (FAILED if any writer failed or a plan is missing).
    """

    pool: BouncePool
    target: ScatterTarget
    reservation: Reservation
    writers: dict[int, _Writer]
    plans: dict[int, ScatterPlan] = field(default_factory=dict)
    state: TransferState = TransferState.TRANSFERRING
    error: str | None = None

    @classmethod
    def reserve(
        cls, pool: BouncePool, target: ScatterTarget, writer_bytes: dict[int, int],
        timeout_s: float | None, slice_s: float | None = None,
    ) -> FanInReservation:
        if not writer_bytes or any(n <= 0 for n in writer_bytes.values()):
            raise ValueError(f"request {target.request_id}: bad writer sizes {writer_bytes}")
        bases, total = {}, 0
        for writer in sorted(writer_bytes):
            bases[writer] = total
            total += pool._rounded(writer_bytes[writer])
        reservation = pool.reserve(target.request_id, total, timeout_s, slice_s)
        writers = {w: _Writer(writer_bytes[w], reservation.offset + bases[w]) for w in bases}
        return cls(pool, target, reservation, writers)

    def base(self, writer: int) -> int:
        """Byte offset of `writer`'s region in the pool buffer."""
        return self.writers[writer].base

    def writer_view(self, writer: int) -> torch.Tensor:
        w = self.writers[writer]
        return self.pool.buffer[w.base : w.base + w.nbytes]

    def accept_plan(self, plan: ScatterPlan) -> None:
        validate_scatter_plan(plan, {w: s.nbytes for w, s in self.writers.items()}, self.target, self.plans)
        self.plans[plan.writer] = plan

    def writer_done(self, writer: int, state: TransferState, is_quiesced: bool = True) -> None:
        """Record a writer's end; `is_quiesced=False` if the peer might still write."""
        if writer not in self.writers:
            raise ValueError(f"request {self.target.request_id}: unknown writer {writer}")
        if not state.is_settled:
            raise ValueError(f"writer {writer}: {state} is not an end state")
        self.writers[writer].state, self.writers[writer].is_quiesced = state, is_quiesced

    def advance(self, block_view: Callable[[int], torch.Tensor]) -> TransferState:
        """Scatter + release once every writer is terminal; returns the request's state."""
        if self.state.is_settled or not all(w.state.is_settled for w in self.writers.values()):
            return self.state
        bad = {i: w.state.value for i, w in self.writers.items() if w.state is not TransferState.COMPLETED}
        missing = sorted(set(self.writers) - set(self.plans))
        if bad or missing:
            self.state = TransferState.FAILED
            self.error = (f"request {self.target.request_id}: writers {bad} did not complete"
                          if bad else f"request {self.target.request_id}: no scatter plan from writers {missing}")
        else:
            for writer, plan in self.plans.items():
                base = self.writers[writer].base
                for e in plan.entries:
                    block = block_view(e.dst_block)
                    block[e.dst_offset : e.dst_offset + e.nbytes].copy_(
                        self.pool.buffer[base + e.src_offset : base + e.src_offset + e.nbytes])
            self.state = TransferState.COMPLETED
        if all(w.is_quiesced for w in self.writers.values()):
            self.pool.release(self.reservation)
        else:
            self.pool.quarantine(self.reservation, f"request {self.target.request_id}: a writer may still write")
        return self.state
