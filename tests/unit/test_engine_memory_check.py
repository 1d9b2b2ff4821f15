"""The engine sizes its pools with the planner's arithmetic (``helixserve.planning``), giving the
recorded sizes for known configs, and refuses to start when a rank cannot fit its GPU memory
(``cache.gpu_memory_gib``), naming the shortfall."""

from __future__ import annotations

import itertools

import pytest
import torch

from helixserve.config import CacheConfig, SchedulerConfig
from helixserve.engine.rank_setup import allocate_rank_caches, size_cache
from helixserve.engine.llm import LLM
from helixserve.models.presets import get_preset
from helixserve.planning.memory import DeploymentDoesNotFitError, pool_unit_bytes
from helixserve.planning.plan import PlanTarget, plan_configured
from helixserve.planning.weights import rank_weight_bytes

MIB, GIB = 1 << 20, 1 << 30

# (preset, dtype, tokens_per_block, memory_budget_mib, max_num_seqs, cp) -> (num_blocks, num_slots,
# max_model_len): recorded sizes that the pool sizing must keep giving
RECORDED = [
    ("kimi-linear-tiny", "bfloat16", 4, 256, 3, 2, 838598, 3, 4096),
    ("kimi-linear-tiny", "float32", 16, 8, 3, 1, 3203, 3, 4096),
    ("kimi-k3-tiny", "float32", 16, 8, 8, 2, 1572, 8, 4096),
    ("kimi-linear-tiny", "bfloat16", 4, 16, 3, 1, 51903, 3, 4096),
    ("kimi-k3-mid", "bfloat16", 4, 16, 4, 2, 407, 4, 3256),
    ("kimi-k3-tiny", "float32", 4, 8, 16, 1, 5504, 16, 4096),
    ("kimi-linear-tiny", "bfloat16", 4, 2, 3, 1, 6028, 3, 4096),
]


@pytest.mark.parametrize("row", RECORDED, ids=lambda r: "-".join(map(str, r[:6])))
def test_sizes_are_the_recorded_ones(row):
    preset, dtype, tpb, mib, seqs, cp, *expected = row
    _, layout = size_cache(get_preset(preset), getattr(torch, dtype),
                           CacheConfig(tokens_per_block=tpb, memory_budget_mib=mib, max_num_seqs=seqs), cp)
    assert [layout.num_blocks, layout.num_slots, layout.max_model_len] == expected


CONFIGS = list(itertools.product(["kimi-linear-tiny", "kimi-k3-tiny"], [torch.float32, torch.bfloat16], [4, 16],
                                 [2, 4, 8, 16, 64], [3, 4, 6, 16], [1, 2]))


@pytest.mark.parametrize(("preset", "dtype", "tpb", "mib", "seqs", "cp"), CONFIGS)
def test_sizes_fill_the_budget_with_the_tensors_allocated(preset, dtype, tpb, mib, seqs, cp):
    """The test configs' budgets: the pools' tensors fit, and one block more would not."""
    spec, layout = size_cache(get_preset(preset), dtype,
                              CacheConfig(tokens_per_block=tpb, memory_budget_mib=mib, max_num_seqs=seqs), cp)
    assert layout.num_slots == seqs

    def nbytes(num_blocks: int) -> int:
        caches = allocate_rank_caches(spec, layout.__class__(num_blocks, seqs, tpb, 0), "meta")
        pools = (*caches.mla_kv.values(), *caches.kda_state.values(), *caches.conv_state.values())
        return sum(t.numel() * t.element_size() for t in pools)

    assert nbytes(layout.num_blocks) <= mib * MIB < nbytes(layout.num_blocks + 1)


@pytest.mark.parametrize("caching, checkpoints", [({}, "none"), ({"prefix_caching": True}, "auto"),
                                                   ({"prefix_caching": True, "state_checkpoint_slots": 5}, "5")])
def test_the_engine_sizes_what_the_plan_says(tiny_checkpoints, caching, checkpoints):
    """Blocks, slots and KDA state checkpoints alike (the auto count: 1/16 of the budget's worth
    of state slots, at most 32)."""
    cache = CacheConfig(tokens_per_block=4, memory_budget_mib=8, max_num_seqs=4, gpu_memory_gib=1.0, **caching)
    llm = LLM(tiny_checkpoints["kimi-linear-tiny"], cache=cache)
    cfg = llm.model_config
    plan = plan_configured(cfg, "ctx", 1, 1, GIB, PlanTarget(context_len=64, tokens_per_block=4, itemsize=4), cache)
    stats = llm.engine.stats()
    assert (stats.num_blocks, stats.num_slots) == (plan.memory.pools.num_blocks, plan.memory.pools.num_slots)
    slot = pool_unit_bytes(cfg, 4, 4)[1]
    want = {"none": 0, "auto": max(1, min(32, 8 * MIB // 16 // slot)), "5": 5}[checkpoints]
    assert llm.engine.layout.num_checkpoint_slots == plan.memory.pools.checkpoint_slots == want


def test_weights_alone_over_the_gpu_memory_refuse_to_start(tiny_checkpoints):
    cfg = get_preset("kimi-linear-tiny")
    weights = rank_weight_bytes(cfg, 4, expert_format="dense").total_bytes  # float32 checkpoint, ~4.5 MiB
    cache = CacheConfig(tokens_per_block=4, memory_budget_mib=8, max_num_seqs=4, gpu_memory_gib=(weights - 1) / GIB)
    with pytest.raises(DeploymentDoesNotFitError, match=r"engine rank \(dp 1 x cp 1\) does not fit 4\.5 MiB .*"
                       r"weights 4\.5 MiB .*short by .*the weights alone exceed the GPU memory") as err:
        LLM(tiny_checkpoints["kimi-linear-tiny"], cache=cache)
    assert err.value.shortfall_bytes > 8 * MIB


def test_pools_over_the_gpu_memory_refuse_to_start_naming_the_shortfall(tiny_checkpoints):
    cfg = get_preset("kimi-linear-tiny")
    weights = rank_weight_bytes(cfg, 4, expert_format="dense").total_bytes
    scheduler = SchedulerConfig(max_num_batched_tokens=64)
    activations = 64 * cfg.hidden_size * 32 * 4 + 2 * 4 * cfg.vocab_size * 4
    cache = CacheConfig(tokens_per_block=4, memory_budget_mib=8, max_num_seqs=4)
    spec, layout = size_cache(cfg, torch.float32, cache, 1)
    caches = allocate_rank_caches(spec, layout, "meta")
    pools = sum(t.numel() * t.element_size() for d in (caches.mla_kv, caches.kda_state, caches.conv_state)
                for t in d.values())
    need = weights + pools + activations  # CPU: no scratch slot, no graph pools
    for gpu, starts in ((need - 1, False), (need, True)):
        limited = cache.model_copy(update={"gpu_memory_gib": gpu / GIB})
        if starts:
            LLM(tiny_checkpoints["kimi-linear-tiny"], cache=limited, scheduler=scheduler)
            continue
        with pytest.raises(DeploymentDoesNotFitError, match=r"KV/state pools 8\.0 MiB .*short by 1 B \(lower "
                           r"cache\.memory_budget_mib") as err:
            LLM(tiny_checkpoints["kimi-linear-tiny"], cache=limited, scheduler=scheduler)
        assert err.value.shortfall_bytes == 1


def test_gpu_memory_gib_must_be_positive():
    with pytest.raises(ValueError, match="gpu_memory_gib"):
        CacheConfig(gpu_memory_gib=0)
