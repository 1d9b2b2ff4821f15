"""The fast paths of a pulled shard's host work against the code they replaced (tests/unit/
_pull_reference.py): each side's memory map (`memory_map.map_memory` with per-pool constants and
shared per-shape runs), the stacked piece table, the shared stream plans, the AUX payload, and
the trusted batched copy. Same runs, same tables, same refusals with the same messages."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from helixserve.cache_layout import CacheSpec, cache_spec_for
from helixserve.kernels.copy.units import unit_copy
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.transceiver import layout as layout_module
from helixserve.transceiver import memory_map
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.layout import (ALONE_BYTES, MAX_FIRST_TOKENS, SegmentMemory, ShardPlan,
                                           ShardSpec, encode_aux, layout_for, plan_messages, shard_segments)
from helixserve.transceiver.segments import gather
from helixserve.transceiver.gen.pull import PullPair
from tests.unit._pull_reference import reference_aux, reference_memory

CFG = get_preset("kimi-k3-tiny")  # layers 0..5: kda 0,1,2,4; mla 3,5; 4 KDA heads of 32
TPB = 4
LAYOUT = layout_for(CFG, torch.float32, TPB, "kimi-k3-tiny")
NUM_BLOCKS, NUM_SLOTS = 48, 3


def _layout_and_spec(kinds: str) -> tuple:
    """(layout, full-head CacheSpec): the tiny model, or only its MLA ("mla") or KDA ("kda") layers."""
    full = cache_spec_for(CFG, torch.float32, TPB)
    if kinds == "both":
        return LAYOUT, full
    layer_kinds = ["mla", "mla", "mla"] if kinds == "mla" else ["kda", "kda"]
    ids = tuple(range(len(layer_kinds)))
    spec = CacheSpec(ids if kinds == "mla" else (), ids if kinds == "kda" else (), full.kv_lora_rank,
                     full.qk_rope_head_dim, full.kda_num_heads, full.kda_head_dim, full.conv_kernel_size,
                     full.dtype, TPB)
    return LAYOUT.model_copy(update={"layer_kinds": layer_kinds}), spec


def _caches(cache_spec: CacheSpec, heads: int, seed: int):
    caches = allocate_model_caches(dataclasses.replace(cache_spec, kda_num_heads=heads), NUM_BLOCKS, NUM_SLOTS)
    gen = torch.Generator().manual_seed(seed)
    for pool in caches.tensors():
        pool.copy_(torch.randn(pool.shape, generator=gen))
    return caches


def _assert_same_map(got: list[SegmentMemory], want: list[SegmentMemory]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.runs == w.runs and g.starts == w.starts
        assert (g.flat.data_ptr(), g.flat.numel(), g.flat.dtype) == (w.flat.data_ptr(), w.flat.numel(), w.flat.dtype)


CASES = [  # (layer kinds, prompt tokens, cp_size, cp_rank, the ctx's block table)
    ("both", 1, 1, 0, [7]),  # one block, one token
    ("both", TPB, 1, 0, [5]),  # exactly one block
    ("both", TPB + 1, 1, 0, [5, 6]),  # one token over a block boundary: adjacent ids, one run
    ("both", 23, 1, 0, [9, 10, 2, 3, 4, 15]),  # non-contiguous ids: runs 9-10, 2-4, 15
    ("both", 23, 2, 0, [9, 2, 3, 7, 0, 11]),
    ("both", 23, 2, 1, [9, 2, 3, 7, 0, 11]),
    ("both", 3, 2, 1, [4]),  # rank 1 owns no block of a one-block prompt
    ("both", 24, 4, 3, list(range(40, 46))),
    ("both", TPB * 40, 1, 0, [(7 * b) % NUM_BLOCKS for b in range(40)]),  # > SMALL_SEGMENT_UNITS: numpy
    ("both", TPB * 40, 2, 1, list(range(40))),
    ("mla", 23, 1, 0, [9, 10, 2, 3, 4, 15]),  # no KDA layer: no state or conv segment
    ("kda", 23, 2, 1, []),  # no MLA layer: states only
]


@pytest.mark.parametrize("kinds, num_tokens, cp_size, cp_rank, ctx_blocks", CASES)
def test_memory_maps_match_the_per_segment_reference(kinds, num_tokens, cp_size, cp_rank, ctx_blocks):
    layout, cache_spec = _layout_and_spec(kinds)
    spec = ShardSpec(layout, num_tokens, cp_rank, cp_size)
    heads = layout.num_kda_heads
    ctx, gen = _caches(cache_spec, heads, 1), _caches(cache_spec, heads // cp_size, 2)
    ctx_blocks = ctx_blocks + [0] * (spec.blocks[-1] + 1 - len(ctx_blocks) if spec.blocks else 0)
    local = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - len(spec.blocks), -1))  # descending: one run each
    theirs = ShardPlan.for_sender(spec, ctx, ctx_blocks, 2, [5, 6], 1 << 20).prepare()
    ours = ShardPlan.for_receiver(spec, gen, local + [0, 1], 1, 1 << 20).prepare()
    physical = [ctx_blocks[b] for b in spec.blocks]
    _assert_same_map(theirs.memory, reference_memory(spec, theirs.segments, ctx, theirs.aux, physical, 2, heads,
                                                     spec.heads[0]))
    _assert_same_map(ours.memory, reference_memory(spec, ours.segments, gen, ours.aux, local, 1, heads // cp_size, 0))
    for plan in (theirs, ours):  # one runs list per kind, shared by its layers
        for kind in (PayloadKind.KDA_STATE, PayloadKind.CONV_STATE, PayloadKind.KV_BLOCKS):
            mine = [m for s, m in zip(plan.segments, plan.memory) if s.kind is kind]
            assert all(m.runs is mine[0].runs for m in mine)
    # the pulled copy (unit groups, no memory map) moves exactly what the tagged stream would
    pair = PullPair(layout, ctx, gen, heads // cp_size)
    unit_copy(pair.srcs, pair.dsts, pair.groups(spec, ctx_blocks, 2, local + [0, 1], 1))
    for message in ours.messages:
        if message.kind is not PayloadKind.AUX:
            want, got = (torch.empty(message.nbytes, dtype=torch.uint8) for _ in range(2))
            gather(theirs.spans(message), want)
            gather(ours.spans(message), got)
            assert torch.equal(got, want), message


def _error(fn) -> str:  # noqa: ANN001
    with pytest.raises(ValueError) as error:
        fn()
    return str(error.value)


@pytest.mark.parametrize("case", ["block past the pool", "negative block", "slot past the pools",
                                  "negative slot", "no slot", "no pool", "wrong dtype", "strided MLA pool",
                                  "strided state pool"])
def test_refusals_match_the_reference(case):
    """A hostile or broken side (a ctx's PullShard, caches that do not fit the layout) is refused
    before any copy with the error the per-segment code gave."""
    spec = ShardSpec(LAYOUT, 16 * TPB + 1)  # 17 blocks: the numpy path for the blocks
    caches = _caches(cache_spec_for(CFG, torch.float32, TPB), LAYOUT.num_kda_heads, 3)
    blocks, slot = list(range(17)), 1
    if case == "block past the pool":
        blocks[5] = NUM_BLOCKS
    elif case == "negative block":
        blocks = [-1, *blocks[1:]]
    elif case == "slot past the pools":
        slot = NUM_SLOTS
    elif case == "negative slot":
        slot = -2
    elif case == "no slot":
        slot = None
    elif case == "no pool":
        del caches.conv_state[2]
    elif case == "wrong dtype":
        caches.kda_state[4] = caches.kda_state[4].double()
    elif case == "strided MLA pool":
        caches.mla_kv[5] = caches.mla_kv[5].transpose(1, 2).contiguous().transpose(1, 2)
    else:
        caches.kda_state[1] = caches.kda_state[1].transpose(2, 3).contiguous().transpose(2, 3)
    plan = ShardPlan.for_sender(spec, caches, blocks, slot, [1], 1 << 20)
    got = _error(plan.prepare)
    want = _error(lambda: reference_memory(spec, plan.segments, caches, plan.aux, blocks, slot,
                                           LAYOUT.num_kda_heads, 0))
    assert got == want and got


def test_stream_plans_are_shared_items_in_fresh_lists():
    spec = ShardSpec(LAYOUT, 23, 1, 2)
    caches = _caches(cache_spec_for(CFG, torch.float32, TPB), LAYOUT.num_kda_heads // 2, 5)
    one = ShardPlan.for_receiver(spec, caches, list(range(3)), 0, 1300)
    one.messages.pop()
    one.segments.clear()  # a plan's lists are its own
    two = ShardPlan.for_receiver(spec, caches, list(range(3)), 0, 1300)
    assert two.segments == shard_segments(spec) and two.messages == plan_messages(shard_segments(spec), 1300)
    other = ShardPlan.for_receiver(spec, caches, list(range(3)), 0, 1 << 20)
    assert other.messages == plan_messages(shard_segments(spec), 1 << 20) != two.messages
    longer = ShardSpec(LAYOUT, 23 + 2 * TPB, 1, 2)  # one more block for rank 1
    assert ShardPlan.for_receiver(longer, caches, list(range(4)), 0, 1300).segments == shard_segments(longer)
    for _ in range(layout_module.MAX_STREAMS + 1):  # bounded
        layout_module._stream(dataclasses.replace(spec, num_tokens=spec.num_tokens + _ * 8), 1, 1300, ALONE_BYTES)
    assert len(layout_module._STREAMS) <= layout_module.MAX_STREAMS


@pytest.mark.parametrize("first", [[0], [7, 9], list(range(100, 100 + MAX_FIRST_TOKENS))])
def test_aux_payload_is_the_one_built_word_by_word(first):
    got, want = encode_aux(4097, first), reference_aux(4097, first)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_pool_constants_follow_their_tensor():
    """Read once per pool tensor; a tensor put in its place, or one whose storage moved, is read
    anew; the entry (and its flat view) goes with the tensor."""
    spec = ShardSpec(LAYOUT, 9)
    caches = _caches(cache_spec_for(CFG, torch.float32, TPB), LAYOUT.num_kda_heads, 6)
    plan = ShardPlan.for_receiver(spec, caches, [3, 4, 5], 0, 1 << 20)
    first = plan.memory
    layer3 = next(i for i, s in enumerate(plan.segments) if s.kind is PayloadKind.KV_BLOCKS and s.layer_id == 3)
    assert memory_map.pool_info(caches.mla_kv[3]) is memory_map.pool_info(caches.mla_kv[3])
    moved = torch.randn(caches.mla_kv[3].shape)
    caches.mla_kv[3].set_(moved)  # in place: same tensor object, another storage
    again = ShardPlan.for_receiver(spec, caches, [3, 4, 5], 0, 1 << 20).memory
    assert again[layer3].flat.data_ptr() == moved.data_ptr() != first[layer3].flat.data_ptr()
    caches.mla_kv[5] = torch.zeros(5, TPB, LAYOUT.kv_lora_rank + LAYOUT.qk_rope_head_dim)  # a smaller pool
    with pytest.raises(ValueError, match="outside"):  # block 5 of 5: its own bounds, not the old pool's
        ShardPlan.for_receiver(spec, caches, [3, 4, 5], 0, 1 << 20).prepare()
    pool = caches.mla_kv.pop(5)
    key = id(pool)
    assert memory_map._POOLS[key].ref() is pool
    del pool
    gc.collect()
    assert key not in memory_map._POOLS or memory_map._POOLS[key].ref() is not None
    assert all(info.ref() is not None for info in memory_map._POOLS.values())
