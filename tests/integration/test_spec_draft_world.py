"""A draft model (``speculative.method: draft``) in the helix gen world (gloo, CPU), its heads
tensor-parallel over each CP group (``draft_tensor_parallel_size: 2``): every rank of a group runs
the draft model's forwards on full rows (its own pages, every block of a sequence) with its half
of the heads, the leader verifies, the group's ranks run the verify rows on their shards. (The CLI
test runs the default too, the draft model on the leader alone.) A draft near the target (perturbed
weights) accepts runs of every length and rejects at every position; pages hold 4 tokens, so
prompts, drafts and verify rows cross them. In a dp 2 x cp 2 world (two cp 2 groups):

- greedy requests give plain decoding's tokens;
- the tokens and the draft counts (both CP groups' summed) equal the single-process draft
  engine's, a seeded sampled request's tokens included (the heads-TP drafts could differ from the
  single process's by the fp32 rounding of the all-reduce; on this tiny fp32 model they do not);
- a request aborted in the middle of its decoding leaves the world serving the next one as
  plain decoding does (its slot and pages, the draft's with them, are reused);
- every rank's blocks and slots are free at the end, and no request holds draft pages; every rank
  holds the draft's full-row latent pages and half its KDA heads;
- in a cp 2 world (heads TP) whose cache cannot hold its batch, requests are preempted and
  recomputed (the draft's pages and slot go and come back with the target's) and still give plain
  decoding's tokens.

A heads-TP draft model's forward (both presets, cp 2) gives identical logits on every rank, equal
to the single-process model's to fp32 rounding.

``helixserve generate --dp 1 --cp 2 --speculative draft --draft-model DIR --json`` prints what plain
decoding prints, the draft on the leader alone and with ``--draft-tensor-parallel-size 2``.
"""

from __future__ import annotations

import json

import pytest
import torch

from helixserve.cli import main
from helixserve.config import CacheConfig, SpeculativeConfig
from helixserve.engine.core import EngineCore
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.engine.spmd.driver import WorldDriver, drive_to_completion
from helixserve.engine.spmd.follower import Follower
from helixserve.engine.world_rank import WorldOptions, build_rank, serve_rank
from helixserve.launch.processes import run_local_world
from helixserve.cache_layout import cache_spec_for
from helixserve.engine.runner import build_forward_batch
from helixserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.config import KimiModelConfig
from helixserve.models.helix_load import load_helix_model
from helixserve.models.loading import load_model
from helixserve.models.dummy import tokenizer_of
from helixserve.parallel import Mapping, init_parallel
from helixserve.testing.drafts import perturbed_checkpoint

PRESET = "kimi-k3-tiny"
K = 3
CACHE = CacheConfig(tokens_per_block=4, memory_budget_mib=4, max_num_seqs=6)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=7, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


PROMPTS = [list(range(20, 57)), _prompt(1, 11), _prompt(2, 9), _prompt(3, 13)]
PARAMS = [greedy(17), greedy(14), greedy(11), SAMPLED]


def _draft_world(rank: int, world_size: int, init_method: str, model_dir: str, dp: int, cp: int,
                 options: WorldOptions) -> dict | int:
    groups = init_parallel(Mapping(world_size, rank, dp=dp, cp=cp), init_method, backend="gloo",
                           timeout_s=options.timeout_s)
    try:
        part = build_rank(model_dir, groups, options)
        if rank != 0:
            draft = part.draft if isinstance(part, Follower) else part.draft_runner
            assert draft is not None
            return {"steps": serve_rank(part), "draft_pools": _pool_shapes(draft.caches)}
        assert isinstance(part, EngineCore) and part.draft_runner is not None
        driver = WorldDriver(part)
        try:
            results = drive_to_completion(driver, PROMPTS, PARAMS, tokenizer_of(model_dir))
            spec = driver.spec_stats
            after_abort = _abort_midway(driver)
            stats = driver.rank_stats()
        finally:
            driver.shutdown()
        return {"tokens": [r.token_ids for r in results], "errors": [r.error for r in results], "spec": spec,
                "after_abort": after_abort, "rank_stats": stats, "held": part.cache_manager.num_requests,
                "draft_pools": _pool_shapes(part.draft_runner.caches), "pools": _pool_shapes(part.caches)}
    finally:
        groups.destroy()


