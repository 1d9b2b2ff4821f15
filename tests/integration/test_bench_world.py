"""The benches' world rows: ``bench/_common.run_decode`` (the decode timing every engine row shares)
over the single-process engine and a gen world of one, and the ``--quick`` runs of
``bench/engine.py`` and ``bench/kernels.py`` writing their "world" rows (structure and token
equality only: speed figures stay in bench/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.world_rank import WorldOptions
from helixserve.serving.local_world import start_local_world

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from _common import run_decode  # noqa: E402

CACHE = CacheConfig(memory_budget_mib=64, max_num_seqs=8)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=512)
N = 6


def _prompts(batch: int, seed: int) -> list[list[int]]:
    return torch.randint(0, 256, (batch, 9), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints["kimi-k3-tiny"], dtype="float32", cache=CACHE, scheduler=SCHEDULER)


def test_run_decode_stops_when_its_requests_finish_though_the_engine_has_more(llm):
    """A request of someone else's keeps the engine busy: run_decode returns once its own
    finished, after a bounded drain of 4 steps, with one prefill step and N - 1 decode steps."""
    prompts = _prompts(3, seed=1)
    expected = [r.token_ids for r in llm.generate(prompts, _greedy(N))]
    engine = llm.engine
    other = engine.add_request("other", _prompts(1, seed=2)[0], _greedy(4 * N))
    run = run_decode(engine, ["a", "b", "c"], prompts, _greedy(N))
    assert run.tokens == expected
    assert run.num_prefill_steps == 1 and len(run.stamps) == N and run.decode_tokens == 3 * (N - 1)
    assert run.step_tokens == [3] * N  # the other request's tokens are not counted
    assert run.decode_seconds == run.stamps[-1] - run.stamps[0] > 0
    assert len(run.drain_seconds) == 4 and len(other.output_token_ids) == N + 4
    engine.abort("other")
    assert not engine.has_unfinished_requests()


def test_run_decode_of_a_world_of_one_equals_the_single_engine(llm, tiny_checkpoints):
    prompts = _prompts(4, seed=3)
    single = run_decode(llm.engine, [f"s{i}" for i in range(4)], prompts, _greedy(N))
    world = start_local_world(tiny_checkpoints["kimi-k3-tiny"], dp=1, cp=1,
                              options=WorldOptions(cache=CACHE, scheduler=SCHEDULER, dtype="float32"))
    try:
        ran = run_decode(world.driver, [f"w{i}" for i in range(4)], prompts, _greedy(N))
    finally:
        world.close()
    assert ran.tokens == single.tokens and all(len(t) == N for t in ran.tokens)
    assert ran.num_prefill_steps == 1 and ran.decode_tokens == 4 * (N - 1)


def test_an_overlapped_world_of_one_frees_the_last_requests_cache_without_new_work(tiny_checkpoints):
    """With overlapped decoding the step behind a request's last token is still in flight when
    the token comes back; the world must count it as work and read it back (freeing the cache),
    not sit idle holding the blocks until its next heartbeat (the GPU warm-up found that)."""
    world = start_local_world(tiny_checkpoints["kimi-k3-tiny"], dp=1, cp=1, heartbeat_s=600.0, options=WorldOptions(
        cache=CACHE, scheduler=SchedulerConfig(max_num_batched_tokens=512, overlap_decode=True), dtype="float32"))
    try:
        driver = world.driver
        driver.add_request("o1", _prompts(1, seed=4)[0], _greedy(N))
        tokens, steps = [], 0
        while driver.has_unfinished_requests() and steps < 4 * N:
            tokens += [u.token_id for u in driver.step() if u.request_id == "o1"]
            steps += 1
        assert len(tokens) == N
        assert not driver.has_unfinished_requests()
        assert driver.stats().num_used_blocks == 0 and driver.stats().num_used_slots == 0
    finally:
        world.close()


class _NeverSamples:
    """Injects a stalled engine: it takes requests but no step samples a token."""

    def __init__(self) -> None:
        self.steps = 0

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        pass

    def step(self) -> list:
        self.steps += 1
        return []

    def has_unfinished_requests(self) -> bool:
        return True


def test_run_decode_gives_up_on_an_engine_that_never_samples():
    engine = _NeverSamples()
    with pytest.raises(RuntimeError, match="8 steps sampled no token"):
        run_decode(engine, ["x"], [[1, 2]], _greedy(2), max_idle_steps=8)
    assert engine.steps == 9


def _run_bench(script: str, out: Path, *flags: str) -> dict:
    """``script --quick`` on one torch thread per process (its world ranks have one already):
    beside them on a small machine, torch's default of a thread per core oversubscribes the cores
    and its spinning threads slow every process many times over (rows' structure and token
    equality are checked here, not speed)."""
    subprocess.run([sys.executable, str(BENCH / script), "--quick", "--out", str(out), *flags],
                   check=True, timeout=600, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def test_engine_bench_quick_has_world_rows(tmp_path):
    data = _run_bench("engine.py", tmp_path / "engine.json", "--models", "kimi-k3-tiny",
                      "--world-models", "kimi-k3-tiny", "--only", "engine")
    metrics = [r["metric"] for r in data["results"]]
    assert metrics == ["prefill bs1×512", "decode bs1", "world decode bs1", "decode bs8", "world decode bs8"]
    new = data["settings"]["new_tokens"]
    for row, batch in zip((r for r in data["results"] if "world" in r["metric"]), (1, 8), strict=True):
        assert row["ratio"] == pytest.approx(row["world_tok_s"] / row["single_tok_s"])
        assert row["tokens_match"] == f"{batch * new}/{batch * new}"  # greedy world == single
        assert len(row["world_seconds"]) == len(row["single_seconds"]) == data["settings"]["reps"]
    assert data["settings"]["target_world_ratio"] == 0.95


def test_engine_bench_quick_has_ctx_world_rows(tmp_path):
    """A ctx world of one and both tp 2 layouts, each beside the single engine: the batch's greedy
    first tokens equal, every repetition recorded, the figures the fastest repetitions'."""
    data = _run_bench("engine.py", tmp_path / "engine.json", "--models", "kimi-k3-tiny", "--only", "ctx-world",
                      "--ctx-world-models", "kimi-k3-tiny", "--ctx-world-reps", "2")  # (--quick: 3)
    rows = data["results"]
    assert [(r["layout"], r["dp"], r["cp"]) for r in rows] == [
        ("world of one", 1, 1), ("tp 2 helix (dp 1 x cp 2)", 1, 2), ("tp 2 attention DP (dp 2 x cp 1)", 2, 1)]
    for row in rows:
        tokens = row["batch"] * row["prompt_len"]
        assert row["first_tokens_equal"] == f"{row['batch']}/{row['batch']}"
        assert len(row["seconds"]) == len(row["single_seconds"]) == data["settings"]["ctx_world_reps"]
        assert row["tok_s"] == pytest.approx(tokens / min(row["seconds"]))
        assert row["ratio"] == pytest.approx(row["tok_s"] / row["single_tok_s"])
    assert data["settings"]["target_ctx_world_ratio"] == 0.95


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path (on a GPU: kimi-k3-mid, minutes)")
def test_kernels_bench_quick_has_world_engine_rows_on_cpu(tmp_path):
    data = _run_bench("kernels.py", tmp_path / "kernels.json", "--only", "engine")
    world = [r for r in data["rows"] if "world" in r["case"]]
    assert [r["case"] for r in world] == ["kimi-k3-tiny world decode bs1", "kimi-k3-tiny world decode bs4",
                                          "kimi-k3-tiny ctx world of one prefill 2×128"]
    for row in world:
        assert row["ratio_value"] == pytest.approx(row["ours"] / row["baseline"])
    assert world[2]["note"] == "first tokens equal 2/2"  # the world of one prefills as the single engine
    for row in world[:2]:
        assert row["world_outside"] is None and row["single_outside"] is None  # no CUDA graphs on CPU
