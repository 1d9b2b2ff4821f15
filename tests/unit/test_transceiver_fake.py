"""The fake data plane: matching, byte copy, fault injection, lazy backend selection."""

from __future__ import annotations

import pytest
import torch

from helixserve.clock import FakeClock
from helixserve.config_transceiver import TransceiverBackendKind
from helixserve.transceiver.backends import load_data_plane
from helixserve.transceiver.base import PayloadKind, ReceiverSession, SenderSession, TransferState
from helixserve.transceiver.fake import FakeDataPlane, FakeFabric, FakeFault
from helixserve.transceiver.polling import TransferPoller

KV, AUX = PayloadKind.KV_BLOCKS, PayloadKind.AUX


def _pair(fabric, clock, rid="r"):
    src = torch.arange(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    ctx, gen = fabric.plane(0), fabric.plane(1)
    sender = SenderSession(rid, expected_acks={1}, timeout_s=1.0, clock=clock)
    receiver = ReceiverSession(rid, timeout_s=1.0, clock=clock)
    sender.add_task(1, KV, 256)
    receiver.add_task(0, KV, 256)
    receiver.attach(0, KV, gen.post_recv(0, 7, dst.numpy().data))
    sender.attach(1, KV, ctx.post_send(1, 7, src.numpy().data))
    return sender, receiver, src, dst


def test_transceiver_fake_moves_bytes_and_sender_waits_for_ack():
    clock = FakeClock()
    fabric = FakeFabric(clock, latency_s=0.01)
    sender, receiver, src, dst = _pair(fabric, clock)
    gen_poller = TransferPoller(clock=clock, wakeup=fabric.wakeup)
    ctx_poller = TransferPoller(clock=clock, wakeup=fabric.wakeup)
    ctx_poller.add(sender)
    gen_poller.add(receiver)
    assert gen_poller.poll(1, interval_s=1.0).completed == ["r"]
    assert clock.monotonic() == pytest.approx(0.01, abs=0.002)
    assert torch.equal(src, dst)
    assert ctx_poller.poll(0).pending == ["r"]  # data sent, no ack yet
    sender.acknowledge(1)
    assert ctx_poller.poll(1, interval_s=1.0).completed == ["r"]


def test_transceiver_fake_injected_failure_names_the_peer():
    clock = FakeClock()
    fabric = FakeFabric(clock)
    fabric.inject(FakeFault.FAIL, src=0, dst=1)
    _, receiver, _, _ = _pair(fabric, clock)
    assert receiver.wait(timeout_s=1.0, slice_s=0.01) is TransferState.FAILED
    assert "peer rank 0" in receiver.error and "src=0 dst=1" in receiver.error


def test_transceiver_fake_size_mismatch_fails_both_sides():
    clock = FakeClock()
    plane = FakeFabric(clock).plane(0)
    recv = plane.post_recv(0, 1, bytearray(4))
    send = plane.post_send(0, 1, bytearray(8))
    assert recv.test() is TransferState.FAILED and "size mismatch" in recv.error
    assert send.test() is TransferState.FAILED


def test_transceiver_backend_selected_by_enum_lazily():
    assert load_data_plane(TransceiverBackendKind.FAKE) is FakeDataPlane
    with pytest.raises(ValueError, match="unknown transceiver backend"):
        load_data_plane("nixl")  # type: ignore[arg-type]