def _pool_shapes(caches) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A rank's MLA pages and KDA state slots (the shape of its first layer's pool of each)."""
    return tuple(next(iter(caches.mla_kv.values())).shape), tuple(next(iter(caches.kda_state.values())).shape)


def _abort_midway(driver: WorldDriver) -> list[int]:
    """PROMPTS[0] aborted after a few decoding steps, then PROMPTS[1] again; its tokens."""
    driver.add_request("aborted", PROMPTS[0], greedy(17))
    num_tokens = 0
    while num_tokens < 4:
        num_tokens += sum(u.request_id == "aborted" for u in driver.step())
    assert driver.abort("aborted")
    driver.step()
    return drive_to_completion(driver, [PROMPTS[1]], [PARAMS[1]], request_ids=["after"])[0].token_ids


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, tmp_path_factory):
    """Plain decoding's tokens, and the single-process draft engine's tokens and counts."""
    model_dir = str(tiny_checkpoints[PRESET])
    near = perturbed_checkpoint(model_dir, tmp_path_factory.mktemp("draft") / "near", scale=0.01, seed=1)
    spec = SpeculativeConfig(method="draft", draft_model=near, num_draft_tokens=K)
    plain = LLM(model_dir, cache=CACHE).generate(PROMPTS, PARAMS)
    llm = LLM(model_dir, cache=CACHE, speculative=spec)
    heads_tp = SpeculativeConfig(method="draft", draft_model=near, num_draft_tokens=K, draft_tensor_parallel_size=2)
    return {"model_dir": model_dir, "spec_config": spec, "heads_tp": heads_tp, "plain": [r.token_ids for r in plain],
            "spec": [r.token_ids for r in llm.generate(PROMPTS, PARAMS)], "spec_stats": llm.engine.spec_stats}


# dp 2 x cp 2 only: its groups are cp 2 worlds, and the CLI test and the preemption test run dp 1 x cp 2
@pytest.fixture(scope="module", params=[(2, 2)], ids=["dp2xcp2"])
def world(request, reference):
    dp, cp = request.param
    options = WorldOptions(cache=CACHE, timeout_s=60, speculative=reference["heads_tp"])
    results = run_local_world(_draft_world, dp * cp, reference["model_dir"], dp, cp, options, timeout_s=300)
    return dp, {**results[0], "other_draft_pools": [r["draft_pools"] for r in results[1:]]}


def test_greedy_draft_speculation_in_a_world_equals_plain_decoding(world, reference):
    _, front = world
    assert front["errors"] == [None] * len(PROMPTS)
    for i in (0, 1, 2):
        assert front["tokens"][i] == reference["plain"][i], f"request {i}"


def test_a_world_drafts_accepts_and_samples_as_the_single_process_draft_engine(world, reference):
    _, front = world
    assert front["tokens"] == reference["spec"]
    want = reference["spec_stats"]
    assert front["spec"] == want
    assert 0 < want.num_accepted_tokens < want.num_draft_tokens  # accepted runs and rejections
    assert want.accepted_per_position[K - 1] > 0 and want.accepted_per_position[0] < want.num_drafts


def test_an_abort_midway_keeps_the_world_right(world, reference):
    _, front = world
    assert front["after_abort"] == reference["plain"][1]


def test_every_rank_frees_its_blocks_and_holds_full_draft_rows_and_half_its_heads(world, reference):
    dp, front = world
    assert sorted(front["rank_stats"]) == [(d, c) for d in range(dp) for c in range(2)]
    for stats in front["rank_stats"].values():
        assert stats.num_used_blocks == 0 and stats.num_used_slots == 0 and stats.num_blocks > 0
    assert front["held"] == 0  # the draft's pages are named by the target's blocks: none held
    (pages, *latent), (slots, heads, *state) = front["pools"]  # the target's: H/2 KDA heads too
    draft_cfg = KimiModelConfig.from_pretrained(reference["spec_config"].draft_model)  # the target's layers
    assert heads == draft_cfg.kda_num_heads // 2
    for draft_pools in [front["draft_pools"], *front["other_draft_pools"]]:
        # a page for every block of the CP group (the latent is head-independent), half the KDA heads
        assert draft_pools == ((2 * pages, *latent), (slots, draft_cfg.kda_num_heads // 2, *state))


def _heads_tp_logits(rank: int, world_size: int, init_method: str, model_dirs: list[str],
                     backend: str = "gloo") -> list:
    """Per checkpoint: this rank's heads-TP logits and the single-process model's, on its device."""
    mapping = Mapping(world_size, rank, dp=1, cp=world_size)
    groups = init_parallel(mapping, init_method, backend=backend, local_rank=rank, timeout_s=60)
    try:
        device = groups.device
        return [[_two_steps(model, device).cpu().numpy() for model in (
                    load_helix_model(d, mapping.for_draft_heads_tp(), device=device).bind(groups),
                    load_model(d, device=device))] for d in model_dirs]
    finally:
        groups.destroy()


def _two_steps(model, device: torch.device) -> torch.Tensor:
    """The logits of a 13-token prompt crossing pages, then of one decoded token after it."""
    spec = cache_spec_for(model.cfg, torch.float32, 4, model.cfg.kda_num_heads // model.mapping.cp)
    caches = allocate_model_caches(spec, 8, 2, device)
    steps = [ScheduledSeq("a", _prompt(5, 13), 0, [3, 0, 6, 1], 1, True, True),
             ScheduledSeq("a", [7], 13, [3, 0, 6, 1], 1, False, True)]
    with torch.inference_mode():
        return torch.cat([model(build_forward_batch(SchedulerOutput(seqs=[s]), device), caches) for s in steps])


def _check_heads_tp_logits(ranks: list, tol: float) -> None:
    for (rank0, want), (rank1, _) in zip(*ranks):
        assert torch.equal(torch.from_numpy(rank0), torch.from_numpy(rank1))
        torch.testing.assert_close(torch.from_numpy(rank0), torch.from_numpy(want), rtol=tol, atol=tol)


def test_a_heads_tp_draft_model_computes_the_single_process_logits_on_every_rank(tiny_checkpoints):
    """Every layer kind of both presets (MLA with and without q-LoRA and output gate, KDA, MoE,
    attention residuals) with its heads split over a cp 2 group: the ranks' logits are identical,
    and equal the single-process model's to fp32 rounding."""
    dirs = [str(tiny_checkpoints[p]) for p in (PRESET, "kimi-linear-tiny")]
    _check_heads_tp_logits(run_local_world(_heads_tp_logits, 2, dirs, timeout_s=120), 1e-4)


