"""The ctx requests' state machine (:mod:`helixserve.ctx_server.lifecycle`): every legal move,
illegal moves raising :class:`IllegalTransitionError`, duplicate ids refused without touching the
holder, stale events of an earlier admission ignored, and which moves free a held cache."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from helixserve.clock import FakeClock
from helixserve.config import CacheConfig
from helixserve.ctx_server.lifecycle import (Admitted, CancelRequested, CtxRequestLife, CtxState,
                                             DuplicateRequestError, Expired, Finished,
                                             IllegalTransitionError, Offered, Prefilled,
                                             ReleaseCause, ReleaseRequested, SenderFreed, Stopped)
from helixserve.ctx_server.ctx_requests import CtxRequests
from helixserve.engine.async_engine import AsyncEngine
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.errors import RequestRejectedError
from helixserve.serving.engine_errors import to_openai_error

P, H, S, R = CtxState.PREFILLING, CtxState.HELD, CtxState.SENDING, CtxState.RELEASED


def life_in(state: CtxState, rid: str = "a", token: int = 1, clock: FakeClock | None = None) -> CtxRequestLife:
    life = CtxRequestLife(timeout_s=5.0, clock=clock or FakeClock())
    life.apply(Admitted(rid, token))
    if state in (H, S):
        life.apply(Prefilled(rid, token, (7,)))
    if state is S:
        life.apply(Offered(rid, token))
    assert life.state_of(rid) is state
    return life


# (state, event, state after, frees the engine's held cache)
LEGAL = [
    (P, Prefilled("a", 1, (7,)), H, False),
    (P, Finished("a", 1, ReleaseCause.FAILED), R, False),
    (P, Finished("a", 1, ReleaseCause.REFUSED), R, False),
    (P, CancelRequested("a"), P, False),  # flagged: the engine's abort frees it
    (P, ReleaseRequested("a", 1), P, False),
    (P, Stopped("a"), R, False),
    (H, Offered("a", 1), S, False),
    (H, Finished("a", 1, ReleaseCause.FINISHED), R, True),
    (H, Finished("a", 1, ReleaseCause.OFFER_FAILED), R, True),
    (H, Expired("a"), R, True),
    (H, ReleaseRequested("a", 1), R, True),
    (H, CancelRequested("a"), R, True),
    (H, Stopped("a"), R, True),
    (S, SenderFreed("a"), R, True),
    (S, ReleaseRequested("a", 1), S, False),  # the sender frees it once quiesced
    (S, CancelRequested("a"), S, False),
    (S, Stopped("a"), R, True),
]


@pytest.mark.parametrize("state,event,after,frees", LEGAL,
                         ids=[f"{s.value}-{type(e).__name__}" for s, e, _, _ in LEGAL])
def test_legal_transitions(state, event, after, frees):
    life = life_in(state)
    moved = life.apply(event)
    assert (moved.before, moved.after, moved.frees_held_cache) == (state, after, frees)
    assert life.state_of("a") is (None if after is R else after)
    assert life.num_released == int(frees) and life.num_live == int(after is not R)


ILLEGAL = [
    (P, Offered("a", 1)), (P, SenderFreed("a")), (P, Expired("a")),
    (H, Prefilled("a", 1, (7,))), (H, SenderFreed("a")),
    (S, Prefilled("a", 1, (7,))), (S, Offered("a", 1)), (S, Expired("a")),
    (S, Finished("a", 1, ReleaseCause.FAILED)),
]


@pytest.mark.parametrize("state,event", ILLEGAL, ids=[f"{s.value}-{type(e).__name__}" for s, e in ILLEGAL])
def test_illegal_transitions_raise_and_change_nothing(state, event):
    life = life_in(state)
    with pytest.raises(IllegalTransitionError, match=f"'a' is {state.value}: {type(event).__name__}") as err:
        life.apply(event)
    assert err.value.state is state and err.value.event == event
    assert life.state_of("a") is state and life.num_released == 0


@pytest.mark.parametrize("event", [SenderFreed("x"), Expired("x"), Stopped("x")], ids=lambda e: type(e).__name__)
def test_events_the_table_owns_raise_for_an_unknown_request(event):
    with pytest.raises(IllegalTransitionError, match="not in the table"):
        CtxRequestLife(timeout_s=1.0).apply(event)


@pytest.mark.parametrize("state", [P, H, S])
def test_a_duplicate_id_is_refused_and_the_holder_is_untouched(state):
    life = life_in(state)
    before = life.get("a")
    with pytest.raises(DuplicateRequestError, match=f"already {state.value}") as err:
        life.apply(Admitted("a", 2))
    assert err.value.code == "duplicate_request_id" and err.value.request_id == "a"
    assert to_openai_error(err.value).status_code == 400
    assert life.get("a") is before and before.token == 1 and life.state_of("a") is state
    # the refused request's own end (token 2) is stale: it cannot release the holder
    for stale in (Finished("a", 2, ReleaseCause.REFUSED), Prefilled("a", 2, (9,)), Offered("a", 2)):
        assert life.apply(stale).before is None
    assert life.state_of("a") is state and life.num_released == 0


def test_an_id_is_free_again_once_released_and_only_the_new_admission_moves_it():
    life = life_in(S)
    assert life.apply(SenderFreed("a")).frees_held_cache
    life.apply(Admitted("a", 2))
    assert life.apply(Finished("a", 1, ReleaseCause.FAILED)).before is None  # the first one's
    assert life.apply(Prefilled("a", 2, (3,))).after is H
    assert life.get("a").first_gen_tokens == (3,)


def test_release_and_cancel_of_an_unknown_id_do_nothing():
    life = CtxRequestLife(timeout_s=1.0)
    for event in (ReleaseRequested("nobody", 1), CancelRequested("nobody")):
        moved = life.apply(event)
        assert (moved.before, moved.after, moved.frees_held_cache) == (None, None, False)


def test_a_late_release_of_a_reused_id_leaves_the_new_holder_alone():
    """The router releases admission 1 of "a" after "a" was freed and admitted again (2): the
    release names admission 1, so the new holder keeps its cache; its own release frees it."""
    life = life_in(H, token=1)
    assert life.apply(Expired("a")).frees_held_cache  # the first holder is gone
    life.apply(Admitted("a", 2))
    life.apply(Prefilled("a", 2, (9,)))
    late = life.apply(ReleaseRequested("a", 1))
    assert (late.before, late.after, late.frees_held_cache) == (None, None, False)
    assert life.state_of("a") is H and life.num_released == 1
    assert life.apply(ReleaseRequested("a", 2)).frees_held_cache


def test_cancelled_while_prefilling_is_released_at_its_prefill_without_freeing():
    life = life_in(P)
    life.apply(CancelRequested("a"))
    moved = life.apply(Prefilled("a", 1, (7,)))  # the engine's abort freed its cache
    assert (moved.before, moved.after, moved.cause, moved.frees_held_cache) == (P, R, ReleaseCause.CANCELLED, False)
    assert life.num_live == 0


def test_only_held_entries_past_their_deadline_are_due():
    clock = FakeClock()
    life = CtxRequestLife(timeout_s=5.0, clock=clock)
    life.apply(Admitted("held", 1))
    life.apply(Admitted("slow", 2))  # still prefilling: never due
    life.apply(Admitted("sent", 3))
    clock.advance_to(4.0)
    life.apply(Prefilled("held", 1, (1,)))  # its deadline starts now: t = 9
    life.apply(Prefilled("sent", 3, (1,)))
    life.apply(Offered("sent", 3))  # the sender's own deadline applies
    clock.advance_to(8.999)
    assert life.due() == []
    clock.advance_to(9.0)
    assert life.due() == ["held"]
    moved = life.apply(Expired("held"))
    assert moved.cause is ReleaseCause.EXPIRED and life.num_expired == life.num_released == 1
    assert life.due() == [] and life.state_of("slow") is P and life.state_of("sent") is S


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0"):
        CtxRequestLife(timeout_s=0)


def test_the_state_machine_imports_without_torch():
    code = ("import sys, helixserve.ctx_server.lifecycle;"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- CtxRequests: the table on a real engine's thread -----------------------------------------

PROMPT = list(range(30, 60))  # 30 tokens: 8 blocks of 4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CacheConfig(tokens_per_block=4, max_num_seqs=2))


async def _core_stats(engine: AsyncEngine):
    """The core's stats read on the engine thread (after every command queued before)."""
    return await engine.call(lambda core: core.stats())


