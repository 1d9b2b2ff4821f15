"""A step is at most six helixserve calls deep: from the engine loop to the model forward.

One real step of the tiny model on the CPU, with ``KimiForCausalLM.forward`` wrapped to capture
``inspect.stack()``; the helixserve frames strictly between the loop function and the forward
are counted:

- served gen world of one: the loop is ``EngineThread._run`` (the ``AsyncEngine``'s thread) over
  the gen server's ``WorldCore`` around rank 0's ``WorldDriver`` (a real gloo world of one);
- served single process (a ctx or aggregated worker): the loop is ``EngineThread._run`` over the
  same driver, a world of one;
- offline: the loop is ``drive_to_completion``, under ``LLM.generate``.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import helixserve
from helixserve.config import CacheConfig, GenServerConfig
from helixserve.engine.async_engine import AsyncEngine
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.world_rank import WorldOptions, start_rank0
from helixserve.serving.world_supervisor import ServedWorld, WorldSupervisor
from helixserve.serving.world_core import WorldCore
from helixserve.parallel import Mapping
from helixserve.parallel.ports import free_port

MAX_FRAMES = 6
CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=4, max_num_seqs=2)
PROMPT = [5, 9, 2, 7, 1]
PACKAGE = str(Path(helixserve.__file__).parent)


def _capture_stacks(model) -> list[list[inspect.FrameInfo]]:  # noqa: ANN001 (a KimiForCausalLM)
    stacks: list[list[inspect.FrameInfo]] = []
    forward = model.forward

    def capturing_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        stacks.append(inspect.stack()[1:])  # without this wrapper
        return forward(*args, **kwargs)

    model.forward = capturing_forward
    return stacks


def _frames_between(stack: list[inspect.FrameInfo], loop: str) -> list[str]:
    """The helixserve functions strictly between the innermost ``loop`` frame and the forward."""
    names = [(f.function, f.filename) for f in stack]  # innermost first
    depth = next(i for i, (function, _) in enumerate(names) if function == loop)
    return [function for function, filename in names[:depth] if filename.startswith(PACKAGE)]


def _assert_within_bound(stacks: list[list[inspect.FrameInfo]], loop: str, outermost: list[str]) -> None:
    """Both steps (prefill, decode) reach the forward within the bound, through ``outermost``
    (the calls next to the loop, innermost first)."""
    assert len(stacks) == 2
    for stack in stacks:
        frames = _frames_between(stack, loop)
        assert frames[-len(outermost):] == outermost, frames
        assert len(frames) <= MAX_FRAMES, frames


async def _serve_one(core) -> list[int]:  # noqa: ANN001 (an EngineCoreLike)
    """One request through the served engine loop (an AsyncEngine over ``core``): its tokens."""
    engine = AsyncEngine(core, None, max_num_seqs=CACHE.max_num_seqs, max_queue_len=1)
    engine.start()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    tokens = [t async for out in engine.generate("r", PROMPT, params) for t in out.token_ids]
    await engine.shutdown()
    return tokens


def test_a_served_gen_world_step_reaches_the_forward_within_six_frames(tiny_checkpoints) -> None:
    options = WorldOptions(cache=CACHE, dtype="float32", backend="gloo", timeout_s=30)
    driver = start_rank0(tiny_checkpoints["kimi-k3-tiny"], Mapping(1, 0, dp=1, cp=1),
                         f"tcp://127.0.0.1:{free_port()}", options)
    world = ServedWorld(driver, None, WorldSupervisor(GenServerConfig(cp=1), None, "gen"))
    stacks = _capture_stacks(driver.core.runner.model)
    try:
        assert len(asyncio.run(_serve_one(WorldCore(world)))) == 2
    finally:
        driver.shutdown()
        driver.groups.destroy()
    _assert_within_bound(stacks, "_run", ["step", "_step"])  # WorldCore.step, EngineThread._step


def test_a_served_single_process_step_reaches_the_forward_within_six_frames(tiny_checkpoints) -> None:
    llm = LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CACHE)
    stacks = _capture_stacks(llm.engine.runner.model)

    assert len(asyncio.run(_serve_one(llm.driver))) == 2
    _assert_within_bound(stacks, "_run", ["step", "_step"])  # WorldDriver.step, EngineThread._step


def test_an_offline_step_reaches_the_forward_within_six_frames(tiny_checkpoints) -> None:
    llm = LLM(tiny_checkpoints["kimi-k3-tiny"], cache=CACHE)
    stacks = _capture_stacks(llm.engine.runner.model)
    [result] = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(result.token_ids) == 2
    _assert_within_bound(stacks, "drive_to_completion", ["step"])  # WorldDriver.step