@pytest.mark.gpu
def test_a_heads_tp_draft_model_over_nccl_computes_the_single_process_logits(tiny_checkpoints):
    """The same on 2 GPUs over NCCL, fp32."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    dirs = [str(tiny_checkpoints[p]) for p in (PRESET, "kimi-linear-tiny")]
    _check_heads_tp_logits(run_local_world(_heads_tp_logits, 2, dirs, "nccl", timeout_s=300), 1e-3)


def test_cli_world_json_with_and_without_a_draft_model(tiny_checkpoints, capsys) -> None:
    model = str(tiny_checkpoints["kimi-linear-tiny"])
    base = ["generate", "--model", model, "--prompt-ids", ",".join(map(str, [9, 8, 7, 6] * 6)),
            "--max-tokens", "12", "--ignore-eos", "--json"]
    outputs = []
    world = ["--dp", "1", "--cp", "2", "--speculative", "draft", "--draft-model", model, "--num-draft-tokens", "3"]
    for extra in ([], world, [*world, "--draft-tensor-parallel-size", "2"]):
        assert main(base + extra) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[2] == outputs[1] == outputs[0] and len(outputs[0]["token_ids"]) == 12


# 32 blocks a rank (256 tokens) beside a heads-TP draft (its slots hold half the KDA heads: 0.6 MiB
# gives the draft on the leader alone 32 blocks)
TIGHT = CacheConfig(tokens_per_block=4, memory_budget_mib=0.44, max_num_seqs=4)
LONG_PROMPTS = [_prompt(10 + i, 52) for i in range(4)]  # 4 x (52 + 24) tokens > the group's 256


def _preempting_world(rank: int, world_size: int, init_method: str, model_dir: str,
                      options: WorldOptions) -> dict | int:
    groups = init_parallel(Mapping(world_size, rank, dp=1, cp=2), init_method, backend="gloo",
                           timeout_s=options.timeout_s)
    try:
        part = build_rank(model_dir, groups, options)
        if rank != 0:
            return serve_rank(part)
        assert isinstance(part, EngineCore)
        preempted: list[str] = []
        schedule = part.scheduler.schedule

        def counting_schedule():  # what the scheduler preempted, read off its outputs
            out = schedule()
            preempted.extend(out.preempted_ids)
            return out
        part.scheduler.schedule = counting_schedule
        driver = WorldDriver(part)
        try:
            results = drive_to_completion(driver, LONG_PROMPTS, [greedy(24)] * len(LONG_PROMPTS))
            stats = driver.rank_stats()
        finally:
            driver.shutdown()
        return {"tokens": [r.token_ids for r in results], "preempted": preempted, "rank_stats": stats,
                "drafts": part.spec_stats.num_drafts}
    finally:
        groups.destroy()


def test_a_preempted_request_recomputes_its_draft_cache_with_its_target_cache(reference):
    plain = LLM(reference["model_dir"], cache=CACHE).generate(LONG_PROMPTS, greedy(24))
    options = WorldOptions(cache=TIGHT, timeout_s=60, speculative=reference["heads_tp"])
    front = run_local_world(_preempting_world, 2, reference["model_dir"], options, timeout_s=300)[0]
    assert front["preempted"] and front["drafts"] > 0
    assert front["tokens"] == [r.token_ids for r in plain]
    for stats in front["rank_stats"].values():
        assert stats.num_used_blocks == 0 and stats.num_used_slots == 0
