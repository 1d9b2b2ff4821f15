"""Bounce-buffer rules of reference/transceiver.md (injected clock, no sleeps)."""

from __future__ import annotations

import pytest
import torch

from helixserve.clock import FakeClock
from helixserve.config_transceiver import TransceiverConfig
from helixserve.transceiver.base import TransferState
from helixserve.transceiver.bounce import (
    BouncePool,
    BouncePoolFullError,
    FanInReservation,
    ScatterEntry,
    ScatterPlan,
    ScatterPlanError,
    ScatterTarget,
    bounce_pool_bytes,
)

MIB = 1 << 20
BLOCK = 64
OK, FAILED, TIMEOUT = TransferState.COMPLETED, TransferState.FAILED, TransferState.TIMEOUT


def test_bounded_polling_bounce_pool_sized_in_whole_chunks():
    chunk = 32 * MIB
    assert bounce_pool_bytes(100 * MIB, chunk, free_bytes=8 << 30) == 128 * MIB  # rounded up
    assert bounce_pool_bytes(10 << 30, chunk, free_bytes=1 << 30, max_share=0.5) == 512 * MIB
    assert bounce_pool_bytes(10 << 30, chunk, free_bytes=1 * MIB) == chunk  # one-chunk floor
    for off in (0, None, -1):
        assert bounce_pool_bytes(off, chunk, free_bytes=1 << 30) == 0
        assert TransceiverConfig(kv_transfer_timeout_ms=1, bounce_size_bytes=off).bounce_size_bytes is None
    with pytest.raises(ValueError, match="chunk_bytes"):
        bounce_pool_bytes(1, 0, free_bytes=1)


def test_bounded_polling_bounce_first_fit_reuses_holes_freed_out_of_order():
    pool = BouncePool(1000, align=100)
    a, b, c = (pool.try_reserve(r, 100) for r in "abc")
    pool.release(b)  # a hole in the middle, freed before a and c
    d = pool.try_reserve("d", 50)
    assert d.offset == 100  # first fit, not the tail
    e = pool.try_reserve("e", 200)
    assert e.offset == 300
    pool.release(a)
    pool.release(d)  # now [0, 200) is one coalesced hole
    f = pool.try_reserve("f", 200)
    assert f.offset == 0
    with pytest.raises(ValueError, match="not a live reservation"):
        pool.release(a)
    with pytest.raises(ValueError, match="cannot reserve"):
        pool.try_reserve("huge", 1001)
    assert c.offset == 200


def test_bounded_polling_bounce_full_pool_waits_bounded_never_overwrites():
    clock = FakeClock()
    pool = BouncePool(256, align=128, clock=clock)
    first = pool.try_reserve("a", 128)
    second = pool.try_reserve("b", 128)
    pool.view(first).fill_(7)
    with pytest.raises(BouncePoolFullError, match="request c: no 128-byte bounce region"):
        pool.reserve("c", 128, timeout_s=0.5, slice_s=0.1)
    assert clock.monotonic() == pytest.approx(0.5) and max(clock.waits) <= 0.1
    assert bool((pool.view(first) == 7).all())  # the live region was not touched
    clock.call_later(0.25, lambda: pool.release(second))
    third = pool.reserve("c", 128, timeout_s=1.0, slice_s=0.1)
    assert third.offset == second.offset and clock.monotonic() == pytest.approx(0.75)


def _fan_in(pool, writer_bytes, blocks=(10, 11, 12, 13), request_id="req"):
    target = ScatterTarget(request_id, frozenset(blocks), BLOCK)
    return FanInReservation.reserve(pool, target, writer_bytes, timeout_s=1.0)


def _plan(writer, pairs, request_id="req", nbytes=BLOCK):
    """pairs: (src_offset, dst_block[, dst_offset])"""
    return ScatterPlan(request_id, writer, tuple(
        ScatterEntry(p[0], p[1], p[2] if len(p) > 2 else 0, nbytes) for p in pairs))


def test_bounded_polling_bounce_fan_in_writers_get_disjoint_bases():
    pool = BouncePool(4096, align=64)
    fan_in = _fan_in(pool, {0: 2 * BLOCK, 1: 100, 2: BLOCK})
    ranges = sorted((fan_in.base(w), fan_in.base(w) + n) for w, n in {0: 128, 1: 100, 2: 64}.items())
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    assert fan_in.base(1) % 64 == 0 and fan_in.writer_view(1).numel() == 100


