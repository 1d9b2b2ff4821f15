"""Prefill-only steps under load wait a little for more prompts (``prefill_delay_factor``,
engine/prefill_delay.py): the window after a prefill-only step, the token budget that ends it,
no wait with anything decoding, and the engine thread batching prompts that arrive inside it."""

from __future__ import annotations

import asyncio

import pytest

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.async_engine import AsyncEngine
from helixserve.engine.llm import LLM
from helixserve.engine.prefill_delay import PrefillDelay
from helixserve.engine.request import SamplingParams

PROMPT = list(range(30, 50))  # 20 tokens


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_window_follows_a_prefill_only_step_and_a_full_budget_ends_it() -> None:
    clock = _Clock()
    delay = PrefillDelay(0.5, clock)
    assert delay.wait_s(10, 100) == 0.0  # no step yet
    delay.record(1.0, 1.2, is_prefill_only=True)  # window: 0.5 x 0.2 s after 1.2
    clock.now = 1.25
    assert delay.wait_s(10, 100) == pytest.approx(0.05)
    assert delay.wait_s(99, 100) == pytest.approx(0.05)  # budget - 1: still waits
    assert delay.wait_s(100, 100) == 0.0  # the waiting prompts fill the step
    clock.now = 1.3
    assert delay.wait_s(10, 100) == 0.0
    delay.record(1.3, 1.4, is_prefill_only=False)  # a step with decodes sets no window
    assert delay.wait_s(10, 100) == 0.0


def test_factor_zero_never_waits_and_a_negative_one_is_refused() -> None:
    delay = PrefillDelay(0.0, _Clock())
    delay.record(0.0, 1.0, is_prefill_only=True)
    assert delay.wait_s(1, 100) == 0.0
    with pytest.raises(ValueError, match="-0.5"):
        PrefillDelay(-0.5)


@pytest.fixture(scope="module")
def delayed(tiny_checkpoints):
    return LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CacheConfig(tokens_per_block=4, max_num_seqs=8),
               scheduler=SchedulerConfig(max_num_batched_tokens=64, prefill_delay_factor=4.0))


def test_the_core_waits_only_for_prefill_only_steps_below_the_budget(delayed) -> None:
    core = delayed.engine
    core.add_request("a", PROMPT, greedy(1))
    assert core.step_delay_s() == 0.0  # nothing ran yet
    while core.has_unfinished_requests():
        core.step()
    core.add_request("b", PROMPT, greedy(1))
    assert core.step_delay_s() > 0.0  # right after a's prefill-only step
    core.add_request("c", PROMPT, greedy(1))
    core.add_request("d", PROMPT[:24 - len(PROMPT) + 4], greedy(1))  # 20 + 20 + 4 < 64
    assert core.step_delay_s() > 0.0
    core.add_request("e", PROMPT, greedy(1))  # 64 tokens waiting: the budget is full
    assert core.step_delay_s() == 0.0
    while core.has_unfinished_requests():
        core.step()
    core.add_request("long", PROMPT, greedy(6))
    core.step()  # its prefill (prefill-only)
    core.add_request("f", PROMPT, greedy(1))
    assert core.scheduler.running and core.step_delay_s() == 0.0  # "long" decodes: no wait
    while core.has_unfinished_requests():
        core.step()
    assert core.stats().num_used_blocks == 0


def test_prompts_arriving_inside_the_window_share_one_step_with_unchanged_tokens(delayed) -> None:
    core = delayed.engine
    want = [delayed.generate([p], greedy(1))[0].token_ids for p in (PROMPT, PROMPT[::-1])]
    steps: list[int] = []
    launch = core.executor.launch

    def counting(out, *args, **kwargs):  # noqa: ANN001, ANN202
        steps.append(len(out.seqs))
        return launch(out, *args, **kwargs)

    async def main() -> list[list[int]]:
        engine = AsyncEngine(core, None, max_num_seqs=8, max_queue_len=8)
        engine.start()
        try:
            await _tokens(engine.generate("first", PROMPT, greedy(1)))  # opens the window
            b = asyncio.ensure_future(_tokens(engine.generate("b", PROMPT, greedy(1))))
            await asyncio.sleep(0.002)
            c = asyncio.ensure_future(_tokens(engine.generate("c", PROMPT[::-1], greedy(1))))
            return list(await asyncio.gather(b, c))
        finally:
            await engine.shutdown()

    core.executor.launch = counting
    try:
        got = asyncio.run(main())
    finally:
        core.executor.launch = launch
    assert got == want
    assert steps[-1] == 2, steps  # b waited for c: one step for both


async def _tokens(agen) -> list[int]:  # noqa: ANN001
    ids: list[int] = []
    async for out in agen:
        ids += out.token_ids
    return ids
