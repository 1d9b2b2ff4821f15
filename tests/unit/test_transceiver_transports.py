"""A gen rank's shard transports and their hand-offs, on the REAL KVSender and KVReceiver (real
gRPC control plane on loopback) over the in-process fake data plane.

The pulls copy out of the ctx's pools as a same-host CUDA IPC opening maps them; here the ctx's
pools are host tensors of this process, handed to the receiver's pool directory (which opens
CUDA pools only), and the lease words are a board this test owns (the ctx grants only from
GPU pools). Everything else is the serving path: the grant's MAC check, the unit copy, the
RequestShard naming the pools' epoch, the ctx's answer with the tagged stream (the epoch is not
its own), the receives, the Cancel and its drain."""

from __future__ import annotations

import logging

import pytest
import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.transceiver.ctx.sender import KVSender
from helixserve.transceiver.cuda_ipc import RemotePools
from helixserve.transceiver.grant import make_grant
from helixserve.transceiver.lease import LeaseBoard
from tests.unit.test_transceiver_fake_seam import config, fabric, poll_until, wait_for, world  # noqa: F401
from tests.unit.transceiver_harness import CFG, NUM_TOKENS, TPB

EPOCH = 0x5EED  # the opened pools' export (the ctx's own is another: it answers with the tagged stream)
KEY = bytes(range(32))  # the export's grant key
SERIAL = 3


@pytest.fixture
def lease(tmp_path):
    """The opened pools' lease words, holding grant SERIAL."""
    board = LeaseBoard.create(num_words=16, directory=tmp_path)
    board.grant(SERIAL)
    yield board
    board.close()


def start(ctx, gen, caches, lease: LeaseBoard, monkeypatch, with_grant: bool):
    """Hold "r1" on the ctx and start receiving it as "g1", `gen`'s receiver having `caches` open
    as the ctx's pools (what `PoolDirectory.get` returns once a same-host ctx's DescribePools
    answer opened); with the ctx's grant when `with_grant`. The inbound."""
    pools = RemotePools(EPOCH, caches, [], KEY, lease)
    monkeypatch.setattr(gen.rx.pools, "get", lambda key, client, device: pools)
    params = ctx.hold("r1")
    gen.start("g1", granted(ctx, params) if with_grant else params)
    return gen.rx.inbounds["g1"]


def stale_pools():
    """The ctx's pools after it freed the request's blocks and reused them: other bytes."""
    caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, TPB), 32, 4)
    for pools in (caches.mla_kv, caches.kda_state, caches.conv_state):
        for pool in pools.values():
            pool.fill_(0.5)
    return caches


def granted(ctx, params):
    handle = ctx.manager.get(params.ctx_request_id)
    grant = make_grant(KEY, params.ctx_request_id, NUM_TOKENS, params.first_gen_tokens, EPOCH, SERIAL,
                       handle.block_ids, handle.slot)
    return params.model_copy(update={"pull_grant": grant})


@pytest.fixture
def shard_requests(monkeypatch) -> list[int]:
    """The pull epoch of every RequestShard the ctx gets (0: none named)."""
    seen: list[int] = []
    original = KVSender.request_shard

    def recorded(self, request):
        seen.append(request.pull_epoch)
        return original(self, request)

    monkeypatch.setattr(KVSender, "request_shard", recorded)
    return seen


def window_of(messages, window_bytes: int) -> int:
    """How many messages a ctx posts before any is received (`Outbound.pump`'s send window)."""
    num, inflight = 0, 0
    for message in messages:
        if num and inflight + message.nbytes > window_bytes:
            break
        num, inflight = num + 1, inflight + message.nbytes
    return num


def switches(caplog) -> list[str]:
    """The receivers' hand-offs logged, as "from -> to"."""
    return [r.getMessage().split(": ")[1] for r in caplog.records
            if r.name == "helixserve.transceiver.gen.inbound" and " -> " in r.getMessage()]


def assert_received_exactly(gen, ctx) -> None:
    got, want = gen.received("g1"), ctx.expected_shard("r1", 0, 1)
    for part in ("mla", "kda", "conv"):
        for layer in want[part]:
            assert torch.equal(got[part][layer].view(torch.uint8),
                               want[part][layer].reshape(got[part][layer].shape).view(torch.uint8)), (part, layer)


def test_a_granted_pull_lands_without_asking(world, fabric, lease, monkeypatch, shard_requests):
    """Copied at start, the lease word still held after the copy: landed, and no RequestShard.
    (The ctx here issued no grant of its own, so it keeps its hold: its side is not checked.)"""
    ctx, (gen,) = world(config())
    inbound = start(ctx, gen, ctx.caches, lease, monkeypatch, with_grant=True)
    transport = inbound.transport
    assert transport.name == "granted pull" and transport.copy is not None and not transport.has_asked
    assert poll_until([gen], "g1") == [None]
    assert_received_exactly(gen, ctx)
    assert shard_requests == [] and inbound.retired == [] and transport.is_quiesced()
    assert (gen.rx.num_granted, gen.rx.num_pulled) == (1, 0)


