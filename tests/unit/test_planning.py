"""``helixserve plan``'s arithmetic: weights by format and sharding, pools, the
smallest mappings, against a hand computation from the published configs (kimi.md) and against
the modules the model really builds (on the meta device)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helixserve.config import CacheConfig
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.mxfp4 import quantize_mxfp4
from helixserve.models.presets import get_preset
from helixserve.parallel.mapping import Mapping
from helixserve.planning.memory import (
    DeploymentDoesNotFitError,
    PoolBytes,
    RankMemory,
    activation_bytes,
    pool_unit_bytes,
)
from helixserve.planning.plan import PlanTarget, plan_configured, plan_filled, smallest_mapping
from helixserve.planning.weights import WeightBytes, mxfp4_bytes, rank_weight_bytes

GIB, MIB = 1 << 30, 1 << 20
H200 = 141 * GIB


# ---- hand computation: parameters counted from the published configs (kimi.md), one rank of dp x cp

def k3_hand(dp: int, cp: int) -> tuple[int, int, int]:
    """Kimi K3 (bf16 dense, MXFP4 routed experts): (model-dtype values, fp32 values, expert values)."""
    d, vocab, heads, k = 7168, 163840, 96 // cp, 128
    w = heads * k  # KDA width on this rank
    kda = 3 * d * w + 3 * w * 4 + d * k + k * w + d * heads + d * w + k + w * d  # qkv, convs, f_a, f_b, b, g (full rank), o_norm, o
    mla_heads = 96 // cp
    kv_b = 512 * 96 * 256 if cp == 1 else 96 * 128 * 512 + mla_heads * 128 * 512  # kv_b_proj, or w_uk (all) + w_uv (local)
    mla = (d * 1536 + 1536 + 1536 * 96 * 192  # q_a, q_a_layernorm, q_b
           + d * 576 + 512 + kv_b + d * mla_heads * 128 + mla_heads * 128 * d)  # kv_a, kv_a_layernorm, kv_b, g, o
    moe = 896 * d + 2 * d * 3584 + 3584 + 3 * d * 3072 * 2  # router, latent down/up + norm, 2 shared experts
    norms = 93 * (2 * d + 4 * d) + 3 * d  # per layer: 2 norms + attn-res 2 norms + 2 queries; final + output attn-res
    dense = 2 * vocab * d + norms + 69 * kda + 24 * mla + 3 * d * 33792 + 92 * moe
    fp32 = 69 * (w + heads) + 92 * 896  # dt_bias, A_log; e_score_correction_bias
    experts = 92 * (896 // (dp * cp)) * 3 * 3072 * 3584
    return dense, fp32, experts


def linear48b_hand(dp: int, cp: int) -> tuple[int, int, int]:
    """Kimi Linear 48B-A3B (all bf16): (model-dtype values, fp32 values, expert values)."""
    d, vocab, heads, k = 2304, 163840, 32 // cp, 128
    w = heads * k
    kda = 3 * d * w + 3 * w * 4 + d * k + k * w + d * heads + (d * k + k * w) + k + w * d  # low-rank g_a/g_b gate
    mla_heads = 32 // cp
    kv_b = 512 * 32 * 256 if cp == 1 else 32 * 128 * 512 + mla_heads * 128 * 512
    mla = d * 32 * 192 + d * 576 + 512 + kv_b + mla_heads * 128 * d  # q_proj, kv_a, kv_a_layernorm, kv_b, o (no gate)
    moe = 256 * d + 3 * d * 1024  # router, 1 shared expert
    dense = 2 * vocab * d + 27 * 2 * d + d + 20 * kda + 7 * mla + 3 * d * 9216 + 26 * moe
    fp32 = 20 * (w + heads) + 26 * 256
    experts = 26 * (256 // (dp * cp)) * 3 * 1024 * 2304
    return dense, fp32, experts


def hand_bytes(hand, dp: int, cp: int, mxfp4: bool) -> int:
    dense, fp32, experts = hand(dp, cp)
    return dense * 2 + fp32 * 4 + (experts // 2 + experts // 32 if mxfp4 else experts * 2)


@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (1, 2), (2, 2), (1, 16), (7, 4), (1, 32)])
def test_k3_weights_match_the_hand_count(dp, cp):
    w = rank_weight_bytes(get_preset("kimi-k3"), 2, dp, cp)
    dense, fp32, experts = k3_hand(dp, cp)
    assert (w.dense_bytes, w.fp32_bytes, w.expert_format) == (2 * dense, 4 * fp32, "mxfp4")
    assert w.expert_bytes == experts * 17 // 32 == hand_bytes(k3_hand, dp, cp, True) - 2 * dense - 4 * fp32


def test_k3_expert_totals_match_the_published_parameter_count():
    """896 experts x 92 layers x ~33 M = 2.7 T parameters: ~1.45 TB as MXFP4, ~5.4 TB as bf16."""
    cfg = get_preset("kimi-k3")
    packed, bf16 = rank_weight_bytes(cfg, 2), rank_weight_bytes(cfg, 2, expert_format="dense")
    assert packed.params["routed_experts"] == 92 * 896 * 33_030_144 == 2_722_740_830_208
    assert packed.expert_bytes == 1_446_456_066_048 and 1.44e12 < packed.expert_bytes < 1.46e12
    assert bf16.expert_bytes == 2 * 2_722_740_830_208 and bf16.expert_format == "bf16"


@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (1, 2), (2, 2), (1, 4)])
def test_48b_weights_match_the_hand_count(dp, cp):
    w = rank_weight_bytes(get_preset("kimi-linear-48b"), 2, dp, cp)
    assert w.expert_format == "bf16"
    assert w.total_bytes == hand_bytes(linear48b_hand, dp, cp, False)
    assert w.dense_bytes + w.fp32_bytes + w.expert_bytes == w.total_bytes


@pytest.mark.parametrize("preset", ["kimi-linear-48b", "kimi-k3", "kimi-linear-tiny", "kimi-k3-tiny"])
@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (1, 2), (2, 2), (1, 4)])
def test_weights_equal_the_modules_the_model_builds(preset, dp, cp):
    """The counts are the rank's modules: the model built for that rank on the meta device."""
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, torch.bfloat16, Mapping(dp * cp, 0, dp=dp, cp=cp))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert rank_weight_bytes(cfg, 2, dp, cp, expert_format="dense").total_bytes == held


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "kimi-k3-tiny"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_heads_tp_draft_ranks_weights_equal_the_modules_it_builds(preset, cp):
    """A draft model's heads over a CP group: its heads' weights split, every expert held."""
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, torch.bfloat16, Mapping(cp, 1, dp=1, cp=cp, heads_tp=True))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = rank_weight_bytes(cfg, 2, cp=cp, expert_format="dense", heads_tp=True)
    assert weights.total_bytes == held < rank_weight_bytes(cfg, 2, expert_format="dense").total_bytes


