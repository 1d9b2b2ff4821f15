"""Cache-aware routing over a ctx WORLD: a router (``policy: cache_aware``) over 2 ctx workers with
prefix caching, a ctx world of tp 2 (``ctx``: rank 0 serves, rank 1 spawned) and a single-process
ctx worker (``ctx1``), decoding on one gen worker over UCX, beside the single-process baseline.

A prompt of several blocks, cached on one ctx worker by a request straight to it (so the router
learns it only from that worker's ``/v1/prefix_events``: the ctx world's one log of both ranks'
blocks), is routed there when repeated: that worker's cache answers its last full block, the
router's answer reports it as ``cached_tokens``, and the greedy text equals the single engine's
(disaggregated == aggregated, caching off). When a ctx world rank is killed the world restarts
in place under a new event log: the router drops what it knew of the world (its index mirrors
the new log, which lacks the prompt), the next repeat is a miss that answers the same text, the
one after it hits again, and nothing is held or allocated on any ctx or gen rank."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from helixserve.kvcache.prefix_index import append_block_keys
from tests.e2e.cache_aware import all_ctx_healthy, mirrors_the_workers, published, router_ctx, served_by
from tests.e2e.conftest import Deployment, http, metric, wait_until
from tests.e2e.ctx_world import TP, TPB, complete, ctx_world_options, http_status, seeded_prompt, wait_idle

WORLD, SINGLE = 0, 1  # indexes in dep.ctx_urls: the ctx world, the single-process ctx worker
NUM_TOKENS = 30  # 7 full blocks before the last token, prefilled in 2 chunks (step budget 16)
CACHED = (NUM_TOKENS - 1) // TPB * TPB  # a repeat resumes at its last full block
PROMPTS = {WORLD: seeded_prompt(301, NUM_TOKENS), SINGLE: seeded_prompt(302, NUM_TOKENS)}


@pytest.fixture(scope="module")
def dep_options() -> dict[str, Any]:
    # ctx[0] is the world; the extra ctx worker copies the default (single-process) entry
    return {**ctx_world_options(dp=1, cp=1), "extra_ctx": 1, "router": {"policy": "cache_aware"},
            "cache": {"prefix_caching": True, "state_checkpoint_blocks": 2}}


@pytest.fixture(scope="module")
def want(dep: Deployment) -> dict[int, str]:
    """Each prompt's greedy text from the single-process baseline, found in no cache there."""
    texts = {}
    for holder, prompt in PROMPTS.items():
        status, answer = complete(dep.baseline_url, prompt)
        assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer
        texts[holder] = answer["choices"][0]["text"]
    return texts


def _keys(prompt: list[int]) -> set[str]:
    """The block keys a hit on ``prompt`` can use, as the ctx workers publish them."""
    usable = (len(prompt) - 1) // TPB * TPB
    return {key.hex() for key in append_block_keys([], prompt[:usable], TPB, None)}


def _routed(dep: Deployment, prompt: list[int]) -> tuple[str, int, int]:
    """One greedy request through the router: its text, the ctx worker that prefilled it and the
    cached tokens its answer reports (the ctx worker's hit)."""
    (status, answer), worker, hit = served_by(dep, lambda: complete(dep.router_url, prompt))
    assert status == 200, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == hit, (answer["usage"], hit)
    return answer["choices"][0]["text"], worker, cached


