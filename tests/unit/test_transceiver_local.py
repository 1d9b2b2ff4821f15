"""Sender and receivers in ONE process over real UCX (two workers) and real gRPC: shard contents,
refusals with named causes, hold expiry, cancel and timeout drains, hostile plans. Cache
contents are random (no model): the oracle slices the ctx tensors directly."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

pytest.importorskip("ucxx")

from helixserve.config_transceiver import TransceiverConfig  # noqa: E402
from helixserve.protocol import transfer_pb2 as pb  # noqa: E402
from helixserve.protocol.disagg import DisaggregatedParams, TransceiverEndpoint  # noqa: E402
from helixserve.transceiver import layout as layout_module  # noqa: E402
from helixserve.transceiver.ctx import sender as sender_module  # noqa: E402
from helixserve.transceiver.ctx.outbound import Outbound  # noqa: E402
from helixserve.transceiver.gen.control_client import ControlClient  # noqa: E402
from helixserve.transceiver.gen.receiver import KVReceiver  # noqa: E402
from tests.unit.transceiver_harness import LAYOUT, NUM_TOKENS, Ctx, GenPools, RankReception, drive, wait_for  # noqa: E402



def config(**overrides) -> TransceiverConfig:
    return TransceiverConfig(**{"kv_transfer_timeout_ms": 5000, "rpc_timeout_ms": 2000,
                                "drain_timeout_ms": 1000, **overrides})


_GENS: list = []


@pytest.fixture(autouse=True)
def _close_gens():
    yield
    while _GENS:
        _GENS.pop().rx.close()


class Gen(GenPools):
    """One gen rank: its pools and its receptions as a gen world runs them (a group of one)."""

    def __init__(self, cfg: TransceiverConfig, cp_rank: int = 0, cp_size: int = 1, layout=LAYOUT) -> None:
        super().__init__(cp_rank, cp_size)
        self.rx = RankReception(KVReceiver(cfg, layout, cp_rank=cp_rank, cp_size=cp_size, gen_rank=cp_rank),
                                self.manager, self.caches)
        _GENS.append(self)



@pytest.fixture
def ctx():
    made: list[Ctx] = []

    def make(**overrides) -> Ctx:
        made.append(Ctx(config(**overrides)))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("overrides", [{}, {"message_bytes": 1000}, {"bounce_size_bytes": 1 << 20, "chunk_bytes": 1 << 20},
                                       {"message_bytes": 1000, "wake_on_completion": True},
                                       {"message_bytes": 5000, "pack_bytes": 1 << 40}, {"pack_bytes": 1}],
                         ids=["direct", "small-messages", "bounce-pool", "wake-on-completion", "all-packed",
                              "each-segment-alone"])
def test_each_rank_receives_exactly_its_shard(ctx, cp_size, overrides):
    c = ctx(**overrides)
    params = c.hold("r1")
    gens = [Gen(config(**overrides), r, cp_size) for r in range(cp_size)]
    is_notified = overrides.get("wake_on_completion", False)
    assert (c.sender.plane._notifier is not None) is is_notified  # noqa: SLF001
    assert all((g.rx.receiver.plane._notifier is not None) is is_notified for g in gens)  # noqa: SLF001
    assert all(g.rx.receiver.plane.wakeup is g.rx.receiver.poller.wakeup for g in gens)
    for gen in gens:
        gen.rx.begin("g1", params)
    out = drive(gens, lambda o: len(o["ready"].get("g1", [])) == cp_size or o["failed"])
    assert not out["failed"], out["failed"]
    for rank, gen in enumerate(gens):
        got, want = gen.received("g1"), c.expected_shard("r1", rank, cp_size)
        for part in ("mla", "kda", "conv"):
            assert got[part].keys() == want[part].keys()
            for layer in want[part]:
                assert torch.equal(got[part][layer].view(torch.uint8), want[part][layer].reshape(
                    got[part][layer].shape).view(torch.uint8)), (rank, part, layer)
    wait_for(lambda: c.freed == ["r1"])
    stats = c.sender.stats()
    assert stats.num_held == 0 and stats.metrics.completed == 1 and stats.metrics.expired_holds == 0


def test_layout_mismatch_is_refused_at_the_first_request_on_both_sides(ctx):
    c = ctx()
    params = c.hold("r1")
    gen = Gen(config())
    bad = params.model_copy(update={"layout": LAYOUT.model_copy(update={"tokens_per_block": 8})})
    gen.rx.begin("g1", bad)  # refused before anything is asked of the ctx; its blocks freed once agreed
    out = drive([gen], lambda o: "g1" in o["freed"])
    assert "tokens_per_block: 4 != 8" in out["failed"]["g1"][0] and "g1" not in out["ready"]
    assert gen.used() == (2, 2) and gen.rx.receiver.inbounds == {}  # only the padding requests

    client = ControlClient(c.endpoint, timeout_s=2.0)
    theirs = LAYOUT.model_copy(update={"kv_dtype": "bfloat16", "num_kda_heads": 8})
    reply = client.request_shard(pb.ShardRequest(
        ctx_request_id="r1", cp_rank=0, cp_size=1, layout_json=theirs.model_dump_json(),
        ucx_worker_address=gen.rx.receiver.plane.address, num_prompt_tokens=NUM_TOKENS, max_message_bytes=1 << 20))
    assert not reply.accepted
    assert "num_kda_heads: 4 != 8" in reply.error and "kv_dtype: 'float32' != 'bfloat16'" in reply.error
    gen.rx.begin("g1", params)  # the hold is still held: a correct request gets it
    assert drive([gen], lambda o: "g1" in o["ready"] or o["failed"])["ready"] == {"g1": [0]}
    client.close()


def test_refusals_name_their_cause(ctx, monkeypatch):
    monkeypatch.setattr(layout_module, "MAX_MESSAGES", 1000)  # a cut into more messages than a stream holds
    c = ctx()
    c.hold("r1")
    client = ControlClient(c.endpoint, timeout_s=2.0)
    base = dict(layout_json=LAYOUT.model_dump_json(), num_prompt_tokens=NUM_TOKENS, max_message_bytes=1 << 20,
                ucx_worker_address=Gen(config()).rx.receiver.plane.address, cp_size=2)
    gone = KVReceiver(config(), LAYOUT)
    dead_address = gone.plane.address
    gone.close()  # a receiver that died: its UCX address leads nowhere
    del gone
    gc.collect()
    cases = [({"ctx_request_id": "nope"}, "not held here"),
             ({"ctx_request_id": "r1", "num_prompt_tokens": 5}, "expects 5 prompt tokens"),
             ({"ctx_request_id": "r1", "ucx_worker_address": b"x"}, "malformed UCX worker address"),
             ({"ctx_request_id": "r1", "ucx_worker_address": dead_address}, "cannot reach"),
             ({"ctx_request_id": "r1", "cp_size": 3}, "cannot be split over cp_size=3"),
             ({"ctx_request_id": "r1", "max_message_bytes": 1, "pack_bytes": 1}, "messages > 1000: raise message_bytes")]
    for update, cause in cases:
        reply = client.request_shard(pb.ShardRequest(**{**base, **update}))
        assert not reply.accepted and cause in reply.error, (update, reply.error)
        assert "ctx sender error" not in reply.error  # refused as a bad request, not failed inside
    assert client.request_shard(pb.ShardRequest(ctx_request_id="r1", cp_rank=0, **base)).accepted
    dup = client.request_shard(pb.ShardRequest(ctx_request_id="r1", cp_rank=0, **base))
    assert "already picked this request up" in dup.error
    other = client.request_shard(pb.ShardRequest(ctx_request_id="r1", cp_rank=0, **{**base, "cp_size": 4}))
    assert "already picked up with cp_size 2" in other.error
    # this fake receiver never posts its receives: the rendezvous sends already posted can never
    # complete, so after the cancel the ctx keeps the request's cache quarantined, never freed
    cancel = client.cancel(pb.CancelRequest(ctx_request_id="r1", cp_rank=0))
    assert cancel.known and cancel.num_posted_messages > 0
    wait_for(lambda: c.sender.stats().num_quarantined == 1)
    assert c.freed == [] and c.sender.stats().num_held == 1
    client.close()


def test_hold_deadline_frees_and_counts_expired(ctx):
    c = ctx()
    c.hold("never", hold_timeout_s=0.2)
    c.hold("soon")
    wait_for(lambda: c.freed == ["never"], timeout_s=3.0)
    stats = c.sender.stats()
    assert stats.num_held == 1 and stats.metrics.expired_holds == 1 and stats.num_quarantined == 0


def _stall_after(monkeypatch, num_messages: int) -> None:
    """The ctx stops posting after `num_messages` messages per stream (it stays alive)."""
    original = Outbound._post

    def post(self, plane, index):
        return False if index >= num_messages else original(self, plane, index)

    monkeypatch.setattr(Outbound, "_post", post)


def test_cancel_mid_transfer_drains_posted_messages_then_both_sides_free(ctx, monkeypatch):
    _stall_after(monkeypatch, 3)
    c = ctx(message_bytes=1000)
    params = c.hold("r1")
    gens = [Gen(config(message_bytes=1000), r, 2) for r in range(2)]
    for gen in gens:
        gen.rx.begin("g1", params)
    inbound = gens[0].rx.receiver.inbounds["g1"]
    wait_for(lambda: (gens[0].rx.check(), gens[1].rx.check()) and sum(r.is_done for r in inbound.transport.recvs) == 3)
    for gen in gens:  # the client went away: the leader's abort reaches every rank of the group
        assert gen.rx.cancel("g1") and not gen.rx.cancel("g1")
    out = drive(gens, lambda o: len(o["freed"].get("g1", [])) == 2)
    assert "g1" not in out["failed"] and "g1" not in out["ready"]  # aborted: nothing more to report
    assert [g.used() for g in gens] == [(2, 2), (2, 2)]  # only the padding requests
    wait_for(lambda: c.freed == ["r1"])
    assert c.sender.stats().num_quarantined == 0


def test_silent_ctx_times_out_on_every_rank_and_frees(ctx, monkeypatch):
    _stall_after(monkeypatch, 1)
    c = ctx()
    params = c.hold("r1")
    gens = [Gen(config(kv_transfer_timeout_ms=400), r, 2) for r in range(2)]
    start = time.monotonic()
    for gen in gens:
        gen.rx.begin("g1", params)
    out = drive(gens, lambda o: len(o["freed"].get("g1", [])) == 2)
    assert time.monotonic() - start < 0.4 + 1.5
    errors = out["failed"]["g1"]  # (each rank is its own group here: no shared cause)
    assert len(errors) == 2 and all("timed out after 400 ms waiting for kda_state" in e for e in errors)
    assert all(f"ctx worker {c.endpoint.host}:{c.endpoint.port}" in e for e in errors)
    wait_for(lambda: c.freed == ["r1"])
    assert c.sender.stats().num_quarantined == 0


def test_unreachable_ctx_fails_with_the_peer_named():
    """The connect is retried for the transfer's whole budget, then named as unreachable."""
    gen = Gen(config(rpc_timeout_ms=500, kv_transfer_timeout_ms=1500))
    start = time.monotonic()
    params = DisaggregatedParams(request_type="generation_only", ctx_request_id="r1", first_gen_tokens=[7],
                                 prompt_token_ids=list(range(9)), layout=LAYOUT,
                                 ctx_endpoint=TransceiverEndpoint(host="127.0.0.1", port=1))
    gen.rx.begin("g1", params)
    out = drive([gen], lambda o: "g1" in o["freed"], timeout_s=5.0)
    assert "ctx worker 127.0.0.1:1" in out["failed"]["g1"][0] and "UNAVAILABLE" in out["failed"]["g1"][0]
    assert "could not connect to 127.0.0.1:1 within 1.4 s" in out["failed"]["g1"][0]
    assert time.monotonic() - start >= 1.3
    assert gen.used() == (2, 2)


