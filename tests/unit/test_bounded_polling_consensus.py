"""Consensus over REAL multi-process gloo worlds (3 ranks, spawned once for the module)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from helixserve.clock import FakeClock
from helixserve.transceiver.base import PayloadKind, ReceiverSession
from helixserve.transceiver.consensus import LocalStatus, TransferConsensus, combine
from helixserve.transceiver.fake import FakeFault, FakeHandle
from helixserve.transceiver.polling import TransferPoller

WORLD = 3
COLLECTIVES = ("all_gather_object", "all_gather", "all_reduce", "broadcast", "all_to_all",
               "gather", "scatter", "reduce_scatter", "barrier", "all_gather_into_tensor")
UNION_CASE = [  # rank -> (cancelled, failed, completed, quiesced)
    ({"c1"}, {"f0"}, {"a", "b", "f0"}, {"a", "b", "c1", "x"}),
    (set(), {"f1"}, {"a", "b", "c1"}, {"a", "b", "c1", "x"}),
    ({"c2"}, set(), {"a", "f1"}, {"a", "c1", "c2", "x"}),
]


def _count_collectives(counts: dict[str, int]) -> None:
    """Wrap every collective so only top-level calls count (all_gather_object uses all_gather)."""
    depth = [0]
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            if depth[0] == 0:
                counts[_name] = counts.get(_name, 0) + 1
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(dist, name, functools.wraps(original)(wrapper))


def _receiver(clock, rid, fault, latency_s=0.01, timeout_s=0.1):
    session = ReceiverSession(rid, timeout_s=timeout_s, clock=clock)
    session.add_task(0, PayloadKind.KV_BLOCKS)
    handle = FakeHandle(clock, fault, latency_s)
    session.attach(0, PayloadKind.KV_BLOCKS, handle)
    return session, handle


def _scenarios(rank: int, counts: dict[str, int]) -> dict:
    out: dict = {}
    consensus = TransferConsensus()  # default group = the 3-rank world

    # skip while the sticky flag is unset on every rank: no collective at all
    before = dict(counts)
    out["skipped"] = consensus.check(LocalStatus())
    out["skip_collectives"] = sum(counts.values()) - sum(before.values())
    try:
        consensus.check(LocalStatus.of(completed=["early"]))
    except ValueError as error:
        out["skip_error"] = str(error)
    consensus.mark_active()  # same step on every rank

    # union / intersection with exactly one batched all-gather
    before = dict(counts)
    out["union"] = consensus.check(LocalStatus.of(*UNION_CASE[rank]))
    out["union_collectives"] = {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}
    before = dict(counts)
    out["sticky"] = consensus.check(LocalStatus())  # still entered: the flag is sticky
    out["sticky_collectives"] = sum(counts.values()) - sum(before.values())

    # a peer's timeout: completes nowhere, then fails everywhere
    clock = FakeClock()
    poller = TransferPoller(clock=clock)
    fault = FakeFault.NEVER_COMPLETE if rank == 2 else FakeFault.NONE
    poller.add(_receiver(clock, "t", fault)[0])
    out["timeout_1"] = consensus.check(LocalStatus.from_poll(poller.poll(1, interval_s=0.02)))
    out["timeout_2"] = consensus.check(LocalStatus.from_poll(poller.poll(1, interval_s=0.2)))

    # cancelled / failed retired only once quiesced on every rank
    clock = FakeClock()
    poller = TransferPoller(clock=clock)
    session, handle = _receiver(clock, "q", FakeFault.STUCK if rank == 1 else FakeFault.NEVER_COMPLETE,
                                timeout_s=5.0)
    poller.add(session)
    if rank == 0:
        session.cancel("client disconnected")
    out["quiesce_1"] = first = consensus.check(LocalStatus.from_poll(poller.poll(0)))
    poller.cancel(first.cancelled | first.failed, "cancelled by the group")  # apply the agreement
    if rank == 1:
        handle.fault = FakeFault.NEVER_COMPLETE  # the stuck write finally drains
    local_2 = LocalStatus.from_poll(poller.poll(0))
    out["quiesce_2"] = consensus.check(local_2)

    # a given subgroup: ranks 0 and 2 only
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        sub_consensus = TransferConsensus(sub)
        sub_consensus.mark_active()
        out["subgroup"] = sub_consensus.check(LocalStatus.of(failed=[f"s{rank}"], completed=["z"]))
        out["subgroup_size"] = sub_consensus.group_size
    out["num_collectives"] = consensus.num_collectives
    return out


def _world_main(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    counts: dict[str, int] = {}
    _count_collectives(counts)
    try:
        results = _scenarios(rank, counts)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("consensus")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_world_main, args=(r, str(tmp / "store"), str(tmp))) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=90)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD, "a consensus rank failed or hung"
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def test_bounded_polling_consensus_union_intersection_single_batched_all_gather(world):
    for rank in range(WORLD):
        result = world[rank]["union"]
        assert result.cancelled == {"c1", "c2"}
        assert result.failed == {"f0", "f1"}
        assert result.completed == {"a"}  # b missing on rank 2; c1 cancelled; f0/f1 failed
        assert result.quiesced == {"a", "c1", "x"}
        assert world[rank]["union_collectives"] == {"all_gather_object": 1}


def test_bounded_polling_consensus_peer_timeout_completes_nowhere_then_fails_everywhere(world):
    for rank in range(WORLD):
        first, second = world[rank]["timeout_1"], world[rank]["timeout_2"]
        assert "t" not in first.completed and "t" not in first.failed  # no rank decodes it
        assert second.failed == {"t"} and "t" not in second.completed  # then it fails everywhere
        assert "t" in second.retirable


def test_bounded_polling_consensus_cancelled_failed_retired_only_when_quiesced(world):
    for rank in range(WORLD):
        first, second = world[rank]["quiesce_1"], world[rank]["quiesce_2"]
        assert first.cancelled == {"q"} and "q" not in first.retirable  # rank 1 still writing
        assert second.cancelled == {"q"} and second.retirable == {"q"}
    assert world[0]["union"].retirable == {"c1"}  # c2 not quiesced on ranks 0/1, f0/f1 nowhere


def test_bounded_polling_consensus_skip_only_when_all_ranks_agree(world):
    for rank in range(WORLD):
        assert world[rank]["skipped"].is_skipped and world[rank]["skip_collectives"] == 0
        assert "mark_active" in world[rank]["skip_error"]  # never skip with something to report
        assert not world[rank]["sticky"].is_skipped and world[rank]["sticky_collectives"] == 1
    # every rank entered the same number of collectives (no rank skipped one its peers entered)
    assert len({world[rank]["num_collectives"] for rank in range(WORLD)}) == 1


def test_bounded_polling_consensus_over_a_given_subgroup(world):
    for rank in (0, 2):
        result = world[rank]["subgroup"]
        assert world[rank]["subgroup_size"] == 2
        assert result.failed == {"s0", "s2"} and result.completed == {"z"}
    assert "subgroup" not in world[1]


def test_bounded_polling_consensus_group_of_one_needs_no_collective(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a group of size 1 must not run a collective")

    monkeypatch.setattr(dist, "all_gather_object", forbidden)
    consensus = TransferConsensus()
    assert consensus.group_size == 1
    result = consensus.check(LocalStatus.of(["c"], ["f"], ["a", "c", "f"], ["a", "c"]))
    assert result.completed == {"a"} and result.retirable == {"c"}


def test_bounded_polling_consensus_combine_rules_are_pure():
    result = combine([(["x"], [], ["a", "x"], ["a"]), ([], ["y"], ["a", "y"], ["a", "y"])])
    assert (result.cancelled, result.failed, result.completed, result.quiesced) == (
        {"x"}, {"y"}, {"a"}, {"a"})


@pytest.mark.parametrize("seed", range(20))
def test_bounded_polling_consensus_group_of_one_is_combine_of_its_report(seed):
    """The group-of-one shortcut gives exactly what combine() gives for that one report,
    causes included (only those of failed or cancelled requests)."""
    import random

    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(8)]
    status = LocalStatus.of(*(rng.sample(ids, rng.randint(0, 4)) for _ in range(4)))
    errors = {rid: f"cause of {rid}" for rid in rng.sample(ids, rng.randint(0, 5))}
    got = TransferConsensus().check(status, errors)
    want = combine([(*status.encode(), errors)])
    assert (got.cancelled, got.failed, got.completed, got.quiesced, dict(got.errors)) == (
        want.cancelled, want.failed, want.completed, want.quiesced, dict(want.errors))
