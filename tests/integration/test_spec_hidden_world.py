"""A hidden-state drafter (``speculative.method: hidden``) in the helix gen world (gloo, CPU): each
CP group's leader runs the drafter on full rows (its own pages, every block of a sequence), fed the
target's layer outputs that the one forward keeps on every rank and all-gathers over the CP group
(the drafter reads layers 1, 3, 5 of K3-tiny: all after the first MoE layer, token-sliced). Pages
hold 4 tokens, so prompts, drafts and verify rows cross them. Two greedy prompts get plain
decoding's outputs as drafts (whole runs accepted), the others the drafter's own (rejected). In a
dp 2 x cp 2 world (two cp 2 groups):

- greedy requests give plain decoding's tokens;
- the drafter's own drafts, step by step, the tokens (a seeded sampled request's included) and the
  draft counts (both CP groups' summed) equal the single-process hidden engine's: the leader reads
  the same hidden states as a single process does;
- every rank's blocks and slots are free at the end, no request holds drafter pages or rows;
- with the drafter's heads over each CP group (``draft_tensor_parallel_size: 2``, a parameter of
  the same world) all of the above holds too; each follower holds its heads' share, the group's
  full-row pages and a feature row a slot, reads bitwise the leader's hidden states every forward
  and drafts the leader's tokens every step;
- in a cp 2 world whose cache cannot hold its batch, preempted requests recompute and still give
  plain decoding's tokens.

``helixserve generate --dp 1 --cp 2 --speculative hidden --draft-model DIR --json`` prints what
plain decoding prints.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch

from helixserve.cli import main
from helixserve.config import CacheConfig, SpeculativeConfig
from helixserve.engine.core import EngineCore
from helixserve.engine.hidden_runner import HiddenDraftRunner
from helixserve.engine.llm import LLM
from helixserve.engine.spmd.driver import WorldDriver, drive_to_completion
from helixserve.engine.world_rank import WorldOptions, build_rank, serve_rank
from helixserve.launch.processes import run_local_world
from helixserve.models.dummy import tokenizer_of
from helixserve.models.hidden_drafter import read_hidden_drafter_config
from helixserve.models.presets import make_checkpoint
from helixserve.parallel import Mapping, init_parallel
from helixserve.testing.drafts import record_drafts
from tests.integration.test_spec_draft_world import CACHE, K, LONG_PROMPTS, PARAMS, PRESET, PROMPTS, greedy
from tests.integration.test_spec_draft_world import _preempting_world as preempting_world

SCRIPTED = (0, 2)  # prompts whose drafts are plain decoding's outputs
TIGHT = CacheConfig(tokens_per_block=4, memory_budget_mib=0.24, max_num_seqs=4)  # 32 blocks a rank, drafter's counted


def _trace(drafter: HiddenDraftRunner) -> dict[str, list]:
    """Test-only tap on a rank's drafter: each run's drafts, and a digest of the target's hidden
    states each forward hands it (their bytes: equal digests, identical features)."""
    trace: dict[str, list] = {"drafts": [], "features": []}
    run, record = drafter._run, drafter.record

    def traced_run(work: Any) -> list[torch.Tensor]:
        drafts = run(work)
        trace["drafts"].append(torch.cat(drafts).tolist() if drafts else [])
        return drafts

    def traced_record(out: Any, batch: Any) -> None:
        trace["features"].append(hashlib.sha1(batch.hidden_capture.features().numpy().tobytes()).hexdigest())
        record(out, batch)

    drafter._run, drafter.record = traced_run, traced_record  # type: ignore[method-assign]
    return trace


def _hidden_world(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int,
                  options: WorldOptions, script: dict) -> dict | int:
    groups = init_parallel(Mapping(world_size, rank, dp=dp, cp=cp), init_method, backend="gloo",
                           timeout_s=options.timeout_s)
    try:
        part = build_rank(model_dir, groups, options)
        if not isinstance(part, EngineCore):
            draft = part.draft
            if draft is None:
                return serve_rank(part)
            assert isinstance(draft, HiddenDraftRunner)
            trace = _trace(draft)
            serve_rank(part)
            pool = draft.caches.mla_kv
            return {"follower_draft_pages": pool[next(iter(pool))].shape[0], "feature_rows": draft.slot_features.shape,
                    "heads": draft.model.model.layers[0].self_attn.num_heads, "dp_rank": groups.mapping.dp_rank,
                    "trace": trace}
        assert isinstance(part.draft_runner, HiddenDraftRunner) and part.runner.capture_layers == (1, 3, 5)
        proposals = record_drafts(part, script)
        trace = _trace(part.draft_runner)
        if rank != 0:  # another group's leader
            serve_rank(part)
            return {"proposals": proposals, "traces": {groups.mapping.dp_rank: trace}}
        driver = WorldDriver(part)
        try:
            results = drive_to_completion(driver, PROMPTS, PARAMS, tokenizer_of(model_dir))
            stats = driver.rank_stats()
        finally:
            driver.shutdown()
        pool = part.draft_runner.caches.mla_kv
        return {"tokens": [r.token_ids for r in results], "errors": [r.error for r in results], "traces": {0: trace},
                "spec": driver.spec_stats, "proposals": proposals, "rank_stats": stats,
                "held": part.cache_manager.num_requests, "rows_left": len(part.draft_runner._seqs),
                "feature_rows": part.draft_runner.slot_features.shape,
                "draft_pages": pool[next(iter(pool))].shape[0],
                "pages": part.caches.mla_kv[next(iter(part.caches.mla_kv))].shape[0]}
    finally:
        groups.destroy()


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, tmp_path_factory):
    """Plain decoding's tokens, and the single-process hidden engine's tokens, counts and drafts."""
    model_dir = str(tiny_checkpoints[PRESET])
    drafter = make_checkpoint("kimi-k3-tiny-hidden", tmp_path_factory.mktemp("hidden") / "drafter", seed=3)
    spec = SpeculativeConfig(method="hidden", draft_model=drafter, num_draft_tokens=K)
    plain = [r.token_ids for r in LLM(model_dir, cache=CACHE).generate(PROMPTS, PARAMS)]
    script = {tuple(PROMPTS[i]): plain[i] for i in SCRIPTED}
    llm = LLM(model_dir, cache=CACHE, speculative=spec)
    proposals = record_drafts(llm.engine, script)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, PARAMS)]
    return {"model_dir": model_dir, "spec_config": spec, "plain": plain, "script": script, "spec": tokens,
            "spec_stats": llm.engine.spec_stats, "proposals": proposals}


# dp 2 x cp 2 only: its groups are cp 2 worlds, and the CLI test and the preemption test run dp 1 x cp 2;
# the drafter on each group's leader (draft_tensor_parallel_size 1), or its heads over the group (2)
@pytest.fixture(scope="module", params=[(2, 2, 1), (2, 2, 2)], ids=["dp2xcp2", "dp2xcp2-heads-tp"])
def world(request, reference):
    dp, cp, tp = request.param
    spec = reference["spec_config"].model_copy(update={"draft_tensor_parallel_size": tp})
    options = WorldOptions(cache=CACHE, timeout_s=60, speculative=spec)
    results = run_local_world(_hidden_world, dp * cp, reference["model_dir"], dp, cp, options, reference["script"],
                              timeout_s=300)
    proposals, traces = {}, {}
    for result in results:
        if isinstance(result, dict) and "proposals" in result:
            proposals.update(result["proposals"])
            traces.update(result["traces"])
    followers = [r | {"leader_trace": traces[r["dp_rank"]]} for r in results
                 if isinstance(r, dict) and "follower_draft_pages" in r]
    return dp, results[0], proposals, tp, followers


def test_greedy_hidden_speculation_in_a_world_equals_plain_decoding(world, reference):
    front = world[1]
    assert front["errors"] == [None] * len(PROMPTS)
    for i in (0, 1, 2):
        assert front["tokens"][i] == reference["plain"][i], f"request {i}"


def test_a_world_drafts_accepts_and_samples_as_the_single_process_hidden_engine(world, reference):
    _, front, proposals, _, _ = world
    assert proposals == reference["proposals"]  # the drafter's own drafts, step by step
    assert len(proposals) > 10
    assert front["tokens"] == reference["spec"]
    want = reference["spec_stats"]
    assert front["spec"] == want
    assert 0 < want.num_accepted_tokens < want.num_draft_tokens  # accepted runs and rejections
    assert want.accepted_per_position[K - 1] > 0


def test_every_rank_frees_its_blocks_and_the_drafter_runs_on_full_rows(world, reference):
    dp, front, _, tp, followers = world
    assert sorted(front["rank_stats"]) == [(d, c) for d in range(dp) for c in range(2)]
    for stats in front["rank_stats"].values():
        assert stats.num_used_blocks == 0 and stats.num_used_slots == 0 and stats.num_blocks > 0
    assert front["held"] == 0 and front["rows_left"] == 0
    assert front["draft_pages"] == 2 * front["pages"]  # a page for every block of the CP group
    if tp == 1:  # the leader alone holds the drafter
        assert followers == []
        return
    heads = read_hidden_drafter_config(reference["spec_config"].draft_model)[0].num_attention_heads
    assert len(followers) == dp * (2 - 1) and heads % tp == 0
    for follower in followers:  # its heads' share, the group's full-row pages and a feature row a slot
        assert follower["heads"] == heads // tp
        assert follower["follower_draft_pages"] == front["draft_pages"]
        assert follower["feature_rows"] == front["feature_rows"]


def test_under_heads_tp_every_rank_reads_the_same_hidden_states_and_drafts_the_same(world):
    """The target's captured hidden states are bitwise the same on every rank of a CP group (the
    gathered sliced layers), so every rank drafts the same tokens without a broadcast."""
    _, _, _, tp, followers = world
    if tp == 1:
        assert followers == []  # nothing to compare: the leader alone drafts
        return
    for follower in followers:
        trace, leader = follower["trace"], follower["leader_trace"]
        assert trace["features"] == leader["features"] and trace["drafts"] == leader["drafts"]
    assert sum(len(f["trace"]["features"]) for f in followers) > 10  # every forward of both groups
    assert sum(len(d) for f in followers for d in f["trace"]["drafts"]) > 10


def test_cli_world_json_with_and_without_a_hidden_drafter(tiny_checkpoints, tmp_path, capsys) -> None:
    model = str(tiny_checkpoints["kimi-linear-tiny"])
    drafter = make_checkpoint("kimi-linear-tiny-hidden", tmp_path / "drafter", seed=3)
    base = ["generate", "--model", model, "--prompt-ids", ",".join(map(str, [9, 8, 7, 6] * 6)),
            "--max-tokens", "12", "--ignore-eos", "--json"]
    outputs = []
    for extra in ([], ["--dp", "1", "--cp", "2", "--speculative", "hidden", "--draft-model", str(drafter),
                       "--num-draft-tokens", "3"]):
        assert main(base + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[1] == outputs[0] and len(outputs[0]["token_ids"]) == 12


def test_a_preempted_request_recomputes_its_drafter_rows_with_its_target_cache(reference):
    """A cp 2 world whose cache cannot hold its batch preempts and recomputes requests (the
    drafter's pages go and come back with the target's, its rows start over) and still gives plain
    decoding's tokens."""
    plain = LLM(reference["model_dir"], cache=CACHE).generate(LONG_PROMPTS, greedy(24))
    options = WorldOptions(cache=TIGHT, timeout_s=60, speculative=reference["spec_config"])
    front = run_local_world(preempting_world, 2, reference["model_dir"], options, timeout_s=300)[0]
    assert front["preempted"] and front["drafts"] > 0
    assert front["tokens"] == [r.token_ids for r in plain]
    for stats in front["rank_stats"].values():
        assert stats.num_used_blocks == 0 and stats.num_used_slots == 0
