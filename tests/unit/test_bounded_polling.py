"""Bounded polling: one test per behaviour of reference/transceiver.md (injected clock, no sleeps)."""

from __future__ import annotations

import math
import threading
import time

import pytest
from pydantic import ValidationError

from helixserve.clock import SPIN_BELOW_S, FakeClock, MonotonicClock
from helixserve.config_transceiver import TransceiverConfig
from helixserve.transceiver.base import (
    DEFAULT_SLICE_S,
    DEFAULT_TIMEOUT_S,
    PayloadKind,
    ReceiverSession,
    SenderSession,
    TransferState,
    resolve_slice,
    resolve_timeout,
)
from helixserve.transceiver.fake import FakeFault, FakeHandle
from helixserve.transceiver.polling import TransferPoller

KV, AUX = PayloadKind.KV_BLOCKS, PayloadKind.AUX
TICK = 0.001


def receiver(clock, rid="r0", timeout_s=1.0, fault=FakeFault.NONE, latency_s=0.0, post=True):
    session = ReceiverSession(rid, timeout_s=timeout_s, clock=clock)
    session.add_task(0, KV, nbytes=1024)
    if post:
        session.attach(0, KV, FakeHandle(clock, fault, latency_s))
    return session


def poller_with(clock, *sessions):
    poller = TransferPoller(clock=clock, tick_s=TICK)
    for session in sessions:
        poller.add(session)
    return poller


def test_bounded_polling_poll_clamps_wait_num_to_live_sessions():
    clock = FakeClock()
    poller = poller_with(clock, receiver(clock, "a", latency_s=0.010), receiver(clock, "b", latency_s=0.020))
    result = poller.poll(wait_num=5, interval_s=1.0)
    assert result.num_target == 2
    assert sorted(result.completed) == ["a", "b"]
    assert clock.monotonic() == pytest.approx(0.020, abs=2 * TICK)  # not the 1 s interval


def test_bounded_polling_empty_poll_returns_at_once():
    clock = FakeClock()
    result = TransferPoller(clock=clock).poll(wait_num=3, interval_s=10.0)
    assert result.num_sweeps == 0 and clock.waits == [] and clock.monotonic() == 0.0


def test_bounded_polling_interval_deadline_bounds_a_never_completing_session():
    clock = FakeClock()
    session = receiver(clock, timeout_s=0.2, fault=FakeFault.NEVER_COMPLETE)
    poller = poller_with(clock, session)
    result = poller.poll(wait_num=1, interval_s=0.05)
    assert result.pending == ["r0"]
    assert clock.monotonic() == pytest.approx(0.05, abs=TICK)
    # an idle loop never sleeps a whole interval, and it does not spin without waiting
    assert max(clock.waits) <= TICK and result.num_sweeps >= 40
    # the session's own overall deadline then ends it: a receiver reports FAILED (timeout)
    while session.state is not TransferState.FAILED:
        poller.poll(wait_num=1, interval_s=0.05)
    assert session.is_timed_out and "timed out" in session.error
    assert clock.monotonic() == pytest.approx(0.2, abs=TICK)


def test_bounded_polling_failed_session_counts_toward_the_target():
    clock = FakeClock()
    bad = receiver(clock, "bad", fault=FakeFault.FAIL, latency_s=0.010)
    slow = receiver(clock, "slow", fault=FakeFault.NEVER_COMPLETE)
    result = poller_with(clock, bad, slow).poll(wait_num=1, interval_s=1.0)
    assert result.failed == ["bad"] and result.pending == ["slow"]
    assert clock.monotonic() == pytest.approx(0.010, abs=2 * TICK)


def test_bounded_polling_zero_budget_is_one_nonblocking_sweep():
    clock = FakeClock()
    poller = poller_with(clock, receiver(clock, fault=FakeFault.NEVER_COMPLETE))
    result = poller.poll(wait_num=0, interval_s=5.0)
    assert result.num_sweeps == 1 and clock.waits == [] and result.pending == ["r0"]
    with pytest.raises(ValueError, match="wait_num"):
        poller.poll(wait_num=-1)


