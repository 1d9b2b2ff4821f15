"""KVIntake at its limits (cp = 1, the local consensus): received requests wait FIFO while the cache
is full and start as it frees; a failed or unstartable reception fails only its request and frees
its cache; an abort in every state frees everything; a request starts only with a running slot."""

from __future__ import annotations

import pytest

from helixserve.engine.kv_intake import KVIntake, RankTransfers
from helixserve.engine.request import Request, RequestStatus, SamplingParams
from helixserve.kvcache.manager import CacheManager
from helixserve.protocol.disagg import TransceiverEndpoint
from helixserve.transceiver.consensus import TransferConsensus
from helixserve.transceiver.ticket import KVTicket
from tests.unit.transceiver_harness import LAYOUT

TPB = 4


class _Receiver:
    """Reports each started reception after ``polls`` polls, failing the ids in ``fail``."""

    def __init__(self, polls: int = 1, fail: frozenset[str] = frozenset(), refuse: frozenset[str] = frozenset()) -> None:
        self.polls, self.fail, self.refuse = polls, fail, refuse
        self.pending: dict[str, int] = {}
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def start(self, request_id, handle, caches, ticket) -> None:  # noqa: ANN001
        if request_id in self.refuse:
            raise RuntimeError(f"bad ticket of ctx request {ticket.ctx_request_id!r}")
        self.started.append(request_id)
        self.pending[request_id] = self.polls

    def poll(self, wait: bool = False) -> dict[str, str | None]:
        done = {}
        for rid in list(self.pending):
            self.pending[rid] -= 1
            if self.pending[rid] == 0:
                del self.pending[rid]
                done[rid] = f"transfer of {rid} failed" if rid in self.fail else None
        return done

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.pending.pop(request_id, None)


def _intake(receiver: _Receiver, num_blocks: int = 4, num_slots: int = 4) -> tuple[KVIntake, CacheManager]:
    cache = CacheManager(num_blocks, num_slots, TPB)
    return KVIntake(cache, RankTransfers(receiver, None, TransferConsensus(is_local=True)), None), cache


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), forced_output_token_ids=[7])


def _ticket(rid: str, n: int) -> KVTicket:
    """Its ticket (the fake receiver dials nothing)."""
    return KVTicket(f"ctx-{rid}", TransceiverEndpoint(host="127.0.0.1", port=1), LAYOUT, n, (7,))


class _Starts:
    def __init__(self, slots: int = 8) -> None:
        self.slots, self.started = slots, []

    def can_start(self) -> bool:
        return len(self.started) < self.slots

    def __call__(self, request: Request) -> list:
        self.started.append(request.request_id)
        return []


def test_requests_wait_fifo_while_the_cache_is_full_and_start_as_it_frees() -> None:
    receiver = _Receiver()
    intake, cache = _intake(receiver, num_blocks=4)
    intake.add(_request("a", 3 * TPB), _ticket("a", 3 * TPB))  # 3 blocks
    intake.add(_request("b", 2 * TPB), _ticket("b", 2 * TPB))  # 2 blocks: does not fit beside a
    intake.add(_request("c", 1), _ticket("c", 1))  # 1 block: would fit, but waits behind b (FIFO)
    starts = _Starts()
    intake.step(starts.can_start, starts)
    assert receiver.started == ["a"] and "b" in intake and "c" in intake
    assert starts.started == ["a"]  # arrived after one poll
    cache.free("a")  # a finished decoding elsewhere (the scheduler frees it)
    intake.step(starts.can_start, starts)
    assert receiver.started == ["a", "b", "c"] and starts.started == ["a", "b", "c"]
    assert intake.num_waiting == 0


def test_a_full_cache_at_exactly_its_capacity_admits_and_one_more_block_waits() -> None:
    receiver = _Receiver(polls=5)
    intake, cache = _intake(receiver, num_blocks=4)
    intake.add(_request("full", 4 * TPB), _ticket("full", 4 * TPB))  # exactly the cache
    intake.add(_request("one", 1), _ticket("one", 1))
    starts = _Starts()
    intake.step(starts.can_start, starts)
    assert receiver.started == ["full"] and cache.stats().num_free_blocks == 0
    assert intake.num_waiting == 2


