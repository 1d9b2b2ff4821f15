"""``helixserve plan`` with speculative decoding: a model drafter's weights and pools are counted on
the rank that holds it exactly as the engine allocates and checks them (the tiny model on the
CPU); a heads-TP draft's share; a hidden drafter on a ctx worker too; ``ngram`` costs nothing; the
filled cache settings start the engine (with a ``max_model_len`` a short drafter needs); a bad draft
path is an error naming it."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import yaml

from helixserve.cli import main
from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.llm import LLM
from helixserve.engine.rank_setup import size_cache
from helixserve.models.config import KimiModelConfig
from helixserve.models.hidden_drafter import load_hidden_drafter
from helixserve.models.kimi import KimiForCausalLM
from helixserve.parallel.mapping import Mapping
from helixserve.planning.drafter import DraftModelError, resolve_drafter
from helixserve.planning.memory import GIB, MIB, DeploymentDoesNotFitError, pool_unit_bytes
from helixserve.planning.plan import PlanTarget, plan_configured, plan_filled
from helixserve.planning.weights import rank_weight_bytes

TPB = 4
CACHE = CacheConfig(tokens_per_block=TPB, memory_budget_mib=8, max_num_seqs=4)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=64)
# float32 checkpoints; the CPU engine captures no graphs
T = PlanTarget(context_len=64, tokens_per_block=TPB, max_num_batched_tokens=64, itemsize=4, cuda_graphs=False)


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return tiny_checkpoints["kimi-linear-tiny"]


@pytest.fixture(scope="module")
def cfg(target):
    return KimiModelConfig.from_pretrained(target)


def _spec(method: str, path, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, draft_model=path, **kw)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("method", ["draft", "hidden"])
def test_the_plan_is_what_the_engine_allocates_and_checks(target, cfg, tiny_drafters, method):
    """The engine starts on a GPU of exactly the plan's bytes (less the CUDA scratch slot the CPU
    has not) and refuses one byte less; its drafter's pools and weights are the plan's."""
    speculative = _spec(method, tiny_drafters[method])
    plan = plan_configured(cfg, "gen", 1, 1, GIB, T, CACHE, resolve_drafter(speculative, cfg, CACHE))
    pools = plan.memory.pools
    need = plan.memory.total_bytes - pools.slot_bytes - pools.draft_slot_bytes  # no scratch slot on the CPU
    with pytest.raises(DeploymentDoesNotFitError, match=r"drafter weights .* \(drafter's .*short by 1 B"):
        LLM(target, cache=CACHE.model_copy(update={"gpu_memory_gib": (need - 1) / GIB}), scheduler=SCHEDULER,
            speculative=speculative)
    engine = LLM(target, cache=CACHE.model_copy(update={"gpu_memory_gib": need / GIB}), scheduler=SCHEDULER,
                 speculative=speculative).engine
    assert (engine.layout.num_blocks, engine.layout.num_slots) == (pools.num_blocks, pools.num_slots)
    runner = engine.draft_runner
    allocated = runner.caches.nbytes + (runner.prompt_cache.features.nbytes if method == "hidden" else 0)
    assert replace(pools, scratch_slots=0).draft_bytes == allocated > 0
    model = runner.runner.model if method == "draft" else runner.model
    assert plan.memory.draft_weight_bytes == _nbytes(model.parameters())


@pytest.mark.parametrize("method", ["draft", "hidden"])
def test_weights_with_a_drafter_are_the_targets_plus_the_drafters(cfg, tiny_drafters, method):
    drafter = resolve_drafter(_spec(method, tiny_drafters[method]), cfg, CACHE)
    alone, with_drafter = (plan_configured(cfg, "gen", 1, 1, GIB, T, CACHE, d) for d in (None, drafter))
    assert alone.memory.weights == with_drafter.memory.weights and alone.memory.draft_weights is None
    assert with_drafter.memory.draft_weights == drafter.weight_bytes(4)
    extra = with_drafter.memory.total_bytes - alone.memory.total_bytes
    pool_change = with_drafter.memory.pools.total_bytes - alone.memory.pools.total_bytes
    assert extra == drafter.weight_bytes(4).total_bytes + pool_change
    # the same budget holds fewer target blocks: the drafter's pages and slots come out of it
    assert with_drafter.memory.pools.num_blocks < alone.memory.pools.num_blocks
    assert with_drafter.memory.pools.draft_bytes > 0


def test_a_heads_tp_draft_holds_its_share_on_every_rank(cfg, tiny_drafters):
    """gen dp 1 x cp 2: on the leader alone the whole draft model and full-head draft slots; its
    heads over the group: each rank the modules it builds and half the KDA heads; full-row pages
    (``cp`` per block) either way, and every rank's pools sized as the engine sizes them."""
    path = tiny_drafters["draft"]
    draft_cfg = KimiModelConfig.from_pretrained(path)
    block, slot = pool_unit_bytes(draft_cfg, 4, TPB)
    plans = {}
    for tp in (1, 2):
        drafter = resolve_drafter(_spec("draft", path, draft_tensor_parallel_size=tp), cfg, CACHE)
        plans[tp] = plan = plan_configured(cfg, "gen", 1, 2, GIB, T, CACHE, drafter)
        assert plan.fits and plan.drafter.tp == tp
        _, layout = size_cache(cfg, torch.float32, CACHE, 2, drafter)
        assert (plan.memory.pools.num_blocks, plan.memory.pools.num_slots) == (layout.num_blocks, layout.num_slots)
        assert plan.memory.pools.draft_block_bytes == 2 * block
    assert plans[1].memory.draft_weights == rank_weight_bytes(draft_cfg, 4)
    assert plans[1].memory.pools.draft_slot_bytes == slot
    with torch.device("meta"):
        share = KimiForCausalLM(draft_cfg, torch.float32, Mapping(2, 0, dp=1, cp=2, heads_tp=True))
    assert plans[2].memory.draft_weight_bytes == _nbytes(share.parameters()) < plans[1].memory.draft_weight_bytes
    assert plans[2].memory.pools.draft_slot_bytes == pool_unit_bytes(draft_cfg, 4, TPB, 2)[1] < slot
    drafter = resolve_drafter(_spec("draft", path, draft_tensor_parallel_size=2), cfg, CACHE)
    wrong = plan_configured(cfg, "gen", 1, 4, GIB, T, CACHE, drafter)
    assert "speculative.draft_tensor_parallel_size=2 must be 1 or the gen's cp=4" in wrong.problems


