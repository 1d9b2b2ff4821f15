"""The data-plane seam: the REAL KVSender and KVReceiver (real gRPC control plane on loopback)
moving a request's shard over the in-process fake plane, chosen by ``TransceiverConfig.backend``
through the one factory. Byte-exact shards, and one injected fault: a send that fails makes the
receiver's request fail with its cause named, and nothing stays allocated or in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from helixserve.config_transceiver import TransceiverBackendKind, TransceiverConfig
from helixserve.protocol.disagg import DisaggregatedParams
from helixserve.transceiver.backends import open_data_plane
from helixserve.transceiver.base import TransferState
from helixserve.transceiver.fake import FakeDataPlane, FakeFabric, FakeFault, install_fabric
from helixserve.transceiver.layout import wire_tag
from helixserve.transceiver.gen.receiver import KVReceiver
from tests.unit.transceiver_harness import LAYOUT, NUM_TOKENS, Ctx, GenPools



def config(**overrides) -> TransceiverConfig:
    return TransceiverConfig(**{"backend": "fake", "kv_transfer_timeout_ms": 5000, "rpc_timeout_ms": 2000,
                                "drain_timeout_ms": 1000, **overrides})


@pytest.fixture
def fabric():
    fabric = FakeFabric()
    previous = install_fabric(fabric)
    yield fabric
    install_fabric(previous)


class Gen(GenPools):
    """One gen rank: its pools and the real KVReceiver."""

    def __init__(self, cfg: TransceiverConfig, cp_rank: int = 0, cp_size: int = 1) -> None:
        super().__init__(cp_rank, cp_size)
        self.baseline = self.used()
        self.rx = KVReceiver(cfg, LAYOUT, cp_rank=cp_rank, cp_size=cp_size, gen_rank=cp_rank)

    def start(self, request_id: str, params: DisaggregatedParams) -> None:
        self.rx.start(request_id, self.manager.allocate(request_id, NUM_TOKENS), self.caches, params)



@pytest.fixture
def world(fabric):
    made: list = []

    def make(cfg: TransceiverConfig, cp_size: int = 1) -> tuple[Ctx, list[Gen]]:
        ctx = Ctx(cfg)
        made.append(ctx.sender)
        gens = [Gen(cfg, r, cp_size) for r in range(cp_size)]
        made.extend(g.rx for g in gens)
        return ctx, gens

    yield make
    for part in made:
        if isinstance(part, KVReceiver):
            part.close()
        else:
            part.stop()


def poll_until(gens: list[Gen], request_id: str, timeout_s: float = 10.0) -> list[str | None]:
    """Poll every rank until each reported `request_id` (None: complete, else its error)."""
    outcome: dict[int, str | None] = {}
    end = time.monotonic() + timeout_s
    while len(outcome) < len(gens):
        assert time.monotonic() < end, f"no outcome within {timeout_s}s: {outcome}"
        for rank, gen in enumerate(gens):
            if rank not in outcome:
                reported = gen.rx.poll(wait_num=0)
                if request_id in reported:
                    outcome[rank] = reported[request_id]
        time.sleep(0.001)
    return [outcome[r] for r in range(len(gens))]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def test_the_factory_picks_the_plane_by_config_backend(fabric):
    wakeup = threading.Event()
    plane = open_data_plane(config(), wakeup)
    assert isinstance(plane, FakeDataPlane) and plane.fabric is fabric and plane.wakeup is wakeup
    assert config().backend is TransceiverBackendKind.FAKE
    with pytest.raises(ConnectionError, match="no live worker"):
        plane.connect_worker(b"x" * 24)


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("overrides", [{}, {"message_bytes": 1000, "send_window_bytes": 3000},
                                       {"message_bytes": 1000, "bounce_size_bytes": 1 << 20, "chunk_bytes": 1 << 20}],
                         ids=["one-message-per-run", "small-messages-window", "bounce-pool"])
def test_real_sender_and_receiver_move_exact_bytes_over_the_fake_plane(world, fabric, cp_size, overrides):
    ctx, gens = world(config(**overrides), cp_size)
    assert isinstance(ctx.sender.plane, FakeDataPlane)
    assert all(isinstance(g.rx.plane, FakeDataPlane) and g.rx.plane.wakeup is g.rx.poller.wakeup for g in gens)
    params = ctx.hold("r1")
    for gen in gens:
        gen.start("g1", params)
    assert poll_until(gens, "g1") == [None] * cp_size
    for rank, gen in enumerate(gens):
        got, want = gen.received("g1"), ctx.expected_shard("r1", rank, cp_size)
        for part in ("mla", "kda", "conv"):
            assert got[part].keys() == want[part].keys()
            for layer in want[part]:
                assert torch.equal(got[part][layer].view(torch.uint8), want[part][layer].reshape(
                    got[part][layer].shape).view(torch.uint8)), (rank, part, layer)
    wait_for(lambda: ctx.freed == ["r1"])
    stats = ctx.sender.stats()
    assert stats.num_held == 0 and stats.metrics.completed == 1
    assert fabric.in_flight() == []
    assert all(not g.rx.inbounds and not g.rx.poller.sessions for g in gens)


def test_a_failed_send_fails_the_receivers_request_by_name_and_frees_everything(world, fabric):
    ctx, (gen,) = world(config(message_bytes=1000, send_window_bytes=2000))
    failing = wire_tag(1, 3)  # the receiver's first request gets tag base 1; message 3 of its stream
    fabric.inject(FakeFault.FAIL, src=ctx.sender.plane.rank, dst=gen.rx.plane.rank, tag=failing)
    params = ctx.hold("r1")
    gen.start("g1", params)
    (error,) = poll_until([gen], "g1")
    assert error is not None
    assert error.startswith(f"request g1: KV transfer from ctx worker {ctx.endpoint.host}:{ctx.endpoint.port} "
                            "to gen rank 0 failed: receiving message 3 from ctx worker")
    assert f"injected failure on src={ctx.sender.plane.rank} dst={gen.rx.plane.rank} tag={failing:#x}" in error
    assert gen.rx.cancel("g1")  # returns once nothing can write into the handle any more
    gen.manager.free("g1")
    assert gen.used() == gen.baseline
    assert not gen.rx.inbounds and not gen.rx.poller.sessions
    wait_for(lambda: ctx.freed == ["r1"])  # the ctx's hold failed on its side and was freed
    stats = ctx.sender.stats()
    assert stats.num_held == 0 and stats.num_quarantined == 0 and stats.metrics.completed == 0
    assert fabric.in_flight() == []  # no receive left posted into the freed blocks, no send pinned
    assert not gen.rx.retractor.sinks


def test_every_receive_is_posted_before_the_ctx_answers_one_round_trip(world, fabric, monkeypatch):
    """The receiver posts its whole stream (on its worker) right after RequestShard went out, so the
    ctx's sends find their receives waiting; the reply is only checked against them."""
    from helixserve.transceiver.ctx.sender import KVSender

    answer = threading.Event()
    original = KVSender.request_shard

    def held_back(self, request):  # the ctx's handler waits: the reply cannot have arrived yet
        assert answer.wait(5.0)
        return original(self, request)

    monkeypatch.setattr(KVSender, "request_shard", held_back)
    ctx, (gen,) = world(config(message_bytes=1000))
    gen.start("g1", ctx.hold("r1"))
    stream = gen.rx.inbounds["g1"].transport
    num_messages = len(stream.plan.messages)
    assert num_messages > 10 and stream.name == "tagged stream" and not stream.is_answered
    assert list(stream.pending) == list(range(num_messages))
    assert len([op for op in fabric.in_flight() if op.startswith("recv ")]) == num_messages
    answer.set()
    assert poll_until([gen], "g1") == [None]
    got, want = gen.received("g1"), ctx.expected_shard("r1", 0, 1)
    assert all(torch.equal(got["mla"][i].view(torch.uint8), want["mla"][i].view(torch.uint8)) for i in want["mla"])
    wait_for(lambda: ctx.freed == ["r1"])
    assert fabric.in_flight() == []