def test_mxfp4_bytes_are_the_packed_tensors():
    packed, scale = quantize_mxfp4(torch.randn(6, 3 * 64, generator=torch.Generator().manual_seed(0)))
    assert mxfp4_bytes(6 * 3 * 64) == packed.numel() + scale.numel() == 6 * 3 * 64 * 17 // 32


def test_pool_units_match_the_hand_count():
    k3 = get_preset("kimi-k3")
    assert pool_unit_bytes(k3, 2, 16, cp=1) == (24 * 16 * 576 * 2, 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2))
    assert pool_unit_bytes(k3, 2, 64, cp=16) == (24 * 64 * 576 * 2, 69 * (6 * 128 * 128 * 4 + 3 * 6 * 128 * 3 * 2))
    assert pool_unit_bytes(get_preset("kimi-linear-48b"), 2, 16) == (7 * 16 * 576 * 2, 20 * (2 * 2**20 + 73_728))


def hand_filled_sequences(weights: int, block: int, slot: int, blocks_per_seq: int, batched: int, hidden: int) -> int:
    """Sequences a GPU holds after weights, activations (2048 x hidden x 32 bf16 values + 2 fp32
    logits rows a sequence), 1 GiB of graph pools and one scratch slot; the budget in whole MiB."""
    logits = 2 * 163840 * 4
    avail = H200 - weights - batched * hidden * 32 * 2 - GIB - slot
    per_seq = slot + blocks_per_seq * block
    n = avail // (per_seq + logits)
    while (avail - n * logits) // MIB * MIB // per_seq < n:
        n -= 1
    return n