def test_a_heads_tp_hidden_drafter_holds_its_share_on_every_gen_rank_and_whole_on_the_ctx(
        target, cfg, tiny_drafters, capsys):
    """A hidden drafter's heads over a gen CP group of 2: each rank the modules it builds (its
    heads' share, the input projections and norms whole), full-row pages either way; the ctx
    worker, one rank, holds it whole (the flag is the gen's)."""
    path = tiny_drafters["hidden"]
    plans = {}
    for tp in (1, 2):
        drafter = resolve_drafter(_spec("hidden", path, draft_tensor_parallel_size=tp), cfg, CACHE)
        plans[tp] = plan = plan_configured(cfg, "gen", 1, 2, GIB, T, CACHE, drafter)
        assert plan.fits and plan.drafter.tp == tp
    mapping = Mapping(2, 0, dp=1, cp=2, heads_tp=True)
    share = _nbytes(load_hidden_drafter(path, mapping=mapping).parameters())
    assert plans[2].memory.draft_weight_bytes == share < plans[1].memory.draft_weight_bytes
    assert plans[2].memory.pools.draft_bytes == plans[1].memory.pools.draft_bytes
    base = ["--model", str(target), "--gpu-memory-gib", "2", "--context-len", "256"]
    tp2 = _plan_json(capsys, *base, "--speculative", "hidden", "--draft-model", str(path),
                     "--draft-tensor-parallel-size", "2")
    assert tp2["speculative"]["ctx"]["draft_tensor_parallel_size"] == 1
    assert tp2["speculative"]["gen"]["draft_tensor_parallel_size"] == 2


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_hidden_drafter_is_counted_on_ctx_too_and_a_draft_model_on_gen_only(target, tiny_drafters, capsys):
    base = ["--model", str(target), "--gpu-memory-gib", "2", "--context-len", "256"]
    hidden = _plan_json(capsys, *base, "--speculative", "hidden", "--draft-model", str(tiny_drafters["hidden"]))
    features = 3 * 128  # three target layers' outputs of kimi-linear-tiny's hidden size
    for role in ("ctx", "gen"):
        d = hidden["roles"][role]["drafter"]
        assert (d["method"], d["feature_row_bytes"], d["held_on"]) == ("hidden", 2 * features, "the one rank")
        # 256 tokens in 16-token blocks; a hidden drafter keeps no KDA state, a feature row per slot
        assert d["bytes_per_sequence"] == 16 * d["block_bytes"] + 2 * features and d["slot_bytes"] == 0
        assert hidden["speculative"][role]["method"] == "hidden"
    assert [c["tp"] for c in hidden["ctx_layouts"] if not c["fits"]] == [2, 4]
    assert "a ctx worker runs speculative decoding in one rank" in hidden["ctx_layouts"][1]["problems"][0]
    draft = _plan_json(capsys, *base, "--speculative", "draft", "--draft-model", str(tiny_drafters["draft"]))
    assert draft["roles"]["ctx"]["drafter"] is None and draft["speculative"]["ctx"] is None
    assert draft["roles"]["gen"]["drafter"]["method"] == "draft"


