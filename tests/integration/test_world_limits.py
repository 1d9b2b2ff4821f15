"""The gen world (gloo) at its limits: chunked prefill of prompts around and far past the step's
token budget, up to the context length, mixed with decodes, equal to the single-process engine;
and step failures outside the forward (sampling on the CP leader; building a batch on one DP
group's rank), which end that step's requests with an error while the world goes on; a request
whose sampling cannot be set up fails alone, on the leader, before its group's step is sent.

A forward that raises stops the world instead (its collectives are left unmatched):
``test_helix_world.py::test_a_failing_rank_stops_the_world``.
"""

from __future__ import annotations

import pytest
import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.spmd.driver import drive_to_completion
from helixserve.engine.world_rank import WorldOptions, build_rank, serve_rank
from helixserve.launch.processes import run_local_world
from helixserve.parallel import Mapping, init_parallel

PRESET = "kimi-k3-tiny"
BUDGET = 32
MAX_MODEL_LEN = 160
CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=8, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
OPTIONS = WorldOptions(cache=CACHE, scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET), timeout_s=30)
LENGTHS = [BUDGET - 1, BUDGET, BUDGET + 1, 3 * BUDGET + 1, MAX_MODEL_LEN - 8]
FAULT = "injected fault"


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


PROMPTS = [_prompt(i, n) for i, n in enumerate(LENGTHS)]
FAULT_PROMPTS = [_prompt(10, 2 * BUDGET + 3), _prompt(11, 7)]
AFTER = _prompt(12, BUDGET + 1)


class _FaultySampler:
    """A rank's sampler whose next launch raises (a fault injected, nothing else)."""

    def __init__(self, sampler) -> None:  # noqa: ANN001
        self.sampler, self.is_armed = sampler, True

    def launch(self, *args):  # noqa: ANN002, ANN201
        if self.is_armed:
            self.is_armed = False
            raise RuntimeError(FAULT)
        return self.sampler.launch(*args)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.sampler, name)


def _result(results) -> list[tuple[list[int], str | None, str | None]]:  # noqa: ANN001
    return [(r.token_ids, r.finish_reason, r.error) for r in results]


def _limits_world(rank: int, world_size: int, init_method: str, model_dir: str) -> dict:
    groups = init_parallel(Mapping(world_size, rank, dp=1, cp=2), init_method, backend="gloo", timeout_s=30)
    try:
        part = build_rank(model_dir, groups, OPTIONS)
        if rank != 0:
            return {"steps": serve_rank(part)}
        driver = WorldDriver(part)
        try:
            out = {"alone": [_result(drive_to_completion(driver, [p], [greedy()]))[0] for p in PROMPTS],
                   "together": _result(drive_to_completion(driver, PROMPTS[::-1], [greedy()] * len(PROMPTS)))}
            try:
                driver.add_request("too-long", _prompt(9, MAX_MODEL_LEN), greedy())
            except ValueError as exc:
                out["too_long"] = str(exc)
            # sampling parameters no validator saw: the leader fails that request before the
            # step is sent, the group runs the step without it
            culprit = SamplingParams.model_construct(**{**greedy(12).model_dump(), "temperature": 1.0,
                                                        "seed": 2**70})
            out["culprit"] = _result(drive_to_completion(driver, [*FAULT_PROMPTS, AFTER],
                                                         [greedy(12), culprit, greedy(12)]))
            part.runner.sampler = _FaultySampler(part.runner.sampler)  # the CP leader's next sampling fails
            out["fault"] = _result(drive_to_completion(driver, FAULT_PROMPTS, [greedy(12), greedy(12)]))
            out["after"] = _result(drive_to_completion(driver, [AFTER], [greedy()]))
            out["stats"] = driver.stats()
            out["rank_stats"] = driver.rank_stats()
            return out
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


@pytest.fixture(scope="module")
def single(tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints[PRESET], cache=CACHE, scheduler=SchedulerConfig(max_num_batched_tokens=1024))


@pytest.fixture(scope="module")
def limits(tiny_checkpoints) -> list[dict]:
    return run_local_world(_limits_world, 2, str(tiny_checkpoints[PRESET]), timeout_s=300)