def test_bounded_polling_block_all_waits_in_bounded_slices():
    clock = FakeClock()
    sessions = [
        receiver(clock, "a", latency_s=0.01),
        receiver(clock, "b", fault=FakeFault.FAIL, latency_s=0.02),
        receiver(clock, "c", timeout_s=0.1, fault=FakeFault.NEVER_COMPLETE),
    ]
    result = poller_with(clock, *sessions).poll(wait_num=None)
    assert result.completed == ["a"] and sorted(result.failed) == ["b", "c"] and not result.pending
    assert max(clock.waits) <= TICK
    assert clock.monotonic() == pytest.approx(0.1, abs=TICK)


def test_bounded_polling_block_all_is_bounded_for_sessions_never_posted():
    clock = FakeClock()
    never_posted = receiver(clock, timeout_s=0.05, post=False)
    result = poller_with(clock, never_posted).poll(wait_num=None)
    assert result.pending == ["r0"] and clock.monotonic() <= 0.05 + 2 * TICK


def test_bounded_polling_deadline_anchored_once_and_shared_by_all_tasks():
    clock = FakeClock()
    session = ReceiverSession("r", timeout_s=1.0, clock=clock)
    session.add_task(0, KV)
    session.add_task(0, AUX)
    assert session.deadline is None  # nothing requested yet
    clock.advance(0.3)
    session.attach(0, KV, FakeHandle(clock, FakeFault.NEVER_COMPLETE))
    assert session.deadline == pytest.approx(1.3)
    poller = poller_with(clock, session)
    clock.advance(0.4)
    session.attach(0, KV, FakeHandle(clock, FakeFault.NEVER_COMPLETE))  # a retry
    poller.poll(wait_num=0)
    clock.advance(0.2)
    # the aux task is posted late (completes later than the deadline) and shares the deadline
    session.attach(0, AUX, FakeHandle(clock, FakeFault.NONE, latency_s=1.0))
    assert session.deadline == pytest.approx(1.3)
    poller.poll(wait_num=1, interval_s=10.0)
    assert session.state is TransferState.FAILED
    assert clock.monotonic() == pytest.approx(1.3, abs=TICK)
    assert "kv_blocks@rank0" in session.error and "aux@rank0" in session.error


def test_bounded_polling_terminal_state_wins_at_the_deadline_boundary():
    clock = FakeClock()
    session = receiver(clock, timeout_s=0.5, latency_s=0.5)  # completes exactly at the deadline
    clock.advance(0.5)
    assert session.remaining() <= 0
    assert session.update() is TransferState.COMPLETED and not session.is_timed_out
    sender = SenderSession("s", expected_acks={1}, timeout_s=0.5, clock=clock)
    sender.add_task(1, KV)
    sender.attach(1, KV, FakeHandle(clock, latency_s=0.1))
    clock.call_at(1.0, lambda: sender.acknowledge(1))  # ack lands exactly at its deadline
    clock.advance(0.5)
    assert sender.update() is TransferState.COMPLETED
    # once settled, a later event never changes the state
    session.cancel()
    assert session.update() is TransferState.COMPLETED


def test_bounded_polling_cancellation_is_observed_between_slices():
    clock = FakeClock()
    session = receiver(clock, timeout_s=10.0, fault=FakeFault.NEVER_COMPLETE)
    clock.call_at(0.25, lambda: session.cancel("client disconnected"))
    state = session.wait(timeout_s=5.0, slice_s=0.1)
    assert state is TransferState.CANCELLED and session.error == "client disconnected"
    assert clock.monotonic() <= 0.3 and max(clock.waits) <= 0.1
    assert session.is_quiesced  # the pending receive was cancelled, so its buffer is free


def test_bounded_polling_failed_sibling_ends_session_behind_a_pending_task():
    clock = FakeClock()
    session = ReceiverSession("r", timeout_s=10.0, clock=clock)
    session.add_task(0, KV)
    session.add_task(1, AUX)
    pending = FakeHandle(clock, FakeFault.NEVER_COMPLETE)
    session.attach(0, KV, pending)
    session.attach(1, AUX, FakeHandle(clock, FakeFault.FAIL, latency_s=0.01, error="peer reset"))
    result = poller_with(clock, session).poll(wait_num=1, interval_s=5.0)
    assert result.failed == ["r"] and clock.monotonic() < 0.02
    assert "aux" in session.error and "rank 1" in session.error and "peer reset" in session.error
    assert pending.is_cancel_requested  # the sibling is aborted so the buffers quiesce


