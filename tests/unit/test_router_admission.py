"""The router's admission (torch-free): at most what the workers admit in flight, a bounded FIFO
queue, 429 at once beyond it, places given back by clients that leave, and slots handed out when
the workers' capacity grows."""

import asyncio

import pytest

from helixserve.protocol import QueueFullError

pytest.importorskip("aiohttp", reason="server deps (fastapi, uvicorn, aiohttp, prometheus-client) not installed")
from helixserve.router.app import Admission  # noqa: E402


class _Capacity:
    def __init__(self, value: int | None) -> None:
        self.value = value

    def __call__(self) -> int | None:
        return self.value


def test_the_limit_is_the_workers_capacity_when_below_max_inflight():
    capacity = _Capacity(None)
    admission = Admission(max_inflight=128, max_queue_len=4, capacity=capacity)
    assert admission.limit == 128  # nothing said: the router's own bound
    capacity.value = 80
    assert admission.limit == 80
    capacity.value = 500
    assert admission.limit == 128


def test_beyond_capacity_and_queue_the_router_answers_429_at_once():
    async def run() -> None:
        admission = Admission(max_inflight=128, max_queue_len=2, capacity=_Capacity(3))
        for _ in range(3):
            await admission.acquire()  # the workers' capacity, exactly
        queued = [asyncio.create_task(admission.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        assert admission.num_inflight == 3 and admission.num_waiting == 2
        with pytest.raises(QueueFullError, match="the workers admit 3") as info:
            await admission.acquire()  # no await on anything: refused on the spot
        assert info.value.status_code == 429 and info.value.headers["Retry-After"] == "1"
        admission.release()  # one slot back: the first queued one takes it (FIFO)
        await asyncio.sleep(0)
        assert queued[0].done() and not queued[1].done() and admission.num_inflight == 3
        queued[1].cancel()  # a client that leaves gives its place up
        await asyncio.sleep(0)
        assert admission.num_waiting == 0 and admission.num_inflight == 3

    asyncio.run(run())


def test_capacity_growing_hands_slots_to_the_waiters():
    async def run() -> None:
        capacity = _Capacity(1)
        admission = Admission(max_inflight=8, max_queue_len=8, capacity=capacity)
        await admission.acquire()
        waiters = [asyncio.create_task(admission.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        assert admission.num_waiting == 3
        capacity.value = 3  # e.g. a second worker became healthy
        admission.wake()
        await asyncio.sleep(0)
        assert [w.done() for w in waiters] == [True, True, False] and admission.num_inflight == 3
        capacity.value = 1  # shrinking takes nothing back: releases just do not refill
        admission.release()
        admission.release()
        await asyncio.sleep(0)
        assert not waiters[2].done() and admission.num_inflight == 1
        admission.release()
        await asyncio.sleep(0)
        assert waiters[2].done() and admission.num_inflight == 1

    asyncio.run(run())


def test_a_waiter_cancelled_just_as_it_got_its_slot_gives_it_back():
    async def run() -> None:
        admission = Admission(max_inflight=1, max_queue_len=1)
        await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        admission.release()  # the slot is handed to the waiter...
        waiter.cancel()  # ...which is cancelled before it ran
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert admission.num_inflight == 0 and admission.num_waiting == 0
        await admission.acquire()  # the slot is free

    asyncio.run(run())