def test_a_configs_speculative_sections_are_planned_per_role(tmp_path, target, cfg, tiny_drafters, capsys):
    spec = {"method": "hidden", "draft_model": str(tiny_drafters["hidden"])}
    config = {"model": {"path": str(target)},
              "cache": {"tokens_per_block": TPB, "memory_budget_mib": 8, "max_num_seqs": 4, "gpu_memory_gib": 2},
              "scheduler": {"max_num_batched_tokens": 64}, "ctx": [{"speculative": spec}],
              "gen": [{"dp": 1, "cp": 2, "speculative": {"method": "ngram"}}]}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = _plan_json(capsys, "-c", str(path), "--context-len", "64", "--dtype", "float32")
    ctx, gen = plan["config"]["ctx"], plan["config"]["gen"]
    drafter = resolve_drafter(_spec("hidden", tiny_drafters["hidden"]), cfg, CACHE)
    expected = plan_configured(cfg, "ctx", 1, 1, 2 * GIB, replace(T, cuda_graphs=True), CACHE, drafter)
    assert ctx["per_rank"]["total_bytes"] == expected.memory.total_bytes and ctx["fits"]
    assert ctx["drafter"]["weights_bytes"] == drafter.weight_bytes(4).total_bytes
    assert gen["drafter"] is None and plan["speculative"]["gen"]["method"] == "ngram"


def test_ngram_plans_as_no_speculation_and_says_so(target, capsys):
    base = ["--model", str(target), "--gpu-memory-gib", "2", "--context-len", "256"]
    plain, ngram = _plan_json(capsys, *base), _plan_json(capsys, *base, "--speculative", "ngram")
    assert ngram.pop("speculative")["gen"]["method"] == "ngram"
    assert plain.pop("speculative") == {"ctx": None, "gen": None}
    assert ngram == plain
    assert main(["plan", *base, "--speculative", "ngram"]) == 0
    assert "| gen | ngram (prompt lookup) | - | none | none | none |" in capsys.readouterr().out
    assert main(["plan", *base]) == 0 and "speculative decoding" not in capsys.readouterr().out


