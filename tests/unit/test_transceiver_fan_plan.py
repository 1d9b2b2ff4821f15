"""A ctx world's sub-shards as stream plans (pure, no transport): each ctx rank s of tp N maps the
part of a gen rank's shard it holds from its own pools (H/N heads, its local blocks), the gen rank
maps it into its pools (H/c heads, its local blocks); the messages of every source, copied from
sender spans to receiver spans, leave each gen rank's pools equal to its shard of the
single-process cache, and write nothing else."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from helixserve.cache_layout import ModelCaches, cache_spec_for
from helixserve.kvcache.helix import num_local_blocks, num_logical_blocks
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.fan import sources
from helixserve.transceiver.layout import ShardPlan, ShardSpec, layout_for, shard_segments
from helixserve.transceiver.segments import gather

CFG = get_preset("kimi-k3-tiny")  # layers 0..5: kda 0,1,2,4; mla 3,5; 4 KDA heads of 32
TPB = 4
H, K = CFG.kda_num_heads, CFG.kda_head_dim
LAYOUT = layout_for(CFG, torch.float32, TPB, "kimi-k3-tiny")
NUM_BLOCKS, NUM_SLOTS = 40, 3
FULL_SLOT = 1


def _pools(heads: int, seed: int | None) -> ModelCaches:
    spec = dataclasses.replace(cache_spec_for(CFG, torch.float32, TPB), kda_num_heads=heads)
    caches = allocate_model_caches(spec, NUM_BLOCKS, NUM_SLOTS)
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    for pool in caches.tensors():
        pool.copy_(torch.randn(pool.shape, generator=gen) if seed is not None else torch.zeros(pool.shape))
    return caches


def _conv_heads(conv: torch.Tensor, heads: int, lo: int, hi: int) -> torch.Tensor:
    """Rows of KDA heads [lo, hi) of each q | k | v section of a ``[3*heads*K, W-1]`` conv state."""
    return torch.cat([conv[s * heads * K + lo * K : s * heads * K + hi * K] for s in range(3)])


def _table(seed: int, count: int) -> list[int]:
    """`count` distinct block ids in a shuffled order (fragmented: several runs)."""
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:count].tolist()


class CtxWorld:
    """What each rank of a tp N ctx world holds of one single-process prefill: blocks b % N == s
    at a local block table of its own, heads [s*H/N, (s+1)*H/N) at slot `s % NUM_SLOTS`."""

    def __init__(self, num_tokens: int, tp: int) -> None:
        self.full = _pools(H, 7)
        self.full_table = _table(11, num_logical_blocks(num_tokens, TPB))
        self.layout = LAYOUT.model_copy(update={"ctx_tp_size": tp})
        self.ranks: list[tuple[ModelCaches, list[int], int]] = []
        for s in range(tp):
            caches, table, slot = _pools(H // tp, 100 + s), _table(200 + s, NUM_BLOCKS), s % NUM_SLOTS
            blocks = list(range(s, len(self.full_table), tp))
            lo, hi = s * H // tp, (s + 1) * H // tp
            for layer, pool in caches.mla_kv.items():
                pool[table[: len(blocks)]] = self.full.mla_kv[layer][[self.full_table[b] for b in blocks]]
            for layer, pool in caches.kda_state.items():
                pool[slot] = self.full.kda_state[layer][FULL_SLOT, lo:hi]
            for layer, pool in caches.conv_state.items():
                pool[slot] = _conv_heads(self.full.conv_state[layer][FULL_SLOT], H, lo, hi)
            self.ranks.append((caches, table[: len(blocks)], slot))


def _receive(world: CtxWorld, num_tokens: int, cp_rank: int, cp_size: int, message_bytes: int):
    gen = _pools(H // cp_size, None)
    table = _table(300 + cp_rank, num_local_blocks(num_tokens, TPB, cp_rank, cp_size))
    slot = 2
    srcs = sources(num_logical_blocks(num_tokens, TPB), H, world.layout.ctx_tp_size, cp_rank, cp_size)
    for src in srcs:
        spec = ShardSpec(world.layout, num_tokens, cp_rank, cp_size, src.ctx_rank)
        caches, ctx_table, ctx_slot = world.ranks[src.ctx_rank]
        theirs = ShardPlan.for_sender(spec, caches, ctx_table, ctx_slot, [9], message_bytes)
        ours = ShardPlan.for_receiver(spec, gen, table, slot, message_bytes)
        assert theirs.messages == ours.messages and theirs.segments == ours.segments
        for message in theirs.messages:
            staged, by_spans = (torch.empty(message.nbytes, dtype=torch.uint8) for _ in range(2))
            theirs.gather(message, staged)  # (an indexed copy over many runs)
            gather(theirs.spans(message), by_spans)
            assert torch.equal(staged, by_spans), message
            ours.scatter(staged, message)
    return gen, table, slot, srcs


CASES = [(tp, cp) for tp, cp in itertools.product((1, 2, 4), (1, 2, 4))]


@pytest.mark.parametrize("tp, cp_size", CASES, ids=[f"tp{tp}-cp{cp}" for tp, cp in CASES])
@pytest.mark.parametrize("num_tokens", [1, TPB, TPB + 1, 7 * TPB - 1, 9 * TPB + 2])
@pytest.mark.parametrize("message_bytes", [1 << 20, 1000])
def test_every_gen_rank_gets_its_shard_of_the_single_process_cache_from_the_ctx_ranks(tp, cp_size, num_tokens,
                                                                                      message_bytes):
    world = CtxWorld(num_tokens, tp)
    for cp_rank in range(cp_size):
        gen, table, slot, srcs = _receive(world, num_tokens, cp_rank, cp_size, message_bytes)
        assert [s.ctx_rank for s in srcs] == sorted({s.ctx_rank for s in srcs})
        mine = list(range(cp_rank, len(world.full_table), cp_size))
        lo, hi = cp_rank * H // cp_size, (cp_rank + 1) * H // cp_size
        untouched = [b for b in range(NUM_BLOCKS) if b not in table]
        for layer, pool in gen.mla_kv.items():
            assert torch.equal(pool[table], world.full.mla_kv[layer][[world.full_table[b] for b in mine]])
            assert not pool[untouched].any(), "a block the shard does not own was written"
        for layer, pool in gen.kda_state.items():
            assert torch.equal(pool[slot], world.full.kda_state[layer][FULL_SLOT, lo:hi]), layer
            assert not pool[[0, 1]].any()
        for layer, pool in gen.conv_state.items():
            assert torch.equal(pool[slot], _conv_heads(world.full.conv_state[layer][FULL_SLOT], H, lo, hi)), layer
            assert not pool[[0, 1]].any()


def test_a_ctx_rank_without_the_gen_ranks_heads_sends_no_state_segment():
    layout = LAYOUT.model_copy(update={"ctx_tp_size": 2})
    blocks_only = ShardSpec(layout, 9 * TPB, 1, 4, ctx_rank=1)  # odd blocks; heads [1, 2) are ctx 0's
    assert (blocks_only.blocks, blocks_only.heads, blocks_only.num_heads) == ([1, 5], (0, 0), 0)
    assert [s.kind for s in shard_segments(blocks_only)] == [PayloadKind.AUX, PayloadKind.KV_BLOCKS, PayloadKind.KV_BLOCKS]
    heads_only = ShardSpec(layout, 9 * TPB, 1, 4, ctx_rank=0)
    segments = shard_segments(heads_only)
    assert heads_only.blocks == [] and (heads_only.heads, heads_only.ctx_head0, heads_only.gen_head0) == ((1, 2), 1, 0)
    assert {s.kind for s in segments} == set(PayloadKind) - {PayloadKind.DRAFT} and all(
        s.num_units == 0 for s in segments if s.kind is PayloadKind.KV_BLOCKS)


def test_the_segment_structure_per_pair_is_per_kind_and_only_repeats_over_layers():
    """A (ctx rank, gen rank) pair's stream: each kind's segments are the same units in every
    layer, mapped by one run list per kind; a model of twice the layers repeats them, nothing else."""
    world = CtxWorld(9 * TPB + 2, 4)
    deeper = LAYOUT.model_copy(update={"ctx_tp_size": 4, "layer_kinds": LAYOUT.layer_kinds * 2})
    for cp_rank, src in itertools.product(range(2), range(4)):
        spec = ShardSpec(world.layout, 9 * TPB + 2, cp_rank, 2, src)
        caches, table, slot = world.ranks[src]
        plan = ShardPlan.for_sender(spec, caches, table, slot, [9], 1000).prepare()
        for kind in (PayloadKind.KDA_STATE, PayloadKind.CONV_STATE, PayloadKind.KV_BLOCKS):
            pairs = [(s, m) for s, m in zip(plan.segments, plan.memory) if s.kind is kind]
            assert len({(s.unit_bytes, s.num_units) for s, _ in pairs}) <= 1
            assert all(m.runs is pairs[0][1].runs for _, m in pairs)
        one = shard_segments(spec)
        two = shard_segments(dataclasses.replace(spec, layout=deeper))
        per_kind = {k: {(s.unit_bytes, s.num_units) for s in one if s.kind is k} for k in PayloadKind}
        assert per_kind == {k: {(s.unit_bytes, s.num_units) for s in two if s.kind is k} for k in PayloadKind}
        assert len(two) - 1 == 2 * (len(one) - 1)


def test_a_sub_shard_outside_either_block_table_or_rank_is_refused():
    world = CtxWorld(9 * TPB + 2, 2)  # 10 blocks: ctx 1 holds 1, 3, 5, 7, 9 (local 0..4)
    spec = ShardSpec(world.layout, 9 * TPB + 2, 1, 2, ctx_rank=1)
    caches, table, slot = world.ranks[1]
    with pytest.raises(ValueError, match=r"shard needs logical block 9 \(local block 4\), the request holds 4"):
        ShardPlan.for_sender(spec, caches, table[:4], slot, [9], 1 << 20)
    with pytest.raises(ValueError, match="shard has 5 blocks, the handle holds 4"):
        ShardPlan.for_receiver(spec, _pools(H // 2, None), list(range(4)), 0, 1 << 20)
    with pytest.raises(ValueError, match="ctx_rank 2 outside ctx_tp_size=2"):
        ShardSpec(world.layout, 5, 0, 1, ctx_rank=2)
    with pytest.raises(ValueError, match=r"\(3, 4, 32, 32\), the layout says float32 \[\*, 2, 32, 32\]"):  # full-head pools
        ShardPlan.for_sender(spec, _pools(H, 0), table, slot, [9], 1 << 20).prepare()
