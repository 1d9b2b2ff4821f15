"""Cache-aware routing: a router (``policy: cache_aware``) over 2 ctx workers caching prefixes and
a gen worker (one process). Chat requests sharing a long system prompt, repeated, go to the ctx
worker holding that prefix (the router tokenizes them with the chat template, as the ctx does)
and hit its cache; a second prefix goes to the other worker; the router's index mirrors each
worker's cached blocks, and when a ctx worker restarts its blocks are dropped and repeat traffic
re-learns."""

from __future__ import annotations

import pytest

from tests.e2e.cache_aware import all_ctx_healthy, mirrors_the_workers, router_ctx, served_by
from tests.e2e.conftest import MODEL, wait_until

BLOCK = 4  # the deployment's tokens_per_block
SYSTEMS = {
    "a": "You answer questions about the weather in one short sentence, politely, in English. " * 2,
    "b": "Tu reponds aux questions de cuisine en une phrase courte, poliment, en francais. " * 2,
}


@pytest.fixture(scope="module")
def dep_options() -> dict:
    # the routing is the ctx side's: a gen worker of one process decodes
    return {"extra_ctx": 1, "cache": {"prefix_caching": True, "state_checkpoint_blocks": 2},
            "router": {"policy": "cache_aware"}, "gen": {"cp": 1}}


def _ask(dep, prefix: str, question: str) -> tuple[int, float]:
    """Send one chat request; (index of the ctx worker that prefilled it, its cached tokens)."""
    r, worker, cached = served_by(dep, lambda: dep.client().chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0.0,
        messages=[{"role": "system", "content": SYSTEMS[prefix]}, {"role": "user", "content": question}]))
    assert r.choices[0].finish_reason is not None
    return worker, cached


def test_repeats_go_to_the_worker_holding_their_prefix(dep):
    wait_until(lambda: all_ctx_healthy(dep), 120, "both ctx workers in the router's pool")
    first_a, _ = _ask(dep, "a", "Is it sunny?")
    first_b, _ = _ask(dep, "b", "Comment cuire des pates ?")
    assert first_a != first_b  # equal load: fresh prefixes take turns
    shared = len(SYSTEMS["a"]) // BLOCK * BLOCK // 2  # far below the system prompt's tokens
    for i in range(3):
        worker, cached = _ask(dep, "a", f"And tomorrow, day {i}?")
        assert worker == first_a and cached >= shared, (i, worker, cached)
        worker, cached = _ask(dep, "b", f"Et le riz, {i} ?")
        assert worker == first_b and cached >= shared, (i, worker, cached)
    wait_until(lambda: mirrors_the_workers(dep), 20, "the router's index to mirror the workers' blocks")


def test_a_restarted_ctx_workers_blocks_are_dropped_and_relearnt(dep):
    wait_until(lambda: all_ctx_healthy(dep), 120, "both ctx workers in the router's pool")
    holder, _ = _ask(dep, "a", "Will it rain?")
    role = "ctx" if holder == 0 else f"ctx{holder}"
    blocks_before = router_ctx(dep)[holder]["prefix_blocks"]
    dep.kill(role)
    wait_until(lambda: router_ctx(dep)[holder]["prefix_blocks"] == 0, 20, "the router to drop its blocks")
    dep.start(role)
    wait_until(lambda: all_ctx_healthy(dep), 120, "the restarted ctx worker back in the pool")
    # the new worker's blocks (its warm-up's) only: what the router knew of the old one is gone
    wait_until(lambda: mirrors_the_workers(dep), 20, "the router's index to mirror the restarted worker")
    assert router_ctx(dep)[holder]["prefix_blocks"] < blocks_before
    again, cached = _ask(dep, "a", "Will it snow?")
    assert again != holder or cached == 0  # the restarted worker had nothing cached
    for i in range(2):
        worker, cached = _ask(dep, "a", f"Any wind, {i}?")
        assert worker == again and cached > 0, (i, worker, again, cached)