@pytest.mark.parametrize("gen_bytes", [999, 1000, 1001])
def test_the_ctx_cuts_with_the_receivers_message_size_or_refuses_a_larger_one(fabric, gen_bytes):
    """Receives are posted with the receiver's cut before the ctx answers, so the ctx cuts with
    exactly it; one above its own ``message_bytes`` is refused by name, and the receives posted
    for it are retracted (nothing left in flight, no sink: nothing can come)."""
    ctx = Ctx(config(message_bytes=1000))
    gen = Gen(config(message_bytes=gen_bytes))
    try:
        gen.start("g1", ctx.hold("r1"))
        (outcome,) = poll_until([gen], "g1")
        if gen_bytes <= 1000:
            assert outcome is None
            wait_for(lambda: ctx.freed == ["r1"])
        else:
            assert outcome is not None and "refused the transfer" in outcome
            assert "messages of 1001 bytes, more than this ctx's message_bytes 1000" in outcome
            assert gen.rx.cancel("g1")
            gen.manager.free("g1")
            assert gen.used() == gen.baseline and not gen.rx.retractor.sinks
            assert ctx.sender.stats().num_held == 1  # refused: still held for a correct request
        wait_for(lambda: fabric.in_flight() == [])
    finally:
        gen.rx.close()
        ctx.close()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_a_failed_send_through_the_bounce_pool_gives_every_staging_buffer_back(world, fabric, side):
    cfg = config(message_bytes=1000, send_window_bytes=2000, bounce_size_bytes=1 << 20, chunk_bytes=1 << 20)
    ctx, (gen,) = world(cfg)
    owner = ctx.sender if side == "sender" else gen.rx
    capacity = owner.staging.pool.free_bytes
    fabric.inject(FakeFault.FAIL, src=ctx.sender.plane.rank, dst=gen.rx.plane.rank, tag=wire_tag(1, 2))
    gen.start("g1", ctx.hold("r1"))
    (error,) = poll_until([gen], "g1")
    assert error is not None and "receiving message 2" in error
    assert gen.rx.cancel("g1")
    wait_for(lambda: ctx.freed == ["r1"])
    wait_for(lambda: owner.staging.pool.free_bytes == capacity)
    assert fabric.in_flight() == []


