"""Granted pulls on the ctx side, over the real KVSender and its gRPC service: the lease word is
held from `hold` until the request is freed, and zeroed *before* the engine gets the blocks back
whatever frees them (every cp rank's ack, a cancel, the hold deadline, a stop); acks of a pull
that never asked first complete the hold only once every cp rank of the stated group acked; a
grant's MAC names exactly its request. The gen side's copy needs two processes on a GPU:
tests/integration/test_transceiver_cuda.py (GPU-marked).

On CPU a ctx grants nothing (its pools cannot be opened over CUDA IPC); these tests give its
export the lease board a GPU export makes, in a temporary directory."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ucxx")

from helixserve.config_transceiver import TransceiverConfig  # noqa: E402
from helixserve.protocol import transfer_pb2 as pb  # noqa: E402
from helixserve.protocol.disagg import PullGrant  # noqa: E402
from helixserve.transceiver.control import ControlClient  # noqa: E402
from helixserve.transceiver.grant import grant_matches, make_grant, request_bytes  # noqa: E402
from helixserve.transceiver.lease import LeaseBoard, LeaseError  # noqa: E402
from tests.unit.transceiver_harness import NUM_TOKENS, Ctx  # noqa: E402


def _config(**overrides) -> TransceiverConfig:
    return TransceiverConfig(**{"kv_transfer_timeout_ms": 5000, "rpc_timeout_ms": 2000, "drain_timeout_ms": 1000,
                                **overrides})


def _wait_for(predicate, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


# -- lease words ----------------------------------------------------------------------------------

def test_lease_words_are_seen_across_mappings_and_revoked_by_serial(tmp_path):
    ctx = LeaseBoard.create(num_words=4, directory=tmp_path)
    gen = LeaseBoard.attach(str(ctx.path), 4, directory=tmp_path)
    ctx.grant(5)
    assert gen.holds(5) and not gen.holds(1) and not gen.holds(0)
    ctx.grant(9)  # 9 % 4 == 5 % 4: the newer grant takes the word; the older one is no longer held
    assert gen.holds(9) and not gen.holds(5)
    ctx.revoke(5)  # revoking a grant that lost its word leaves the newer one alone
    assert gen.holds(9)
    ctx.revoke(9)
    assert not gen.holds(9)
    ctx.grant(2), ctx.grant(3)
    ctx.close()  # a stopping ctx revokes everything and removes its file
    assert not gen.holds(2) and not gen.holds(3) and not ctx.path.exists()
    with pytest.raises(ValueError, match="serial is >= 1"):
        LeaseBoard.create(num_words=4, directory=tmp_path).grant(0)


def test_attaching_anything_but_a_lease_file_is_a_named_error(tmp_path):
    board = LeaseBoard.create(num_words=8, directory=tmp_path)
    with pytest.raises(LeaseError, match="not a lease file"):
        LeaseBoard.attach("/etc/passwd", 8, directory=tmp_path)
    with pytest.raises(LeaseError, match="not a lease file"):
        LeaseBoard.attach(str(board.path), 0, directory=tmp_path)
    with pytest.raises(LeaseError, match="is not 16 words long"):
        LeaseBoard.attach(str(board.path), 16, directory=tmp_path)
    with pytest.raises(LeaseError, match="cannot open"):
        LeaseBoard.attach(str(tmp_path / "helixserve-lease-0123456789abcdef"), 8, directory=tmp_path)
    board.close()


def test_a_grant_matches_only_its_own_request():
    key = b"k" * 32
    grant = make_grant(key, "r1", 83, [7, 8], epoch=11, serial=3, block_ids=[4, 9, 2], slot=1)
    assert grant_matches(key, grant, "r1", 83, [7, 8])
    assert not grant_matches(b"x" * 32, grant, "r1", 83, [7, 8])
    for request in (("r2", 83, [7, 8]), ("r1", 84, [7, 8]), ("r1", 83, [7])):
        assert not grant_matches(key, grant, *request)
    for field, value in (("block_ids", [4, 2, 9]), ("slot", 0), ("serial", 4), ("epoch", 12)):
        assert not grant_matches(key, PullGrant(**{**grant.model_dump(), field: value}), "r1", 83, [7, 8])
    # fields cannot trade bytes: a first token moved into the block list, a shorter id, are other requests
    moved = make_grant(key, "r1", 83, [7], epoch=11, serial=3, block_ids=[8, 4, 9, 2], slot=1)
    assert moved.mac != grant.mac and not grant_matches(key, moved, "r1", 83, [7, 8])
    assert not grant_matches(key, grant, "r", 83, [7, 8]) and not grant_matches(key, grant, "r1\x00", 83, [7, 8])
    assert not grant_matches(key, grant, "r1", 83, [7, 1 << 64])  # no int64: no grant, no exception


# -- the sender's granted holds ----------------------------------------------------------------

@pytest.fixture
def granting(tmp_path):
    made: list[Ctx] = []

    def make(**overrides) -> Ctx:
        c = Ctx(_config(**overrides))
        c.sender._export.lease = LeaseBoard.create(num_words=64, directory=tmp_path)
        c.revoked_at_free = {}
        on_free = c.sender.on_free

        def record(request_id: str) -> None:  # the lease state when the engine gets the blocks back
            c.revoked_at_free[request_id] = not c.sender._export.lease.holds(c.serials[request_id])
            on_free(request_id)
        c.sender.on_free = record
        c.serials = {}
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _hold(c: Ctx, rid: str, **kwargs) -> PullGrant:
    handle = c.manager.allocate(rid, NUM_TOKENS)
    grant = c.sender.hold(rid, handle, NUM_TOKENS, [7], **kwargs)
    assert grant is not None
    c.serials[rid] = grant.serial
    assert grant.block_ids == list(handle.block_ids) and grant.slot == handle.slot
    assert grant_matches(c.sender._export.grant_key, grant, rid, NUM_TOKENS, [7])
    return grant


def _ack(client: ControlClient, rid: str, cp_rank: int, cp_size: int, success: bool = True) -> pb.AckReply:
    return client.acknowledge(pb.AckRequest(ctx_request_id=rid, cp_rank=cp_rank, cp_size=cp_size, gen_rank=cp_rank,
                                            success=success))


@pytest.mark.parametrize("cp_size", [1, 2])
def test_acks_of_every_cp_rank_complete_a_granted_hold_and_revoke_before_the_free(granting, cp_size):
    c = granting()
    grant = _hold(c, "r1")
    lease = c.sender._export.lease
    assert lease.holds(grant.serial)
    time.sleep(0.05)  # sender passes: a hold nobody acked yet is not complete (no cp_size known)
    assert c.freed == [] and c.sender.stats().num_held == 1
    client = ControlClient(c.endpoint, timeout_s=2.0)
    for rank in range(cp_size):
        assert c.freed == []
        reply = _ack(client, "r1", rank, cp_size)
        assert reply.known and not reply.error
    _wait_for(lambda: c.freed == ["r1"])
    assert c.revoked_at_free == {"r1": True}, "the lease word was still set when the blocks were freed"
    stats = c.sender.stats()
    assert stats.metrics.completed == 1 and stats.num_held == 0 and stats.num_granted == 1
    assert stats.metrics.bytes_transferred == request_bytes(c.sender.layout.model_dump_json(), NUM_TOKENS) > 0
    client.close()


def test_every_way_a_granted_hold_ends_revokes_its_lease_first(granting):
    c = granting(kv_transfer_timeout_ms=300)
    _hold(c, "cancelled")
    _hold(c, "expired", hold_timeout_s=0.2)
    _hold(c, "gave-up")
    client = ControlClient(c.endpoint, timeout_s=2.0)
    assert c.sender.cancel("cancelled", "the client went away")
    assert _ack(client, "gave-up", 0, 1, success=False).known
    _wait_for(lambda: sorted(c.freed) == ["cancelled", "expired", "gave-up"])
    assert c.revoked_at_free == {"cancelled": True, "expired": True, "gave-up": True}
    assert c.sender.stats().metrics.expired_holds == 1 and c.sender.stats().num_granted == 0
    client.close()


def test_an_ack_with_an_impossible_cp_group_is_refused_and_frees_nothing(granting):
    c = granting()
    grant = _hold(c, "r1")
    client = ControlClient(c.endpoint, timeout_s=2.0)
    for cp_rank, cp_size in ((2, 2), (0, 3), (0, 0)):
        reply = _ack(client, "r1", cp_rank, cp_size)
        assert reply.known and "does not fit this request" in reply.error
    assert _ack(client, "r1", 0, 2).error == ""
    time.sleep(0.05)
    assert c.freed == [] and c.sender._export.lease.holds(grant.serial)  # rank 1 of 2 has not acked
    assert "unexpected rank" in _ack(client, "r1", 3, 4).error  # the group's size is fixed by then
    assert _ack(client, "r1", 1, 2).error == ""
    _wait_for(lambda: c.freed == ["r1"])
    client.close()


def test_a_stopped_sender_leaves_no_grant_held(granting):
    c = granting()
    grant = _hold(c, "r1")
    lease = c.sender._export.lease
    gen_view = LeaseBoard.attach(str(lease.path), lease.num_words, directory=lease.path.parent)
    assert gen_view.holds(grant.serial)
    c.sender.stop()
    assert not gen_view.holds(grant.serial) and not lease.path.exists()


def test_a_ctx_on_cpu_grants_nothing():
    c = Ctx(_config())
    try:
        assert c.sender._export.lease is None
        assert c.sender.hold("r1", c.manager.allocate("r1", NUM_TOKENS), NUM_TOKENS, [7]) is None
    finally:
        c.close()


# -- a gen rank's prefetch of the pools ------------------------------------------------------------

def test_pools_are_asked_for_again_until_a_late_ctx_answers():
    """A gen rank starts before its ctx listens: DescribePools is asked again every retry until
    the ctx answers (here a CPU ctx: "not on a GPU" is an answer), and gives up after the last
    attempt with the error, never blocking the caller."""
    from helixserve.parallel.ports import free_ports
    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver.cuda_ipc import ask_until_answered
    from helixserve.transceiver.sender import KVSender
    from tests.unit.transceiver_harness import LAYOUT

    cfg = _config(rpc_timeout_ms=300)
    (port,) = free_ports(1)
    endpoint = TransceiverEndpoint(host="127.0.0.1", port=port)
    request = pb.PoolsRequest(gen_rank=0, host_id="h")
    given_up = ask_until_answered(lambda: ControlClient(endpoint, 0.3, config=cfg), request, 0.05, 2)
    began = time.monotonic()
    answered = ask_until_answered(lambda: ControlClient(endpoint, 0.3, config=cfg), request, 0.1, 100)
    assert time.monotonic() - began < 0.1 and not answered.done()
    with pytest.raises(Exception):
        given_up.result(timeout=5)
    time.sleep(0.5)
    assert not answered.done()
    c = Ctx(cfg)
    late = KVSender(cfg, LAYOUT, c.caches, lambda _: None, port=port)
    late.start()
    try:
        reply = answered.result(timeout=10)
        assert not reply.supported and "cpu" in reply.reason
    finally:
        late.stop()
        c.close()