def test_bounded_polling_blocking_slice_never_exceeds_remaining():
    clock = FakeClock()
    session = receiver(clock, timeout_s=0.125, fault=FakeFault.NEVER_COMPLETE)
    assert session.wait(timeout_s=10.0, slice_s=0.1) is TransferState.FAILED
    assert clock.waits == pytest.approx([0.1, 0.025])
    assert clock.monotonic() == pytest.approx(0.125)


@pytest.mark.parametrize("bad", [None, 0.0, -1.0, math.inf, math.nan])
def test_bounded_polling_finite_fallbacks_for_missing_slice_and_timeout(bad):
    assert resolve_slice(bad) == DEFAULT_SLICE_S and resolve_timeout(bad) == DEFAULT_TIMEOUT_S
    clock = FakeClock()
    session = receiver(clock, timeout_s=bad, fault=FakeFault.NEVER_COMPLETE)
    assert math.isfinite(session.deadline)
    assert session.wait(timeout_s=bad, slice_s=bad) is TransferState.FAILED
    assert max(clock.waits) == pytest.approx(DEFAULT_SLICE_S) and min(clock.waits) >= 0
    assert clock.monotonic() == pytest.approx(DEFAULT_TIMEOUT_S)


@pytest.mark.parametrize("bad", [None, math.inf, "inf", float("nan"), 0, -5])
def test_bounded_polling_unset_or_infinite_timeout_rejected(bad):
    with pytest.raises(ValidationError, match="kv_transfer_timeout_ms"):
        TransceiverConfig(kv_transfer_timeout_ms=bad)


def test_bounded_polling_missing_timeout_rejected_by_config():
    with pytest.raises(ValidationError, match="kv_transfer_timeout_ms"):
        TransceiverConfig()
    config = TransceiverConfig(kv_transfer_timeout_ms=250, bounce_size_bytes=-1)
    assert config.timeout_s == 0.25 and not config.is_bounce_enabled


def test_bounded_polling_receiver_past_deadline_reports_failed():
    clock = FakeClock()
    session = receiver(clock, timeout_s=0.2, fault=FakeFault.NEVER_COMPLETE)
    poller = poller_with(clock, session)
    result = poller.poll(wait_num=1, interval_s=1.0)
    assert result.failed == ["r0"] and result.quiesced == ["r0"]
    assert poller.metrics.timeouts == 1 and poller.metrics.failures == 1
    poller.retire("r0")
    assert len(poller) == 0


def test_bounded_polling_sender_past_deadline_frees_only_when_quiesced():
    clock = FakeClock()
    quiet = SenderSession("quiet", expected_acks={1}, timeout_s=0.1, clock=clock)
    stuck = SenderSession("stuck", expected_acks={1}, timeout_s=0.1, clock=clock)
    for session, fault in ((quiet, FakeFault.NEVER_COMPLETE), (stuck, FakeFault.STUCK)):
        session.add_task(1, KV, nbytes=64)
        session.attach(1, KV, FakeHandle(clock, fault))
    poller = poller_with(clock, quiet, stuck)
    result = poller.poll(wait_num=None)
    assert sorted(result.timed_out) == ["quiet", "stuck"]
    assert result.quiesced == ["quiet"] and result.quarantined == ["stuck"]
    assert "no acknowledgement from gen ranks [1]" in stuck.error
    assert poller.metrics.expired_holds == 2
    poller.retire("quiet")
    with pytest.raises(ValueError, match="in flight"):
        poller.retire("stuck")