@pytest.mark.parametrize("with_grant", [True, False], ids=["granted-then-revoked", "asked"])
def test_a_pull_hands_off_until_the_tagged_stream_rewrites_every_byte(world, fabric, lease, monkeypatch,
                                                                      shard_requests, caplog, with_grant):
    """Granted, its lease word gone once the copy ended (the ctx began freeing the blocks, which
    were reused: the copy read other bytes) -> asked, naming the pools' epoch -> the ctx answers
    with the tagged stream (not its epoch) -> every byte received; each transport left is
    quiesced and the switches are logged naming both."""
    caplog.set_level(logging.INFO, logger="helixserve.transceiver.gen.inbound")
    ctx, (gen,) = world(config(message_bytes=1000))
    inbound = start(ctx, gen, stale_pools(), lease, monkeypatch, with_grant)
    if with_grant:
        assert inbound.transport.name == "granted pull"
        assert all(bool((pool[gen.manager.get("g1").block_ids] == 0.5).all()) for pool in gen.caches.mla_kv.values())
        lease.revoke(SERIAL)
    assert poll_until([gen], "g1") == [None]
    assert_received_exactly(gen, ctx)  # the copy of reused blocks is overwritten
    left = ["granted pull", "asked pull"] if with_grant else ["asked pull"]
    assert [t.name for t in inbound.retired] == left and inbound.transport.name == "tagged stream"
    assert all(t.is_quiesced() for t in inbound.retired)
    assert shard_requests == [EPOCH]  # one RequestShard, naming the opened pools
    assert switches(caplog) == [f"{a} -> {b}" for a, b in zip(left, [*left[1:], "tagged stream"])]
    assert (gen.rx.num_granted, gen.rx.num_pulled) == (0, 0)
    wait_for(lambda: ctx.freed == ["r1"])  # acknowledged over the tagged stream
    assert fabric.in_flight() == []


def test_an_asked_pull_given_up_drains_what_the_ctx_posted_as_a_tagged_stream(world, fabric, lease,
                                                                               monkeypatch, caplog):
    """The ctx answered with the tagged stream and posted its first sends, but the rank gave up
    before it read the answer: the Cancel reply's count hands off to the tagged stream, which
    receives those messages, so no send of the ctx stays pinned and its hold is freed."""
    caplog.set_level(logging.INFO, logger="helixserve.transceiver.gen.inbound")
    ctx, (gen,) = world(config(message_bytes=1000, send_window_bytes=3000))
    inbound = start(ctx, gen, stale_pools(), lease, monkeypatch, with_grant=False)
    assert inbound.transport.name == "asked pull"
    num_posted = window_of(inbound.plan.messages, 3000)
    assert 1 < num_posted < len(inbound.plan.messages)
    wait_for(lambda: sum(op.startswith("send ") for op in fabric.in_flight()) == num_posted)  # the ctx is sending
    assert gen.rx.cancel("g1", "client gone")  # returns once nothing can write into the handle
    assert [t.name for t in inbound.retired] == ["asked pull"] and inbound.transport.name == "tagged stream"
    assert all(t.is_quiesced() for t in inbound.retired) and inbound.is_quiesced()
    assert inbound.num_to_drain == num_posted and not inbound.transport.is_answered
    assert switches(caplog) == ["asked pull -> tagged stream"]
    assert f"{inbound.ctx} posted {num_posted} message(s) before the Cancel" in caplog.text
    gen.manager.free("g1")
    wait_for(lambda: ctx.freed == ["r1"])
    assert fabric.in_flight() == [] and not gen.rx.retractor.sinks  # every posted send was received


def test_a_granted_pull_given_up_closes_without_a_hand_off(world, fabric, lease, monkeypatch, shard_requests):
    """Nothing was asked, so the ctx posted nothing: the Cancel reply says so and the rank closes
    with the granted pull (no tagged stream is made to drain)."""
    ctx, (gen,) = world(config())
    inbound = start(ctx, gen, ctx.caches, lease, monkeypatch, with_grant=True)
    assert inbound.transport.name == "granted pull"
    assert gen.rx.cancel("g1", "client gone")
    assert inbound.transport.name == "granted pull" and inbound.retired == [] and inbound.is_quiesced()
    assert inbound.num_to_drain == 0 and shard_requests == []
    wait_for(lambda: ctx.freed == ["r1"])  # the Cancel stopped the hold
    assert fabric.in_flight() == []