async def _prefill(requests: CtxRequests, rid: str) -> tuple[int, list[int]]:
    token, outputs = requests.generate(rid, PROMPT, greedy(1))
    ids = [t async for out in outputs for t in out.token_ids]
    return token, ids


def test_duplicates_of_a_held_prefill_leave_its_cache_alone(llm):
    """A context_only duplicate (refused by the table) and a plain one (refused by the engine
    core) both get 400; the holder keeps its blocks and is then freed exactly once."""

    async def main():
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=1)
        engine.start()
        requests = CtxRequests(engine, timeout_s=5.0)
        async with requests.running():
            token, first = await _prefill(requests, "a")
            await requests.request(Prefilled("a", token, tuple(first)))
            held = await _core_stats(engine)
            assert held.num_held == 1 and held.num_used_blocks == 8
            with pytest.raises(DuplicateRequestError):
                await _prefill(requests, "a")
            with pytest.raises(RequestRejectedError, match="already in the scheduler"):
                async for _ in engine.generate("a", PROMPT[:5], greedy(3)):
                    pass
            await asyncio.sleep(0.2)  # an abort the refusals might have sent is applied by now
            assert ((await _core_stats(engine)).num_held, (await _core_stats(engine)).num_used_blocks) == (1, 8)
            assert requests.life.state_of("a") is H
            assert (await requests.request(ReleaseRequested("a", token + 1))).before is None  # not its admission
            assert (await requests.request(ReleaseRequested("a", token))).frees_held_cache
            assert (await requests.request(ReleaseRequested("a", token))).before is None
            assert requests.life.num_released == 1
            stats = await _core_stats(engine)
            assert stats.num_held == stats.num_used_blocks == 0
        await engine.shutdown()

    asyncio.run(main())


