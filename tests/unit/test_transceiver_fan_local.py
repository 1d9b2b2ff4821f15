"""Fan-in over real UCX and real gRPC, in one process: the ranks of a ctx world of tp N (each its
real KVSender over the part of a single-process prefill its rank holds) and gen ranks of
(dp, cp) whose real KVReceivers receive one stream per ctx rank that holds part of their shard
(`KVTicket.source_tickets`) into one session, through the gen server's RankTransfers and a
consensus; every gen rank's pools equal its shard of the single-process cache, and every ctx rank
frees the request once the gen ranks it sent to acknowledged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("ucxx")

from helixserve.config_transceiver import TransceiverConfig  # noqa: E402
from helixserve.protocol import transfer_pb2 as pb  # noqa: E402
from helixserve.transceiver.fan import targets  # noqa: E402
from helixserve.transceiver.gen.control_client import ControlClient  # noqa: E402
from helixserve.transceiver.gen.receiver import KVReceiver  # noqa: E402
from tests.unit.transceiver_harness import (LAYOUT, TPB, Ctx, CtxWorld, GenPools, RankReception,  # noqa: E402
                                           drive, wait_for)

GEN_LAYOUTS = [(1, 1), (1, 2), (2, 2), (1, 4)]  # (dp, cp)


def config(**overrides) -> TransceiverConfig:
    return TransceiverConfig(**{"kv_transfer_timeout_ms": 5000, "rpc_timeout_ms": 2000,
                                "drain_timeout_ms": 1000, **overrides})


@pytest.fixture
def world():
    made: list = []

    def make(tp: int, **overrides) -> CtxWorld:
        full = Ctx(config(**overrides))
        made.append(full)
        made.append(CtxWorld(full, config(**overrides), tp))
        return made[-1]

    yield make
    for item in reversed(made):
        item.close()


class GenRank(GenPools):
    """One gen rank: its pools and its receptions as a gen world runs them (RankTransfers and a
    consensus of its own: the group agrees through its ranks' identical outcomes here)."""

    def __init__(self, cp_rank: int, cp_size: int, gen_rank: int) -> None:
        super().__init__(cp_rank, cp_size)
        self.rx = RankReception(KVReceiver(config(message_bytes=1000), LAYOUT, cp_rank=cp_rank, cp_size=cp_size,
                                           gen_rank=gen_rank), self.manager, self.caches)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dp, cp_size", GEN_LAYOUTS, ids=[f"dp{d}-cp{c}" for d, c in GEN_LAYOUTS])
@pytest.mark.parametrize("num_tokens", [1, 4 * TPB, 4 * TPB + 1, 23])
def test_each_gen_rank_receives_its_shard_from_the_ctx_ranks_that_hold_it(world, tp, dp, cp_size, num_tokens):
    w = world(tp, message_bytes=1000)
    groups = []
    for group in range(dp):  # each dp group receives its own request, the second one token longer
        ticket = w.hold(f"r{group}", num_tokens + group)
        gens = [GenRank(r, cp_size, group * cp_size + r) for r in range(cp_size)]
        for r, gen in enumerate(gens):
            sources = ticket.source_tickets(r, cp_size)
            assert [t.ctx_endpoint for t in sources] == [w.ranks[t.layout.ctx_rank].endpoint for t in sources]
            gen.rx.begin(f"g{group}", ticket)
        groups.append(gens)
    try:
        for group, gens in enumerate(groups):
            out = drive(gens, lambda o, g=group, n=len(gens): len(o["ready"].get(f"g{g}", [])) == n or o["failed"])
            assert not out["failed"], out["failed"]
            for r, gen in enumerate(gens):
                got, want = gen.received(f"g{group}"), w.full.expected_shard(f"r{group}", r, cp_size)
                for part in ("mla", "kda", "conv"):
                    assert got[part].keys() == want[part].keys()
                    for layer in want[part]:
                        assert torch.equal(got[part][layer], want[part][layer].reshape(got[part][layer].shape)), (
                            group, r, part, layer)
        wait_for(lambda: all(sorted(rank.freed) == [f"r{g}" for g in range(dp)] for rank in w.ranks))  # all acked
    finally:
        for gens in groups:
            for gen in gens:
                gen.rx.close()


def test_a_ctx_rank_that_does_not_hold_the_request_fails_it_and_the_others_free_it(world):
    w = world(2)
    ticket = w.hold("r1", 23)
    assert w.ranks[1].sender.cancel("r1", "client gone")  # rank 1 no longer serves it
    gen = GenRank(0, 1, 0)
    try:
        gen.rx.begin("g1", ticket)
        out = drive([gen], lambda o: "g1" in o["freed"])
        error = out["failed"]["g1"][0]
        assert f"{w.ranks[1].endpoint.host}:{w.ranks[1].endpoint.port}" in error and "not held here" in error, error
        assert "g1" not in out["ready"] and gen.used() == (2, 2) and gen.rx.receiver.inbounds == {}
        wait_for(lambda: w.ranks[0].freed == ["r1"] and w.ranks[1].freed == ["r1"])  # both ctx ranks freed it
    finally:
        gen.rx.close()


def test_a_ctx_rank_refuses_a_gen_rank_of_another_mapping_or_one_it_holds_nothing_of(world):
    w = world(2)
    w.hold("r1", 23)  # 6 blocks: ctx 1 holds 1, 3, 5; heads [2, 4)
    assert targets(6, 4, 1, 2, 4) == [1, 2, 3]  # gen ranks of cp 4 that ctx 1 sends to
    rank1 = w.ranks[1]
    client = ControlClient(rank1.endpoint, timeout_s=2.0)
    rx = KVReceiver(config(), LAYOUT)
    try:
        base = dict(ctx_request_id="r1", num_prompt_tokens=23, max_message_bytes=1 << 20,
                    ucx_worker_address=rx.plane.address, cp_size=4)
        mapped = w.layout.model_copy(update={"ctx_rank": 1})
        cases = [({"cp_rank": 1, "layout_json": w.layout.model_dump_json()}, "ctx_rank: 1 != 0"),
                 ({"cp_rank": 1, "layout_json": LAYOUT.model_dump_json()}, "ctx_tp_size: 2 != 1"),
                 ({"cp_rank": 0, "layout_json": mapped.model_dump_json()},
                  "needs nothing ctx rank 1 of 2 holds"),
                 ({"cp_rank": 1, "cp_size": 8, "layout_json": mapped.model_dump_json()},
                  "num_kda_heads 4 cannot be split over cp_size=8")]
        for update, cause in cases:
            reply = client.request_shard(pb.ShardRequest(**{**base, **update}))
            assert not reply.accepted and cause in reply.error, (update, reply.error)
        reply = client.request_shard(pb.ShardRequest(**{**base, "cp_rank": 1, "layout_json": mapped.model_dump_json()}))
        assert reply.accepted, reply.error  # blocks 1, 5 of gen rank 1, none of its heads
        kinds = pb.PayloadDescriptor.Kind
        assert {p.kind for p in reply.payloads} == {kinds.Value("AUX"), kinds.Value("KV_BLOCKS")}
        with pytest.raises(ValueError, match="ctx rank 1 of 2 cannot hold a cp_rank=0 cp_size=1 handle"):
            rank1.sender.hold("r2", w.full.manager.allocate("r2", 5), 5, [7])
    finally:
        client.close()
        rx.close()


def test_a_ctx_rank_gone_before_the_transfer_fails_it_within_the_timeout_naming_that_rank(world):
    w = world(2)
    ticket = w.hold("r1", 23)
    w.ranks[1].sender.stop(timeout_s=1.0)  # its control plane and data plane are gone
    gen = GenRank(0, 2, 0)  # needs blocks 0, 2, 4 (ctx 0) and heads [0, 2) (ctx 0); rank 1 of cp 2 needs ctx 1
    other = GenRank(1, 2, 1)
    try:
        gen.rx.begin("g1", ticket)
        other.rx.begin("g1", ticket)
        out = drive([gen, other], lambda o: len(o["freed"].get("g1", [])) + len(o["ready"].get("g1", [])) == 2,
                    timeout_s=8.0)
        assert out["ready"].get("g1") == [0]  # rank 0 owes nothing to ctx 1 (each rank agrees alone here)
        error = out["failed"]["g1"][0]
        assert f"{w.ranks[1].endpoint.host}:{w.ranks[1].endpoint.port}" in error, error
        assert "did not answer RequestShard" in error, error
        assert other.used() == (2, 2) and other.rx.receiver.inbounds == {}  # its padding requests only
    finally:
        gen.rx.close()
        other.rx.close()


def test_a_ctx_world_ticket_without_its_ranks_endpoints_is_refused_before_any_request(world):
    """Rank 0's part alone would be a partial shard: the request fails with the cause named, nothing
    is asked of any ctx rank, its blocks are freed, and the ticket of the whole world still works."""
    w = world(2)
    ticket = w.hold("r1", 23)
    gen = GenRank(0, 1, 0)
    try:
        gen.rx.begin("g1", dataclasses.replace(ticket, ctx_endpoints=()))
        out = drive([gen], lambda o: "g1" in o["freed"])
        assert "ctx_tp_size 2 holds the request, the ticket names none of its ranks' endpoints" in out["failed"]["g1"][0]
        assert gen.used() == (2, 2) and all(rank.sender.stats().num_held == 1 for rank in w.ranks)
        with pytest.raises(ValueError, match="1 ctx endpoints for ctx_tp_size 2"):
            dataclasses.replace(ticket, ctx_endpoints=ticket.ctx_endpoints[:1])
        gen.rx.begin("g2", ticket)
        assert drive([gen], lambda o: "g2" in o["ready"] or o["failed"])["ready"] == {"g2": [0]}
    finally:
        gen.rx.close()