def test_a_failed_transfer_fails_only_its_request_and_frees_its_cache() -> None:
    receiver = _Receiver(fail=frozenset({"bad"}))
    intake, cache = _intake(receiver)
    intake.add(_request("bad", 5), _ticket("bad", 5))
    intake.add(_request("good", 5), _ticket("good", 5))
    starts = _Starts()
    updates = intake.step(starts.can_start, starts)
    assert [(u.request_id, u.status, u.error) for u in updates] == [
        ("bad", RequestStatus.FINISHED_ERROR, "transfer of bad failed")]
    assert starts.started == ["good"] and "bad" not in cache and "good" in cache


def test_a_reception_that_cannot_start_fails_its_request_through_the_consensus() -> None:
    receiver = _Receiver(refuse=frozenset({"x"}))
    intake, cache = _intake(receiver)
    intake.add(_request("x", 5), _ticket("x", 5))
    starts = _Starts()
    updates = intake.step(starts.can_start, starts)
    assert len(updates) == 1 and updates[0].status is RequestStatus.FINISHED_ERROR
    assert "bad ticket of ctx request 'ctx-x'" in updates[0].error
    assert "x" not in cache and cache.stats().num_used_slots == 0


@pytest.mark.parametrize("state", ["waiting", "receiving", "ready"])
def test_an_abort_in_every_state_frees_everything(state: str) -> None:
    receiver = _Receiver(polls=1 if state == "ready" else 3)
    intake, cache = _intake(receiver, num_blocks=2)
    if state == "waiting":
        intake.add(_request("blocker", 2 * TPB), _ticket("blocker", 2 * TPB))
    intake.add(_request("r", TPB), _ticket("r", TPB))
    starts = _Starts(slots=0)  # nothing may start: a ready request stays ready
    intake.step(starts.can_start, starts)
    assert "r" in intake
    assert intake.abort("r") and not intake.abort("r")
    assert "r" not in intake and "r" not in cache
    if state == "receiving":
        assert receiver.cancelled == ["r"]
    intake.abort_all()
    assert cache.stats().num_used_blocks == cache.stats().num_used_slots == 0 and intake.num_waiting == 0


def test_a_ready_request_starts_only_when_a_running_slot_is_free() -> None:
    receiver = _Receiver()
    intake, _ = _intake(receiver)
    intake.add(_request("a", 3), _ticket("a", 3))
    intake.add(_request("b", 3), _ticket("b", 3))
    starts = _Starts(slots=1)
    intake.step(starts.can_start, starts)
    assert starts.started == ["a"] and "b" in intake  # b arrived and waits for a slot
    starts.slots = 2
    intake.step(starts.can_start, starts)
    assert starts.started == ["a", "b"] and "b" not in intake


def test_a_request_from_a_ctx_world_gets_each_ctx_ranks_blocks_as_one_run() -> None:
    """From a ctx world of 2 ranks the blocks of each ctx rank (even, odd logical blocks) are
    consecutive physical blocks, so each rank's messages land in place; from one ctx rank the
    blocks stay as allocated."""
    receiver = _Receiver(polls=3)
    intake, cache = _intake(receiver, num_blocks=16)
    world = LAYOUT.model_copy(update={"ctx_tp_size": 2})
    intake.add(_request("w", 5 * TPB), KVTicket("ctx-w", TransceiverEndpoint(host="127.0.0.1", port=1), world,
                                                5 * TPB, (7,), ctx_endpoints=(
                                                    TransceiverEndpoint(host="127.0.0.1", port=1),
                                                    TransceiverEndpoint(host="127.0.0.1", port=2))))
    intake.add(_request("one", 3 * TPB), _ticket("one", 3 * TPB))
    intake.step(_Starts().can_start, _Starts())
    assert cache.get("w").block_ids == [0, 3, 1, 4, 2]  # logical 0, 2, 4 in 0..2; 1, 3 in 3..4
    assert cache.get("w").block_table() == [0, 3, 1, 4, 2]
    assert cache.get("one").block_ids == [5, 6, 7]