def test_hostile_plan_from_the_sender_is_rejected(ctx, monkeypatch):
    def lying(messages, kinds):
        descriptors = sender_module.payload_descriptors.__wrapped__(messages, kinds)
        descriptors[-1].message_nbytes[0] += 64  # "I will send you more bytes than your block"
        return descriptors

    lying.__wrapped__ = sender_module.payload_descriptors
    monkeypatch.setattr(sender_module, "payload_descriptors", lying)
    c = ctx()
    params = c.hold("r1")
    gen = Gen(config())
    gen.rx.begin("g1", params)
    out = drive([gen], lambda o: "g1" in o["freed"])
    assert "plan for kv_blocks differs from ours" in out["failed"]["g1"][0]
    wait_for(lambda: c.freed == ["r1"])


def test_a_hold_answered_busy_never_starts_later(ctx):
    """The sender's state stays locked past the RPC timeout (its thread stuck in a pass): the gen
    is told "busy", the RequestShard had no effect (no stream, nothing sent), and once the lock is
    free the hold can still be made."""
    c = ctx(rpc_timeout_ms=300)
    c.hold("r1")
    client = ControlClient(c.endpoint, timeout_s=2.0)
    request = pb.ShardRequest(ctx_request_id="r1", cp_rank=0, cp_size=1, layout_json=LAYOUT.model_dump_json(),
                              num_prompt_tokens=NUM_TOKENS, max_message_bytes=1 << 20,
                              ucx_worker_address=Gen(config()).rx.receiver.plane.address)
    stuck = threading.Thread(target=c.sender._locked, args=(time.sleep, 1.0))  # locked for 1 s
    stuck.start()
    time.sleep(0.05)
    began = time.monotonic()
    busy = client.request_shard(request)
    assert not busy.accepted and "busy" in busy.error and "0.3s" in busy.error
    assert 0.25 <= time.monotonic() - began < 1.0  # answered at the RPC timeout, not when the lock freed
    stuck.join(5)
    assert c.sender._holds["r1"].outbounds == {}  # the busy command never ran
    assert client.request_shard(request).accepted  # and the hold can still be made
    client.close()


