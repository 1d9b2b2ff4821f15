"""Prefix caching in a dp 2 x cp 2 gen world serving aggregated requests (gloo, CPU).

Each CP group's leader keeps the group's prefix cache: every CP rank matches and publishes the
MLA blocks it holds (block ``b`` on rank ``b % cp``), and the group's KDA state checkpoints are
taken by every rank into the same checkpoint slot, each of its own head slice. Pages hold 4
tokens and a checkpoint is taken every 2 blocks, so shared prefixes of 0, 3, 4, 5, 8 and 23
tokens, and the same prompt twice, cross pages, checkpoints and CP ranks.

Requests go in pairs, one round at a time: the world puts a pair's first request on CP group 0
and its second on group 1 (least loaded, both idle), so each group sees one sequence of
requests. Against that:

- greedy tokens equal a single-process engine's with caching off;
- each request's cached tokens equal a single-process engine's with caching on, fed the same
  sequence its group saw (the group's hit is the single engine's hit), and both groups hit;
- every rank's blocks and slots are free at the end (cached blocks are evictable, not held).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helixserve.config import CacheConfig
from helixserve.engine.llm import LLM
from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.world_rank import WorldOptions, build_rank, serve_rank
from helixserve.kvcache.prefix_snapshot import PrefixCacheSnapshot
from helixserve.launch.processes import run_local_world
from helixserve.parallel import Mapping, init_parallel

PRESET = "kimi-k3-tiny"
BLOCK = 4


def _cache(caching: bool) -> CacheConfig:
    return CacheConfig(tokens_per_block=BLOCK, memory_budget_mib=8, max_num_seqs=4, prefix_caching=caching,
                       state_checkpoint_blocks=2, state_checkpoint_slots=16)


PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A, B = _ids(1, 29), _ids(2, 23)
ROUNDS = [  # (group 0's request, group 1's request); comments: the prefix shared with A or B
    (A, B),
    (A[:3] + _ids(3, 5), B[:4] + _ids(4, 6)),  # one block - 1, one block
    (A[:5] + _ids(5, 4), B[:8] + _ids(6, 3)),  # one block + 1, two blocks (a checkpoint)
    (A[:23] + _ids(7, 2), B),  # five blocks + 3, the same prompt again
    (_ids(8, 10), A),  # nothing shared; group 1 never held A
]


def _world(rank: int, world_size: int, init_method: str, model_dir: str) -> dict | int:
    options = WorldOptions(cache=_cache(True), timeout_s=60)
    groups = init_parallel(Mapping(world_size, rank, dp=2, cp=2), init_method, backend="gloo",
                           timeout_s=options.timeout_s)
    try:
        part = build_rank(model_dir, groups, options)
        if rank != 0:
            return serve_rank(part)
        driver = WorldDriver(part)
        try:
            got = {}
            for r, pair in enumerate(ROUNDS):
                for g, prompt in enumerate(pair):
                    driver.add_request(f"r{r}g{g}", prompt, PARAMS)
                while driver.has_unfinished_requests():
                    for update in driver.step():
                        tokens, _ = got.setdefault(update.request_id, ([], None))
                        assert update.status is not RequestStatus.FINISHED_ERROR, update.error
                        tokens.append(update.token_id)
                        if update.is_finished:
                            got[update.request_id] = (tokens, update.num_cached_tokens)
        finally:
            driver.shutdown()
        return {"got": got, "rank_stats": driver.rank_stats(), "prefix": driver.prefix_stats}
    finally:
        groups.destroy()


@pytest.fixture(scope="module")
def world(tiny_checkpoints):
    model_dir = str(tiny_checkpoints[PRESET])
    return model_dir, run_local_world(_world, 4, model_dir, timeout_s=300)[0]


def test_a_caching_world_decodes_as_a_single_engine_without_caching(world):
    model_dir, front = world
    plain = LLM(model_dir, cache=_cache(False))
    for r, pair in enumerate(ROUNDS):
        for g, prompt in enumerate(pair):
            want = plain.generate([prompt], PARAMS)[0].token_ids
            assert front["got"][f"r{r}g{g}"][0] == want, f"round {r} group {g}"


def test_each_group_hits_what_a_single_caching_engine_hits(world):
    model_dir, front = world
    hits = {0: [], 1: []}
    for g in (0, 1):
        single = LLM(model_dir, cache=_cache(True))
        for r, pair in enumerate(ROUNDS):
            single.generate([pair[g]], PARAMS)
            want = single.engine.cache_manager.prefix_stats.num_hit_tokens - sum(hits[g])
            hits[g].append(want)
            assert front["got"][f"r{r}g{g}"][1] == want, f"round {r} group {g}"
    # checkpoints sit every 8 tokens and at a prompt's last full block: A[:23] resumes at 16,
    # B[:8] + 3 at 8 and B again at 20; shorter shares find a block but no checkpoint after it
    assert hits[0] == [0, 0, 0, 16, 0] and hits[1] == [0, 0, 8, 20, 0]


def test_the_world_reports_its_groups_prefix_caches_summed(world):
    """What the gen world's ``/metrics`` shows: every CP group's lookups, hits, cached blocks
    (each rank's own) and checkpoints, summed; two single caching engines fed one group's
    prompts each hold the same."""
    model_dir, front = world
    singles = [LLM(model_dir, cache=_cache(True)) for _ in range(2)]
    for pair in ROUNDS:
        for single, prompt in zip(singles, pair, strict=True):
            single.generate([prompt], PARAMS)
    want = PrefixCacheSnapshot.total(s.engine.cache_manager.snapshot() for s in singles)
    got = front["prefix"]
    assert got.hit_tokens == 44 and got.queried_tokens == sum(len(p) for pair in ROUNDS for p in pair)
    assert replace(got, checkpoints_total=0) == replace(want, checkpoints_total=0)
    assert got.cached_blocks > 0 and got.checkpoints_used > 0 and got.checkpoints_total >= got.checkpoints_used


def test_every_rank_frees_its_blocks_and_slots(world):
    _, front = world
    assert sorted(front["rank_stats"]) == [(d, c) for d in range(2) for c in range(2)]
    for stats in front["rank_stats"].values():
        assert stats.num_used_blocks == 0 and stats.num_used_slots == 0 and stats.num_blocks > 0