def test_bounded_polling_bounce_scatter_only_after_every_writer_terminal():
    pool = BouncePool(4096, align=64)
    fan_in = _fan_in(pool, {0: 2 * BLOCK, 1: 2 * BLOCK})
    blocks = {b: torch.zeros(BLOCK, dtype=torch.uint8) for b in (10, 11, 12, 13)}
    fan_in.writer_view(0).copy_(torch.arange(128, dtype=torch.uint8))
    fan_in.writer_view(1).copy_(torch.arange(128, 256, dtype=torch.uint8))
    fan_in.accept_plan(_plan(0, [(0, 10), (64, 12)]))
    fan_in.accept_plan(_plan(1, [(0, 11), (64, 13)]))
    fan_in.writer_done(0, OK)
    assert fan_in.advance(blocks.__getitem__) is TransferState.TRANSFERRING
    assert all(int(b.sum()) == 0 for b in blocks.values()) and pool.free_bytes < 4096
    fan_in.writer_done(1, OK)
    assert fan_in.advance(blocks.__getitem__) is OK
    got = torch.cat([blocks[b] for b in (10, 11, 12, 13)])
    assert torch.equal(got, torch.arange(256, dtype=torch.uint8)[torch.tensor(
        [*range(0, 64), *range(128, 192), *range(64, 128), *range(192, 256)])])
    assert pool.free_bytes == 4096


def test_bounded_polling_bounce_failed_writer_fails_request_released_after_all_writers():
    pool = BouncePool(4096, align=64)
    fan_in = _fan_in(pool, {0: BLOCK, 1: BLOCK})
    blocks = {b: torch.zeros(BLOCK, dtype=torch.uint8) for b in (10, 11, 12, 13)}
    fan_in.writer_view(0).fill_(9)
    fan_in.accept_plan(_plan(0, [(0, 10)]))
    fan_in.writer_done(0, FAILED)
    assert fan_in.advance(blocks.__getitem__) is TransferState.TRANSFERRING  # writer 1 still busy
    assert pool.free_bytes == 4096 - 128  # region still held
    fan_in.writer_done(1, OK)
    assert fan_in.advance(blocks.__getitem__) is FAILED and "writers {0: 'failed'}" in fan_in.error
    assert int(blocks[10].sum()) == 0  # no scatter of a failed request
    assert pool.free_bytes == 4096


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (_plan(0, [(0, 10)], nbytes=0), "wrong size 0"),
        (_plan(0, [(0, 10)]), "wrong size, entries cover 64 of 128"),
        (_plan(0, [(0, 10), (32, 11)]), "overlapping source"),
        (_plan(0, [(0, 10), (64, 12, 0)], nbytes=BLOCK), None),  # valid control case
        (_plan(0, [(0, 13), (64, 12)]), "overlapping destination"),  # 13 is writer 1's
        (_plan(0, [(96, 10), (0, 11)]), "source range"),
        (_plan(0, [(-64, 10), (0, 11)]), "source range"),
        (_plan(0, [(0, 10, 32), (64, 11)]), "destination range"),
        (_plan(0, [(0, 10), (64, 99)]), "block 99 belongs to another request"),
        (_plan(1, [(0, 12)]), "duplicate writer"),
        (_plan(5, [(0, 12)]), r"unknown writer \(expected \[0, 1\]\)"),
        (_plan(0, [(0, 10), (64, 11)], request_id="other"), "was sent for request req"),
    ],
)
def test_bounded_polling_bounce_untrusted_scatter_plans_rejected(plan, message):
    pool = BouncePool(4096, align=64)
    fan_in = _fan_in(pool, {0: 2 * BLOCK, 1: BLOCK})
    fan_in.accept_plan(_plan(1, [(0, 13)]))  # writer 1 already accepted
    if message is None:
        fan_in.accept_plan(plan)
        return
    with pytest.raises(ScatterPlanError, match=message):
        fan_in.accept_plan(plan)


def test_bounded_polling_bounce_missing_plan_fails_request():
    pool = BouncePool(4096, align=64)
    fan_in = _fan_in(pool, {0: BLOCK})
    fan_in.writer_done(0, OK)
    assert fan_in.advance(lambda b: torch.zeros(BLOCK, dtype=torch.uint8)) is FAILED
    assert "no scatter plan from writers [0]" in fan_in.error and pool.free_bytes == 4096


def test_bounded_polling_bounce_quarantine_holds_region_a_peer_may_still_write():
    clock = FakeClock()
    pool = BouncePool(128, align=128, clock=clock)
    fan_in = _fan_in(pool, {0: BLOCK})
    fan_in.writer_done(0, TIMEOUT, is_quiesced=False)  # the peer may still be writing
    assert fan_in.advance(lambda b: torch.zeros(BLOCK, dtype=torch.uint8)) is FAILED
    assert pool.quarantined == [fan_in.reservation] and pool.free_bytes == 0
    assert pool.try_reserve("next", 64) is None  # never reused while quarantined
    with pytest.raises(BouncePoolFullError):
        pool.reserve("next", 64, timeout_s=0.05)
    pool.release_quarantined(fan_in.reservation)  # the peer is known quiesced now
    assert pool.try_reserve("next", 64).offset == 0
