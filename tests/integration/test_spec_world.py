"""Speculative decoding in the helix gen world (gloo, CPU): each CP group's leader drafts and
verifies, every rank runs the verify rows on its shard (its KDA heads, its MLA blocks b % cp) and
rolls back the rows the leader rejected.

Random weights make prompt lookup useless, so each leader's drafter is scripted from plain
decoding's outputs (:class:`~helixserve.testing.drafts.ScriptedDrafter`): fully accepted runs,
and rejections at chosen draft positions. Pages hold 4 tokens, so prompts, verify rows and
rejected runs cross them (a rejected run's blocks go back on whichever rank owns them). In a
dp 2 x cp 2 world and a cp 2 world:

- greedy requests give plain decoding's tokens, finish reasons and text, a stop string cutting
  inside an accepted run included;
- a seeded sampled request gives the single-process speculative engine's tokens (same drafts);
- the world's draft counts (both CP groups' summed) equal the single-process engine's;
- a request aborted right after a rejection (its group's rollback then goes alone, before the
  next message) leaves the world serving the next request as plain decoding does;
- every rank's blocks and slots are free at the end.

``helixserve generate --dp 1 --cp 2 --speculative ngram --json`` prints what plain decoding
prints.
"""

from __future__ import annotations

import json

import pytest
import torch

from helixserve.config import CacheConfig, SpeculativeConfig
from helixserve.engine.core import EngineCore
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.spmd.driver import WorldDriver, drive_to_completion
from helixserve.engine.world_rank import WorldOptions, build_rank, serve_rank
from helixserve.launch.processes import run_local_world
from helixserve.models.dummy import tokenizer_of
from helixserve.parallel import Mapping, init_parallel
from helixserve.testing.drafts import ScriptedDrafter

PRESET = "kimi-k3-tiny"
K = 4  # drafts per step: a full run is 5 tokens, more than a page
CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=4, max_num_seqs=6)
NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=K)
OPTIONS = WorldOptions(cache=CACHE, timeout_s=60, speculative=NGRAM)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