def test_world_chunked_prefill_equals_single_process(limits, single) -> None:
    front = limits[0]
    want = [r.token_ids for r in single.generate(PROMPTS, greedy())]
    assert [tokens for tokens, _, _ in front["alone"]] == want
    assert [tokens for tokens, _, _ in front["together"]] == want[::-1]  # chunks beside decodes
    assert {reason for _, reason, _ in front["alone"] + front["together"]} == {"length"}
    assert f"160 tokens; need 1 <= tokens < max_model_len ({MAX_MODEL_LEN})" in front["too_long"]


def test_world_sampling_failure_fails_the_step_and_the_world_goes_on(limits, single) -> None:
    front = limits[0]
    for tokens, reason, error in front["fault"]:  # both were in the step whose sampling failed
        assert tokens == [] and reason == "error"
        assert error == f"engine step failed on gen rank 0: RuntimeError: {FAULT}"
    assert front["after"] == [(single.generate([AFTER], greedy())[0].token_ids, "length", None)]
    assert front["stats"].num_used_blocks == front["stats"].num_used_slots == 0
    assert [(s.num_used_blocks, s.num_used_slots) for s in front["rank_stats"].values()] == [(0, 0), (0, 0)]


def test_world_request_whose_sampling_cannot_be_set_up_fails_alone(limits, single) -> None:
    front = limits[0]
    first, culprit, last = front["culprit"]
    want = [r.token_ids for r in single.generate([FAULT_PROMPTS[0], AFTER], greedy(12))]
    assert (first, last) == ((want[0], "length", None), (want[1], "length", None))
    assert culprit[:2] == ([], "error") and culprit[2].startswith(f"engine step failed on gen rank 0: seed {2**70} ")


def _dp_fault_world(rank: int, world_size: int, init_method: str, model_dir: str) -> dict:
    """dp 2 x cp 1: rank 1's first batch fails to build; rank 0's group runs its forward beside
    it (rank 1 joins the MoE all-to-alls with no rows)."""
    import helixserve.engine.runner as runner_module

    groups = init_parallel(Mapping(world_size, rank, dp=2, cp=1), init_method, backend="gloo", timeout_s=30)
    try:
        part = build_rank(model_dir, groups, OPTIONS)
        if rank == 1:
            build, calls = runner_module.build_forward_batch, [0]

            def faulty(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                calls[0] += 1
                if calls[0] == 1:
                    raise RuntimeError(FAULT)
                return build(*args, **kwargs)

            runner_module.build_forward_batch = faulty
            return {"steps": serve_rank(part)}
        driver = WorldDriver(part)
        try:
            both = drive_to_completion(driver, FAULT_PROMPTS, [greedy(12), greedy(12)])
            after = drive_to_completion(driver, [AFTER, AFTER], [greedy()] * 2)  # one on each group
            return {"both": _result(both), "after": _result(after), "stats": driver.stats(),
                    "rank_stats": driver.rank_stats()}
        finally:
            driver.shutdown()
    finally:
        groups.destroy()


def test_a_batch_failing_on_one_dp_group_fails_only_its_request(tiny_checkpoints, single) -> None:
    results = run_local_world(_dp_fault_world, 2, str(tiny_checkpoints[PRESET]), timeout_s=300)
    front = results[0]
    want = [r.token_ids for r in single.generate(FAULT_PROMPTS, greedy(12))]
    # requests go to the least-loaded group: the long one to group 0, the short one to group 1
    assert front["both"][0] == (want[0], "length", None)
    assert front["both"][1] == ([], "error", f"engine step failed on gen rank 1: RuntimeError: {FAULT}")
    after = single.generate([AFTER], greedy())[0].token_ids
    assert front["after"] == [(after, "length", None)] * 2  # both groups serve again
    assert front["stats"].num_used_blocks == front["stats"].num_used_slots == 0
    assert [(s.num_used_blocks, s.num_used_slots) for s in front["rank_stats"].values()] == [(0, 0), (0, 0)]
