"""A ctx world of tp 2 serving a gen world of dp 1 x cp 4 over real UCX: each gen rank pulls its
blocks from one ctx rank and its KDA heads from another (the fan-in of 2 ctx ranks over 4 gen
ranks). Through the router the greedy tokens equal the single-process worker's for prompts
around block boundaries, two at once on its one DP group, and afterwards nothing is
held or allocated on any of the 2 ctx or 4 gen ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import Deployment, http
from tests.e2e.ctx_world import (TP, TPB, complete_at_once, ctx_world_options, greedy_text, rank_used,
                                 seeded_prompt, wait_idle)

CP = 4
# one token, a block, a block + 1, two blocks + 1, past the step budget (16), several chunks
LENGTHS = (1, TPB, TPB + 1, 2 * TPB + 1, 17, 23)


@pytest.fixture(scope="module")
def dep_options() -> dict[str, Any]:
    return ctx_world_options(dp=1, cp=CP)


def test_the_worlds_are_ctx_tp_2_and_gen_cp_4(dep: Deployment) -> None:
    ctx, gen = (http("GET", f"{url}/health")[1]["world"] for url in (dep.ctx_url, dep.gen_url))
    assert (ctx["cp"], len(ctx["rank_pids"]), gen["dp"], gen["cp"], len(gen["rank_pids"])) == (TP, TP, 1, CP, CP)
    # two gauges (blocks, slots) per rank: the idle checks below read every rank
    assert (len(rank_used(dep.ctx_url)), len(rank_used(dep.gen_url))) == (2 * TP, 2 * CP)


def test_routed_tokens_equal_the_single_process_workers_and_every_rank_frees(dep: Deployment) -> None:
    for i in range(0, len(LENGTHS), 2):
        prompts = [seeded_prompt(90 + n, n) for n in LENGTHS[i:i + 2]]
        got = complete_at_once(dep.router_url, prompts)
        want = [greedy_text(dep.baseline_url, p) for p in prompts]
        assert [status for status, _ in got] == [200, 200], got
        assert [answer["choices"][0]["text"] for _, answer in got] == want, (LENGTHS[i:i + 2], got)
    wait_idle(dep)
    gen, ctx = dep.stats("gen"), dep.stats("ctx")
    # every prompt prefilled on the ctx world, its KV pulled by the 4 gen ranks (no recompute)
    assert (gen["kv_transfers_completed"], gen["kv_transfer_failures"]) == (len(LENGTHS), 0), gen
    assert (ctx["kv_holds_released"], ctx["kv_holds_lost"]) == (len(LENGTHS), 0), ctx
    # the world's transfer counters count each hold once, and every rank's bytes
    assert (ctx["kv_transfers_completed"], ctx["kv_transfer_failures"]) == (len(LENGTHS), 0), ctx
    assert ctx["kv_transfer_bytes"] > 0 and ctx["kv_transfer_seconds"] > 0, ctx