PROMPTS = [list(range(20, 57)), _prompt(1, 11), _prompt(2, 9), _prompt(3, 13), _prompt(4, 6)]
WRONG = {1: {2}, 2: {0}, 3: {1}}  # prompt index -> draft positions the script gets wrong (else none)
SAMPLED = SamplingParams(max_tokens=19, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
STOPPED = 4  # its stop string is plain decoding's token inside the second accepted run


def _stop_string(tokenizer, outputs: list[int]) -> str:
    """A token's text that first appears at an output index inside a full run of ``K + 1``
    (outputs 1..5, 6..10, ...; not a run's first or last token)."""
    for i in range(K + 3, 3 * (K + 1)):
        text = tokenizer.decode([outputs[i]])
        if i % (K + 1) not in (0, 1) and text.strip() and text not in tokenizer.decode(outputs[:i]):
            return text
    raise AssertionError(f"no token of {outputs} makes a stop string inside an accepted run")


def _spec_world(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int,
                params: list[SamplingParams], script: dict) -> dict | int:
    groups = init_parallel(Mapping(world_size, rank, dp=dp, cp=cp), init_method, backend="gloo",
                           timeout_s=OPTIONS.timeout_s)
    try:
        part = build_rank(model_dir, groups, OPTIONS)
        if isinstance(part, EngineCore):  # every CP group's leader drafts from the script
            part.scheduler.drafter = ScriptedDrafter(K, script, {tuple(PROMPTS[i]): w for i, w in WRONG.items()})
        if rank != 0:
            return serve_rank(part)
        driver = WorldDriver(part)
        try:
            results = drive_to_completion(driver, PROMPTS, params, tokenizer_of(model_dir))
            spec = driver.spec_stats
            after_abort = _abort_after_a_rejection(driver, params)
        finally:
            driver.shutdown()
        return {"results": [(r.token_ids, r.finish_reason, r.text, r.error) for r in results], "spec": spec,
                "own_spec": part.spec_stats, "rank_stats": driver.rank_stats(), "after_abort": after_abort}
    finally:
        groups.destroy()


def _abort_after_a_rejection(driver: WorldDriver, params: list[SamplingParams]) -> list[int]:
    """A request whose every draft is rejected (PROMPTS[2]) aborted after a verify step: its
    group runs no launch next, so the leader's rollback goes alone before the heartbeat. Then
    PROMPTS[1] again; its tokens."""
    driver.add_request("aborted", PROMPTS[2], params[2])
    num_tokens = 0
    while num_tokens < 3:  # the prefill's token, then two verify steps that rejected their drafts
        num_tokens += sum(u.request_id == "aborted" for u in driver.step())
    assert driver.abort("aborted")
    driver.step()
    return drive_to_completion(driver, [PROMPTS[1]], [params[1]], request_ids=["after"])[0].token_ids


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """Plain decoding's results, the stop string, the script, and the single-process speculative
    engine's results and counts with that script."""
    model_dir = str(tiny_checkpoints[PRESET])
    plain = LLM(model_dir, cache=CACHE)
    params = [greedy(29), greedy(23), greedy(17), SAMPLED, greedy(30)]
    stop = _stop_string(plain.tokenizer, plain.generate([PROMPTS[STOPPED]], params[STOPPED])[0].token_ids)
    params[STOPPED] = greedy(30, stop=(stop,))
    want = plain.generate(PROMPTS, params)
    script = {tuple(p): r.token_ids for p, r in zip(PROMPTS, want)}
    script[tuple(PROMPTS[STOPPED])] = plain.generate([PROMPTS[STOPPED]], greedy(30))[0].token_ids
    spec = LLM(model_dir, cache=CACHE, speculative=NGRAM)
    spec.engine.scheduler.drafter = ScriptedDrafter(K, script, {tuple(PROMPTS[i]): w for i, w in WRONG.items()})
    return {"model_dir": model_dir, "params": params, "script": script, "plain": want,
            "spec": spec.generate(PROMPTS, params), "spec_stats": spec.engine.spec_stats}


@pytest.fixture(scope="module", params=[(2, 2), (1, 2)], ids=["dp2xcp2", "cp2"])
def world(request, reference):
    dp, cp = request.param
    results = run_local_world(_spec_world, dp * cp, reference["model_dir"], dp, cp, reference["params"],
                              reference["script"], timeout_s=300)
    return dp, results[0]


def test_greedy_speculation_in_a_world_equals_plain_decoding(world, reference):
    _, front = world
    for i, (got, want) in enumerate(zip(front["results"], reference["plain"])):
        if i == 3:
            continue  # sampled: see the next test
        assert got == (want.token_ids, want.finish_reason, want.text, None), f"request {i}"
    stopped = front["results"][STOPPED]
    assert stopped[1] == "stop" and len(stopped[0]) < 30
    assert (len(stopped[0]) - 1) % (K + 1) not in (0, 1)  # the stop cut inside an accepted run


def test_a_world_accepts_and_samples_as_the_single_process_engine(world, reference):
    """The same drafts verified in every CP group give the single-process speculative engine's
    tokens (the seeded sampled request's too) and its draft counts, summed over the groups."""
    dp, front = world
    assert [r[0] for r in front["results"]] == [r.token_ids for r in reference["spec"]]
    want = reference["spec_stats"]
    assert front["spec"] == want
    assert 0 < want.num_accepted_tokens < want.num_draft_tokens  # accepted runs and rejections
    assert want.accepted_per_position[K - 1] > 0 and want.accepted_per_position[0] < want.num_drafts
    if dp > 1:  # both CP groups speculated: rank 0's own group counts only part of it
        assert 0 < front["own_spec"].num_drafts < want.num_drafts


def test_a_rollback_sent_alone_keeps_the_world_right(world, reference):
    """A request aborted right after a rejection: the rollback goes to the group's other ranks
    on its own, and the world serves the next request as plain decoding does."""
    _, front = world
    assert front["after_abort"] == reference["plain"][1].token_ids


def test_every_rank_frees_its_blocks_and_slots(world):
    dp, front = world
    assert sorted(front["rank_stats"]) == [(d, c) for d in range(dp) for c in range(2)]
    for stats in front["rank_stats"].values():
        assert stats.num_used_blocks == 0 and stats.num_used_slots == 0 and stats.num_blocks > 0


def test_cli_world_json_with_and_without_speculation(tiny_checkpoints, capsys) -> None:
    from helixserve.cli import main

    model = str(tiny_checkpoints["kimi-linear-tiny"])
    base = ["generate", "--model", model, "--prompt-ids", ",".join(map(str, [9, 8, 7, 6] * 6)),
            "--max-tokens", "12", "--ignore-eos", "--json"]
    outputs = []
    for extra in ([], ["--dp", "1", "--cp", "2", "--speculative", "ngram", "--num-draft-tokens", "5"]):
        assert main(base + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1] == outputs[0] and len(outputs[0]["token_ids"]) == 12