def test_the_table_names_the_drafter_and_its_cost(target, tiny_drafters, capsys):
    assert main(["plan", "--model", str(target), "--gpu-memory-gib", "2", "--context-len", "256",
                 "--speculative", "draft", "--draft-model", str(tiny_drafters["draft"])]) == 0
    text = capsys.readouterr().out
    assert "| role | drafter | held on | weights | pools | per sequence at context |" in text
    assert "| gen | draft model draft | the one rank | " in text


def test_the_filled_cache_settings_start_the_engine_with_its_drafter(target, cfg, tiny_drafters):
    """The budget and sequences the plan writes for a GPU start the engine with the drafter on it,
    with the plan's pools; the drafter costs sequences against the plan without it."""
    speculative = _spec("draft", tiny_drafters["draft"])
    drafter = resolve_drafter(speculative, cfg, CACHE)
    gpu = 48 * MIB

    def start(plan):
        cache = CacheConfig(tokens_per_block=TPB, memory_budget_mib=plan.memory_budget_mib,
                            max_num_seqs=plan.max_num_seqs, gpu_memory_gib=gpu / GIB)
        scheduler = SchedulerConfig(max_num_batched_tokens=max(64, plan.max_num_seqs))
        return LLM(target, cache=cache, scheduler=scheduler, speculative=speculative).engine

    plan, without = plan_filled(cfg, "gen", 1, 1, gpu, T, drafter), plan_filled(cfg, "gen", 1, 1, gpu, T)
    assert plan.fits and plan.sequences == plan.max_num_seqs > 1
    assert plan.memory.total_bytes <= gpu and plan.max_num_seqs < without.max_num_seqs
    with pytest.raises(ValueError, match="cache budget .* too small"):  # settings that leave the drafter out
        start(without)
    engine = start(plan)
    assert (engine.layout.num_blocks, engine.layout.num_slots) == (plan.memory.pools.num_blocks,
                                                                   plan.memory.pools.num_slots)


def test_a_bad_draft_path_is_an_error_naming_it(target, tmp_path, capsys):
    base = ["plan", "--model", str(target), "--gpu-memory-gib", "2"]
    missing = tmp_path / "no-draft"
    assert main([*base, "--speculative", "draft", "--draft-model", str(missing)]) == 2
    assert f"speculative.draft_model {missing}: no config.json there" in capsys.readouterr().err
    assert main([*base, "--speculative", "hidden", "--draft-model", str(target)]) == 2
    assert "not a hidden-state drafter" in capsys.readouterr().err
    assert main([*base, "--draft-model", str(missing)]) == 2
    assert "--draft-model: only with --speculative draft or hidden" in capsys.readouterr().err


def test_a_drafter_with_fewer_positions_needs_max_model_len(target, cfg, tiny_drafters, tmp_path):
    """The engine refuses a drafter shorter than its max_model_len; the plan names the setting
    and the filled plan writes it."""
    short = tmp_path / "short"
    shutil.copytree(tiny_drafters["draft"], short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    speculative = _spec("draft", short)
    drafter = resolve_drafter(speculative, cfg, CACHE)
    plan = plan_configured(cfg, "gen", 1, 1, GIB, T, CACHE, drafter)
    assert any("set cache.max_model_len <= 1024" in p for p in plan.problems) and not plan.fits
    with pytest.raises(DraftModelError, match="max_position_embeddings 1024 < the engine's max_model_len 4096"):
        LLM(target, cache=CACHE, scheduler=SCHEDULER, speculative=speculative)
    limited = CACHE.model_copy(update={"max_model_len": 1024})
    assert plan_configured(cfg, "gen", 1, 1, GIB, T, limited, drafter).fits
    LLM(target, cache=limited, scheduler=SCHEDULER, speculative=speculative)
    assert plan_filled(cfg, "gen", 1, 1, 48 * MIB, T, drafter).max_model_len == 1024
    assert plan_filled(cfg, "gen", 1, 1, 48 * MIB, T, resolve_drafter(_spec("draft", tiny_drafters["draft"]), cfg,
                                                                       CACHE)).max_model_len is None