def test_sweeper_expires_only_prefilled_holds_and_exit_frees_the_rest(llm):
    async def main():
        clock = FakeClock()
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=1)
        engine.start()
        requests = CtxRequests(engine, timeout_s=5.0, clock=clock)
        async with requests.running(interval_s=0.05):
            token, first = await _prefill(requests, "a")
            clock.advance_to(4.0)
            await requests.request(Prefilled("a", token, tuple(first)))  # deadline t = 9
            slow, _ = requests.generate("slow", PROMPT, greedy(1))  # not started: never expires
            clock.advance_to(8.0)
            assert await requests.expire_due() == []
            clock.advance_to(9.0)
            for _ in range(100):  # the sweeper's turn (every 0.05 s)
                if requests.life.num_expired:
                    break
                await asyncio.sleep(0.05)
            assert requests.life.num_expired == 1 and requests.life.state_of("a") is None
            stats = await _core_stats(engine)
            assert stats.num_held == stats.num_used_blocks == 0
            token_b, first_b = await _prefill(requests, "b")
            assert await requests.prefilled("b", token_b, first_b, offer=lambda core: None) is S
        assert requests.num_live == 0 and requests.life.num_released == 2  # "b" stopped on exit
        stats = await _core_stats(engine)
        assert stats.num_held == stats.num_used_blocks == 0
        await engine.shutdown()

    asyncio.run(main())


def test_an_offer_that_fails_frees_the_hold(llm):
    async def main():
        engine = AsyncEngine(llm.engine, None, max_num_seqs=2, max_queue_len=1)
        engine.start()
        requests = CtxRequests(engine, timeout_s=5.0)
        async with requests.running():
            token, first = await _prefill(requests, "a")

            def refuse(core):
                raise RuntimeError("the sender is gone")
            with pytest.raises(RuntimeError, match="the sender is gone"):
                await requests.prefilled("a", token, first, offer=refuse)
            assert requests.num_live == 0 and (await _core_stats(engine)).num_used_blocks == 0
        await engine.shutdown()

    asyncio.run(main())