@pytest.mark.parametrize("send_fails_before_the_receive", [True, False])
def test_a_failed_link_fails_the_receive_whatever_the_posting_order(fabric, send_fails_before_the_receive):
    """A FAIL fault breaks the link whatever the posting order: a receive posted after the faulty
    send already failed fails too, as one posted before it does; it does not wait for ever (the
    bounce-pool test above timed out so on a loaded CI box)."""
    a, b = fabric.plane(), fabric.plane()
    to_b = a.connect_worker(b.address)
    fabric.inject(FakeFault.FAIL, src=a.rank, dst=b.rank, tag=7)
    if send_fails_before_the_receive:
        sent = a.send_message(to_b, 7, torch.arange(4, dtype=torch.uint8))
        wait_for(lambda: sent.test() is TransferState.FAILED)
        received = b.recv_message(None, 7, torch.zeros(4, dtype=torch.uint8))
    else:
        received = b.recv_message(None, 7, torch.zeros(4, dtype=torch.uint8))
        sent = a.send_message(to_b, 7, torch.arange(4, dtype=torch.uint8))
    wait_for(lambda: received.test() is TransferState.FAILED and sent.test() is TransferState.FAILED)
    assert fabric.in_flight() == []


def test_fake_messages_match_like_ucx_tags_in_posting_order_and_retract_ends_the_oldest(fabric):
    a, b = fabric.plane(), fabric.plane()
    to_b, to_a = a.connect_worker(b.address), b.connect_worker(a.address)
    first, sink = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    r1, r2 = b.recv_message(to_a, 9, first), b.recv_message(to_a, 9, sink)  # the same tag twice
    retraction = b.retract(9)  # ends r1 (the oldest), writes nothing
    assert retraction.test() is TransferState.COMPLETED and r1.test() is TransferState.COMPLETED
    assert torch.equal(first, torch.zeros(4, dtype=torch.uint8))
    sent = a.send_message(to_b, 9, torch.arange(1, 5, dtype=torch.uint8))  # a late message: the sink takes it
    assert sent.test() is TransferState.COMPLETED and r2.test() is TransferState.COMPLETED
    assert sink.tolist() == [1, 2, 3, 4]
    early = a.send_message(to_b, 10, torch.arange(8, dtype=torch.uint8))  # unexpected until posted
    small = torch.zeros(4, dtype=torch.uint8)
    truncated = b.recv_message(to_a, 10, small)
    assert truncated.test() is TransferState.FAILED and "truncated" in truncated.error
    assert early.test() is TransferState.FAILED and small.tolist() == [0] * 4
    waiting = b.recv_message(to_a, 11, torch.zeros(1, dtype=torch.uint8))
    b.close()  # closing a worker ends its posted receives
    assert waiting.test() is TransferState.CANCELLED and waiting.is_quiesced()
    with pytest.raises(ConnectionError):
        a.connect_worker(b.address)
    assert fabric.in_flight() == []
