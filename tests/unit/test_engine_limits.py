"""Single-process engine at its limits: prompts around and far past the step's token budget
(chunked prefill), up to the context length, mixed with running decodes; and a failed step, which
ends its requests with an error, frees their caches and leaves the engine usable.

The reference is the same model with a budget no prompt here exceeds (every prompt in one chunk).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.async_engine import AsyncEngine
from helixserve.engine.llm import LLM, GenerationError
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.errors import StepFailedError

BUDGET = 32  # scheduler.max_num_batched_tokens
TOKENS_PER_BLOCK = 4
MAX_MODEL_LEN = 160
MAX_TOKENS = 6
CACHE = CacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                    memory_budget_mib=8)
# budget - 1, budget, budget + 1, several chunks (the last of one token), up to max_model_len
LENGTHS = [BUDGET - 1, BUDGET, BUDGET + 1, 2 * BUDGET + 3, 3 * BUDGET + 1, MAX_MODEL_LEN - MAX_TOKENS]


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def assert_nothing_held(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert (stats.num_used_blocks, stats.num_used_slots, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)


@pytest.fixture(scope="module", params=["kimi-k3-tiny", "kimi-linear-tiny"])
def model_dir(request, tiny_checkpoints):
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="module")
def whole(model_dir) -> LLM:
    """Every prompt in one step."""
    return LLM(model_dir, cache=CACHE, scheduler=SchedulerConfig(max_num_batched_tokens=4 * MAX_MODEL_LEN))


def chunked(model_dir, budget: int = BUDGET, overlap: bool = False) -> LLM:
    return LLM(model_dir, cache=CACHE,
               scheduler=SchedulerConfig(max_num_batched_tokens=budget, overlap_decode=overlap))


# budget 32: every chunk ends on a block boundary; 30: chunks end inside blocks
@pytest.mark.parametrize("budget", [BUDGET, BUDGET - 2])
def test_prompts_around_and_past_the_budget_equal_one_chunk(model_dir, whole, budget):
    llm = chunked(model_dir, budget)
    for i, n in enumerate(LENGTHS):
        prompt = _prompt(i, n)
        got = llm.generate([prompt], greedy())[0]
        assert got.token_ids == whole.generate([prompt], greedy())[0].token_ids, f"{n} prompt tokens"
        assert got.finish_reason == "length" and len(got.token_ids) == MAX_TOKENS
        assert_nothing_held(llm)


def test_prompts_up_to_the_context_length(model_dir, whole):
    llm = chunked(model_dir)
    prompt = _prompt(7, MAX_MODEL_LEN - 1)  # room for one token only
    got = llm.generate([prompt], greedy())[0]
    assert got.token_ids == whole.generate([prompt], greedy())[0].token_ids
    assert len(got.token_ids) == 1 and got.finish_reason == "length"
    with pytest.raises(ValueError, match=f"has {MAX_MODEL_LEN} tokens.*max_model_len \\({MAX_MODEL_LEN}\\)"):
        llm.generate([_prompt(8, MAX_MODEL_LEN)], greedy())
    assert_nothing_held(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_long_prefills_mixed_with_running_decodes(model_dir, whole, overlap):
    """Short requests decode while long prompts arrive and are prefilled chunk by chunk beside them
    (the decodes take part of each step's budget, so the chunks end inside blocks); every request
    gets the tokens it gets alone."""
    llm = chunked(model_dir, overlap=overlap)
    engine = llm.engine
    short = [engine.add_request(f"s{i}", _prompt(20 + i, 5 + i), greedy(24)) for i in range(2)]
    engine.step()
    engine.step()
    long_prompts = [_prompt(30, 3 * BUDGET + 1), _prompt(31, BUDGET + 1)]
    long = [engine.add_request(f"l{i}", p, greedy(8)) for i, p in enumerate(long_prompts)]
    saw_mixed = 0
    while engine.has_unfinished_requests():
        chunking = any(r.num_computed_tokens < r.num_prompt_tokens for r in long)
        decoding = any(r.status is RequestStatus.RUNNING and r.num_output_tokens for r in short)
        saw_mixed += chunking and decoding
        engine.step()
    assert saw_mixed >= 3
    for r, prompt in zip(short + long, [_prompt(20, 5), _prompt(21, 6), *long_prompts]):
        alone = whole.generate([prompt], r.sampling_params)[0]
        assert r.output_token_ids == alone.token_ids, r.request_id
    assert_nothing_held(llm)


class _FaultOnCall(torch.nn.Module):
    """The runner's model, raising on its ``fail_on``-th call (a fault injected, nothing else)."""

    def __init__(self, model: torch.nn.Module, fail_on: int) -> None:
        super().__init__()
        self.model, self.fail_on, self.calls = model, fail_on, 0

    def forward(self, batch, caches):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected fault")
        return self.model(batch, caches)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(model_dir, whole, overlap):
    """The model raises in the second chunk of a long prompt's prefill: that request (and the
    decode running beside it) end with an error naming the fault; a request waiting outside the
    step still completes; nothing stays allocated; the same engine then serves new requests."""
    llm = chunked(model_dir, overlap=overlap)
    engine = llm.engine
    engine.scheduler.max_num_seqs = 2  # the third request waits outside the failing step
    real = engine.runner.model
    engine.runner.model = _FaultOnCall(real, fail_on=3)
    decoding = engine.add_request("decoding", _prompt(40, 5), greedy(20))
    engine.step()  # decoding's prefill (call 1)
    victim = engine.add_request("victim", _prompt(41, 2 * BUDGET + 3), greedy())
    waiting = engine.add_request("waiting", _prompt(42, 9), greedy())
    engine.step()  # decoding's decode + victim's first chunk (call 2)
    updates = engine.step()  # call 3 raises
    failed = {u.request_id: u for u in updates}
    assert set(failed) == {"decoding", "victim"}
    for u in failed.values():
        assert u.status is RequestStatus.FINISHED_ERROR and u.token_id == -1
        assert u.error == "engine step failed: RuntimeError: injected fault"
    assert victim.finish_reason == decoding.finish_reason == "error"
    assert engine.num_step_errors == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert waiting.output_token_ids == whole.generate([_prompt(42, 9)], greedy())[0].token_ids
    assert_nothing_held(llm)
    prompt = _prompt(43, BUDGET + 1)
    assert llm.generate([prompt], greedy())[0].token_ids == whole.generate([prompt], greedy())[0].token_ids


def test_generate_raises_a_generation_error_and_stays_usable(model_dir, whole):
    llm = chunked(model_dir)
    llm.engine.runner.model = _FaultOnCall(llm.engine.runner.model, fail_on=2)
    prompt = _prompt(50, 2 * BUDGET)
    with pytest.raises(GenerationError, match="1 of 1 requests failed .*injected fault") as info:
        llm.generate([prompt], greedy())
    (result,) = info.value.results
    assert result.finish_reason == "error" and "RuntimeError: injected fault" in result.error
    assert_nothing_held(llm)
    assert llm.generate([prompt], greedy())[0].token_ids == whole.generate([prompt], greedy())[0].token_ids


def test_async_engine_fails_only_the_failed_steps_requests(model_dir, whole):
    """Behind the server's ``AsyncEngine``: the request in the failed step gets a 500 naming the
    fault; one waiting outside that step (one running slot) is served, then a new one."""
    llm = chunked(model_dir)
    llm.engine.scheduler.max_num_seqs = 1
    llm.engine.runner.model = _FaultOnCall(llm.engine.runner.model, fail_on=2)  # victim's 2nd chunk
    victim_prompt, waiting_prompt = _prompt(60, 2 * BUDGET + 3), _prompt(61, BUDGET + 1)

    async def tokens(front: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
        return [t async for out in front.generate(request_id, prompt, greedy()) for t in out.token_ids]

    async def main() -> tuple[list[int], list[int]]:
        front = AsyncEngine(llm.engine, None, max_num_seqs=1, max_queue_len=2)
        front.start()
        victim = asyncio.ensure_future(tokens(front, "victim", victim_prompt))
        waiting = asyncio.ensure_future(tokens(front, "waiting", waiting_prompt))
        with pytest.raises(StepFailedError, match="engine step failed: RuntimeError: injected fault") as info:
            await victim
        assert info.value.code == "engine_error" and front.num_step_errors == 1
        got = await waiting, await tokens(front, "after", victim_prompt)
        await front.shutdown()
        return got

    waited, after = asyncio.run(main())
    assert waited == whole.generate([waiting_prompt], greedy())[0].token_ids
    assert after == whole.generate([victim_prompt], greedy())[0].token_ids
    assert_nothing_held(llm)