def test_k3_on_141_gib_gpus_needs_16_per_role_at_32k():
    cfg = get_preset("kimi-k3")
    t = PlanTarget(context_len=32768, batch=16)
    gen, ctx = smallest_mapping(cfg, "gen", H200, t), smallest_mapping(cfg, "ctx", H200, t)
    assert (gen.memory.dp, gen.memory.cp, gen.num_gpus) == (1, 16, 16) == (ctx.memory.dp, ctx.memory.cp, ctx.num_gpus)
    weights = hand_bytes(k3_hand, 1, 16, True)
    assert gen.memory.weights.total_bytes == weights
    block, slot = 24 * 16 * 576 * 2, 69 * (6 * 128 * 128 * 4 + 3 * 6 * 128 * 3 * 2)
    blocks_per_seq = -(-(32768 // 16) // 16)  # round-robin: rank 0 holds ceil(2048 / 16) blocks
    n = hand_filled_sequences(weights, block, slot, blocks_per_seq, 2048, 7168)
    assert gen.sequences == n == 127 and gen.fits and gen.memory.total_bytes <= H200
    assert gen.memory.activation_bytes == 2048 * 7168 * 32 * 2 + 2 * n * 163840 * 4
    # fewer GPUs: every smaller world experts divide into (896 = 2^7 x 7) cannot hold the weights
    for world in (1, 2, 4, 7, 8, 14):
        cps = [c for c in (1, 2, 4, 8, 16, 32) if world % c == 0 and 96 % c == 0]
        assert all(hand_bytes(k3_hand, world // c, c, True) > H200 for c in cps), world


def test_48b_on_141_gib_gpus_at_128k_context():
    cfg = get_preset("kimi-linear-48b")
    t = PlanTarget(context_len=131072, batch=64)
    ctx, gen = smallest_mapping(cfg, "ctx", H200, t), smallest_mapping(cfg, "gen", H200, t)
    block, slot = 7 * 16 * 576 * 2, 20 * (2 * 2**20 + 73_728)
    one = hand_filled_sequences(hand_bytes(linear48b_hand, 1, 1, False), block, slot, 8192, 2048, 2304)
    assert (ctx.num_gpus, ctx.sequences) == (1, one) == (1, 46)
    # one GPU holds 46 < 64: gen needs two; cp 2 (KDA heads and state halved, KV split) beats dp 2
    slot2 = 20 * (16 * 128 * 128 * 4 + 3 * 16 * 128 * 3 * 2)
    two = hand_filled_sequences(hand_bytes(linear48b_hand, 1, 2, False), block, slot2, 4096, 2048, 2304)
    assert (gen.memory.dp, gen.memory.cp, gen.sequences) == (1, 2, two) == (1, 2, 180)
    assert plan_filled(cfg, "gen", 2, 1, H200, t).sequences < two
    assert not plan_filled(cfg, "gen", 1, 1, H200, t).fits


def test_filled_cache_settings_give_the_same_pools_when_configured():
    """The cache settings a plan prints are what the engine sizes: same blocks, slots, sequences."""
    cfg, t = get_preset("kimi-linear-48b"), PlanTarget(context_len=131072, batch=64)
    filled = plan_filled(cfg, "gen", 1, 2, H200, t)
    again = plan_configured(cfg, "gen", 1, 2, H200, t,
                            CacheConfig(memory_budget_mib=filled.memory_budget_mib, max_num_seqs=filled.max_num_seqs))
    assert again.memory.pools == filled.memory.pools and again.sequences == filled.sequences and again.fits


def test_budget_boundary_and_the_shortfall_message():
    weights = WeightBytes(dense_bytes=100, fp32_bytes=4, expert_bytes=50, expert_format="mxfp4")
    pools = PoolBytes(block_bytes=10, slot_bytes=7, num_blocks=3, num_slots=2, scratch_slots=1)
    total = 154 + 51 + 9 + 0
    for gpu, fits in ((total - 1, False), (total, True), (total + 1, True)):
        mem = RankMemory("gen world", 1, 2, weights, pools, 9, 0, gpu)
        assert mem.total_bytes == total and mem.fits is fits
    with pytest.raises(DeploymentDoesNotFitError, match=r"KV/state pools 51 B .* = 214 B; short by 1 B \(lower cache.memory_budget_mib") as err:
        RankMemory("gen world", 1, 2, weights, pools, 9, 0, total - 1).check()
    assert err.value.shortfall_bytes == 1
    with pytest.raises(DeploymentDoesNotFitError, match="the weights alone exceed the GPU memory"):
        RankMemory("engine", 1, 1, weights, pools, 9, 0, 153).check()


def test_mappings_the_model_cannot_take_and_bad_targets():
    cfg, t = get_preset("kimi-k3"), PlanTarget(context_len=4096)
    assert plan_filled(cfg, "gen", 1, 3, H200, t).problems  # 896 experts over 3 ranks
    assert not plan_filled(cfg, "ctx", 2, 8, H200, t).fits  # a ctx worker is one world
    too_long = PlanTarget(context_len=cfg.max_position_embeddings + 1)
    assert "exceeds the model's" in plan_filled(cfg, "gen", 1, 16, H200, too_long).problems[0]
    assert smallest_mapping(cfg, "gen", 8 * GIB, t, max_world_size=64) is None
    assert activation_bytes(cfg, 2, 1, 1) == 7168 * 32 * 2 + 2 * 163840 * 4


def test_planning_imports_without_torch():
    code = ("import sys, helixserve.planning.plan, helixserve.planning.report, helixserve.kvcache.sizing; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(("preset", "gpu", "context_len"), [("kimi-linear-48b", H200, 131072),
                                                           ("kimi-linear-tiny", 2 * GIB, 4096)])
def test_filled_pools_hold_the_most_sequences_that_fit(preset, gpu, context_len):
    """One sequence more (its pages, slot and activations) overflows the GPU; for the tiny model
    the count passes max_num_batched_tokens, so the scheduler's token budget grows with it."""
    cfg, t = get_preset(preset), PlanTarget(context_len=context_len, batch=1)
    best = plan_filled(cfg, "gen", 1, 1, gpu, t)
    block, slot = pool_unit_bytes(cfg, 2, 16)
    per_seq = slot + -(-context_len // 16) * block
    n = best.max_num_seqs
    assert best.fits and best.sequences == n and best.memory.total_bytes <= gpu
    more = plan_configured(cfg, "gen", 1, 1, gpu, t, CacheConfig(memory_budget_mib=-(-(n + 1) * per_seq // MIB),
                                                                 max_num_seqs=n + 1))
    assert more.sequences == n + 1 and not more.memory.fits
    assert (n > 2048) is (preset == "kimi-linear-tiny")