def test_bounded_polling_sender_completes_only_after_every_ack():
    clock = FakeClock()
    sender = SenderSession("s", expected_acks={1, 2}, timeout_s=1.0, clock=clock)
    sender.add_task(1, KV, nbytes=10)
    sender.add_task(2, KV, nbytes=10)
    sender.attach(1, KV, FakeHandle(clock))
    sender.attach(2, KV, FakeHandle(clock))
    poller = poller_with(clock, sender)
    clock.call_at(0.1, lambda: sender.acknowledge(1))
    clock.call_at(0.2, lambda: sender.acknowledge(2))
    result = poller.poll(wait_num=1, interval_s=1.0)
    assert result.completed == ["s"] and clock.monotonic() == pytest.approx(0.2)
    assert poller.metrics.bytes_transferred == 20
    with pytest.raises(ValueError, match="unexpected rank 7"):
        sender.acknowledge(7)


def test_bounded_polling_wakeup_event_ends_a_tick_early():
    clock = FakeClock()
    sender = SenderSession("s", expected_acks={1}, timeout_s=1.0, clock=clock)
    sender.add_task(1, KV)
    sender.attach(1, KV, FakeHandle(clock))
    poller = poller_with(clock, sender)
    poller.tick_s = 0.5  # a long tick: only the event can end it early
    clock.call_at(0.0123, lambda: sender.acknowledge(1))
    assert poller.poll(wait_num=1, interval_s=1.0).completed == ["s"]
    assert clock.monotonic() == pytest.approx(0.0123)


def test_bounded_polling_settled_session_rejects_late_posts():
    clock = FakeClock()
    session = receiver(clock, fault=FakeFault.NEVER_COMPLETE)
    session.cancel()
    assert session.update() is TransferState.CANCELLED
    late = FakeHandle(clock)
    with pytest.raises(ValueError, match="already cancelled"):
        session.attach(0, KV, late)
    assert late.is_cancel_requested


@pytest.mark.parametrize("probe", ["none", "fires", "never"])
def test_bounded_polling_a_ready_probe_ends_the_wait_not_the_tick(probe):
    """A completion that sets no wakeup (a device copy's event) and that a cheap probe sees: the
    next sweep runs within a probe period of it instead of at the next tick; a probe that never
    fires leaves the sweeps a tick apart (a sweep updates every session); the poll's interval
    bounds the wait either way."""
    clock = FakeClock()
    poller = poller_with(clock, receiver(clock, "a", latency_s=0.0102))
    fired = []

    def once() -> bool:  # the receiver's probe says True once per copy that ended
        if clock.monotonic() >= 0.0102 and not fired:
            fired.append(clock.monotonic())
            return True
        return False
    ready = {"none": None, "fires": once, "never": lambda: False}[probe]
    result = poller.poll(wait_num=1, interval_s=1.0, ready=ready, ready_tick_s=0.00005)
    assert result.completed == ["a"]
    step = 0.00005 if probe == "fires" else TICK
    assert 0.0102 <= clock.monotonic() <= 0.0102 + step + 1e-9
    assert result.num_sweeps <= 0.0102 / TICK + 2  # a tick apart, however often the probe ran
    never = poller_with(clock, receiver(clock, "b", fault=FakeFault.NEVER_COMPLETE))
    start = clock.monotonic()
    result = never.poll(wait_num=1, interval_s=0.003, ready=ready, ready_tick_s=0.00005)
    assert result.pending == ["b"] and result.num_sweeps <= 0.003 / TICK + 2
    assert clock.monotonic() - start == pytest.approx(0.003)


def test_a_real_wait_shorter_than_the_spin_bound_is_bounded_and_sees_its_event():
    """The real clock spins waits under SPIN_BELOW_S (a timed sleep would oversleep them): such a
    wait still lasts its timeout when nothing happens, returns at once for a set event, and sees
    an event another thread sets while it spins (the spin lets that thread run)."""
    clock, short = MonotonicClock(), SPIN_BELOW_S / 2
    start = time.monotonic()
    assert clock.wait(None, short) is False and time.monotonic() - start >= short
    event = threading.Event()
    start = time.monotonic()
    assert clock.wait(event, short) is False and time.monotonic() - start >= short
    event.set()
    assert clock.wait(event, short) is True
    late = threading.Event()
    setter = threading.Thread(target=late.set)
    seen = False
    setter.start()
    for _ in range(100_000):  # each wait gives the setter a chance to run; bounded either way
        if clock.wait(late, short):
            seen = True
            break
    setter.join(timeout=5)
    assert seen
