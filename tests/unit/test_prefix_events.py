"""The prefix pool's block-stored / block-removed events (torch-free): a bounded ring numbered
from 1, a reader behind the ring (or ahead of it, or new) answered with a resync of the keys
cached now, and the pool recording publish, eviction, rollback and reset."""

from __future__ import annotations

import pytest

from helixserve.kvcache.prefix_events import PrefixEventKind, PrefixEventLog
from helixserve.kvcache.prefix_index import PrefixBlockPool, append_block_keys, root_key

STORED, REMOVED = PrefixEventKind.STORED, PrefixEventKind.REMOVED


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_events_after_a_number_in_the_ring_and_nothing_after_the_last():
    log = PrefixEventLog(4, epoch="e1")
    log.stored(_key(1))
    log.stored(_key(2))
    log.removed(_key(1))
    got = log.since(1)
    assert not got.is_resync and got.seq == 3 and got.epoch == "e1"
    assert [(e.seq, e.kind, e.key) for e in got.events] == [(2, STORED, _key(2)), (3, REMOVED, _key(1))]
    assert log.since(3).events == () and not log.since(3).is_resync
    assert [e.seq for e in log.since(0).events] == [1, 2, 3]  # nothing dropped yet: 0 is in reach


def test_the_ring_is_bounded_and_a_reader_behind_it_resyncs_to_the_cached_keys():
    log = PrefixEventLog(3)
    for i in range(1, 6):
        log.stored(_key(i))
    log.removed(_key(2))  # events 1..6; the ring keeps 4..6
    assert len(log.since(3).events) == 3  # exactly at the ring's edge: every event after 3 is kept
    behind = log.since(2)  # event 3 has left the ring
    assert behind.is_resync and behind.events == () and behind.seq == 6
    assert behind.blocks == (_key(1), _key(3), _key(4), _key(5))
    assert log.since(2, max_blocks=2).blocks == (_key(4), _key(5))  # the newest ones
    for since in (None, 7, -5):  # new reader, a number this log never gave, absurd
        assert log.since(since).is_resync


def test_a_new_log_has_a_new_epoch_and_bad_bounds_are_refused():
    assert PrefixEventLog(1).epoch != PrefixEventLog(1).epoch
    with pytest.raises(ValueError, match="capacity >= 1, got 0"):
        PrefixEventLog(0)
    with pytest.raises(ValueError, match="max_blocks must be >= 1, got 0"):
        PrefixEventLog(1).since(None, max_blocks=0)


def test_the_pool_records_publish_eviction_rollback_and_reset():
    log = PrefixEventLog(64)
    pool = PrefixBlockPool(2, log)
    tokens = [1, 2, 3, 4]
    keys = append_block_keys([], tokens, 2, None)
    a, b = pool.allocate(2)
    assert pool.publish(a, keys[0], root_key(None), tokens[:2], None)
    assert pool.publish(b, keys[1], keys[0], tokens[2:], None)
    assert not pool.publish(b, keys[1], keys[0], tokens[2:], None)  # already named: no event
    pool.unpublish(b)  # a rollback
    pool.free([a, b])
    (c,) = pool.allocate(1)  # b was never cached again: free; no eviction
    (d,) = pool.allocate(1)  # evicts a
    assert d == a and c == b
    got = log.since(0)
    assert [(e.kind, e.key) for e in got.events] == [(STORED, keys[0]), (STORED, keys[1]),
                                                     (REMOVED, keys[1]), (REMOVED, keys[0])]
    pool.publish(d, keys[0], root_key(None), tokens[:2], None)
    pool.free([c, d])
    assert pool.reset() == 1
    assert [e.kind for e in log.since(4).events] == [STORED, REMOVED]
    assert log.num_cached == 0 and log.since(None).blocks == ()