def test_repeats_go_to_the_ctx_world_or_worker_caching_their_prefix(dep: Deployment, want: dict[int, str]) -> None:
    wait_until(lambda: all_ctx_healthy(dep), 120, "both ctx workers in the router's pool")
    for holder, prompt in PROMPTS.items():  # aggregated on the holder, straight to it: cached there
        status, answer = complete(dep.ctx_urls[holder], prompt)
        assert status == 200 and answer["choices"][0]["text"] == want[holder], (holder, answer)
    # the world's one log names both ranks' blocks of its prompt; the other worker's, none of them
    for holder, prompt in PROMPTS.items():
        assert _keys(prompt) <= set(published(dep.ctx_urls[holder])["blocks"])
        assert not _keys(prompt) & set(published(dep.ctx_urls[1 - holder])["blocks"])
    # as many blocks as each worker publishes, its prompt's included: learnt from its events
    wait_until(lambda: mirrors_the_workers(dep), 20, "the router's index to learn both workers' blocks",
               state=lambda: router_ctx(dep))
    world_url = dep.ctx_urls[WORLD]
    router_gauge = f'helixserve_router_worker_prefix_blocks{{role="ctx",url="{world_url}"}}'
    assert metric(dep.router_url, router_gauge) == len(published(world_url)["blocks"])
    before = dep.stats("ctx")
    held, pulled = before["kv_holds_released"], dep.stats("gen")["kv_transfers_completed"]
    for i in range(2):
        for holder, prompt in PROMPTS.items():
            assert _routed(dep, prompt) == (want[holder], holder, CACHED), (i, holder)
    wait_idle(dep)
    # every repeat went disaggregated: prefilled on its ctx worker, the KV pulled by the gen worker
    world = dep.stats("ctx")
    assert (world["kv_holds_released"] - held, world["kv_holds_lost"]) == (2, 0), world
    # the world's transfer counters: each hold once (both ranks sent a part of it)
    assert (world["kv_transfers_completed"] - before["kv_transfers_completed"],
            world["kv_transfer_failures"]) == (2, 0), world
    assert world["kv_transfer_bytes"] > before["kv_transfer_bytes"], world
    wait_until(lambda: metric(dep.router_url, f'helixserve_router_worker_kv_transfers_completed{{role="ctx",url="{world_url}"}}')
               == dep.stats("ctx")["kv_transfers_completed"], 20, "the router's gauge to read the world's transfers")
    assert dep.stats("gen")["kv_transfers_completed"] - pulled == 4
    wait_until(lambda: mirrors_the_workers(dep), 20, "the router's index to mirror the workers' blocks")


def test_a_restarted_ctx_worlds_blocks_are_dropped_and_the_repeat_misses(dep: Deployment,
                                                                          want: dict[int, str]) -> None:
    world_url, prompt = dep.ctx_urls[WORLD], PROMPTS[WORLD]
    wait_until(lambda: all_ctx_healthy(dep), 120, "both ctx workers in the router's pool")
    assert complete(world_url, prompt)[0] == 200  # cached on the world (a hit if it was already)
    before = published(world_url)
    assert _keys(prompt) <= set(before["blocks"])
    wait_until(lambda: mirrors_the_workers(dep), 20, "the router's index to learn the world's blocks",
               state=lambda: router_ctx(dep))
    known_before = router_ctx(dep)[WORLD]["prefix_blocks"]
    completed_before = dep.stats("ctx")["kv_transfers_completed"]
    health = http("GET", f"{world_url}/health")[1]["world"]
    (rank1,) = health["rank_pids"][1:]
    os.kill(rank1, signal.SIGKILL)
    wait_until(lambda: router_ctx(dep)[WORLD]["prefix_blocks"] == 0, 20,
               "the router to drop the failed world's blocks", state=lambda: router_ctx(dep))
    wait_until(lambda: http_status(f"{world_url}/health") == 200 and all_ctx_healthy(dep), 90,
               "the ctx world to restart and the router to see it", state=lambda: http("GET", f"{world_url}/health"))
    health_after = http("GET", f"{world_url}/health")[1]["world"]
    assert health_after["restarts"] == health["restarts"] + 1 and rank1 not in health_after["rank_pids"]
    assert len(health_after["rank_pids"]) == TP
    # a new log, of the restarted world's warm-up alone; the router knows that much and no more
    after = published(world_url)
    assert after["epoch"] != before["epoch"] and set(after["blocks"]) <= set(before["blocks"]) - _keys(prompt)
    wait_until(lambda: mirrors_the_workers(dep), 20, "the router's index to mirror the restarted world",
               state=lambda: router_ctx(dep))
    assert router_ctx(dep)[WORLD]["prefix_blocks"] <= known_before - CACHED // TPB
    text, worker, cached = _routed(dep, prompt)  # no worker holds it now: a miss, wherever
    assert (text, cached) == (want[WORLD], 0), (worker, cached)
    assert _routed(dep, prompt) == (want[WORLD], worker, CACHED)  # and then the prompt follows its worker
    wait_idle(dep)
    # the restarted world's counters add to the failed one's: they never decrease
    assert dep.stats("ctx")["kv_transfers_completed"] >= completed_before