def test_commands_of_a_stuck_sender_are_a_named_busy_error(ctx):
    """The engine thread's hold / stats on a sender whose state stays locked fail by name within
    the RPC timeout instead of waiting for ever, and the refused hold registered nothing."""
    from helixserve.transceiver.ctx.sender import SenderBusyError

    c = ctx(rpc_timeout_ms=200)
    stuck = threading.Thread(target=c.sender._locked, args=(time.sleep, 1.0))
    stuck.start()
    time.sleep(0.05)
    with pytest.raises(SenderBusyError, match="locked for 0.2 s"):
        c.sender.stats()
    with pytest.raises(SenderBusyError, match="locked for 0.2 s"):
        c.sender.hold("r2", c.manager.allocate("r2", NUM_TOKENS), NUM_TOKENS, [7])
    stuck.join(5)
    assert c.sender.stats().num_held == 0
    c.manager.free("r2")  # the caller frees what it allocated (as the ctx worker does on OFFER_FAILED)


def test_a_refused_duplicate_hold_leaves_the_live_one_alone(ctx):
    """A second receiver asking for a cp_rank already picked up is refused, and its failure sends
    no Cancel: the hold goes on, the other cp_rank still gets its shard and the ctx frees it as
    completed (a rejected request never touches another's cache)."""
    c = ctx()
    params = c.hold("r1")
    first, duplicate, second = Gen(config(), 0, 2), Gen(config(), 0, 2), Gen(config(), 1, 2)
    first.rx.begin("g1", params)
    assert drive([first], lambda o: "g1" in o["ready"] or o["failed"])["ready"] == {"g1": [0]}
    duplicate.rx.begin("g2", params)
    out = drive([duplicate], lambda o: "g2" in o["freed"])
    assert "already picked this request up" in out["failed"]["g2"][0]
    assert duplicate.used() == (2, 2)  # its shard's blocks and slot are freed (padding left)
    second.rx.begin("g1", params)
    out = drive([second], lambda o: "g1" in o["ready"] or o["failed"])
    assert out["ready"] == {"g1": [0]}, out["failed"]
    wait_for(lambda: c.freed == ["r1"])
    stats = c.sender.stats()
    assert stats.metrics.completed == 1 and stats.metrics.cancellations == 0
