"""The pulled-shard pieces that run without a GPU: the unit copy's reference and checks, the pull's
unit groups between two pool sets (their refusals; `test_transceiver_memory_map` holds their bytes
to the tagged stream's), pulls out of a ctx world's ranks' pools (the copier's host path), and the
ctx's DescribePools answers where it cannot export. (The pull over CUDA IPC itself:
tests/integration/test_transceiver_cuda.py, GPU-marked.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.kernels.copy.units import CopyUnitsError, UnitGroup, check_units, unit_copy
from helixserve.kvcache.helix import num_local_blocks, num_logical_blocks
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.protocol import transfer_pb2 as pb
from helixserve.transceiver.cuda_ipc import PoolDirectory, PoolExport, _exported_heads, host_id
from helixserve.transceiver.layout import ShardSpec, layout_for
from helixserve.transceiver.fan import sources
from helixserve.transceiver.gen.pull import MAX_PAIRS, PullPair, pull_pair
from tests.unit import test_transceiver_fan_plan as fan_plan

PRESET = "kimi-k3-tiny"


def _group(unit: int, segments, units) -> UnitGroup:
    return UnitGroup(unit, np.asarray(segments, dtype=np.int64).reshape(-1, 2), np.asarray(units, dtype=np.int64).reshape(-1, 2))


@pytest.mark.parametrize("seed", range(6))
def test_unit_copy_moves_every_unit_of_every_segment(seed):
    """Random groups over several tensors (segments naming any pair, units anywhere that fits,
    destinations disjoint): byte i of unit u of segment s lands at its place, nothing else moves."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=gen) for n in rng.integers(512, 2048, 3)]
    dsts = [torch.zeros(int(n), dtype=torch.uint8) for n in rng.integers(1024, 4096, 2)]
    want = [d.clone() for d in dsts]
    taken = [np.zeros(d.numel(), dtype=bool) for d in dsts]
    groups = []
    for _ in range(int(rng.integers(1, 4))):
        unit = int(rng.integers(1, 64))
        segments = [(int(rng.integers(0, 3)), int(rng.integers(0, 2))) for _ in range(int(rng.integers(1, 4)))]
        units = []
        for _ in range(int(rng.integers(1, 6))):
            so = int(rng.integers(0, min(srcs[s].numel() for s, _ in segments) - unit))
            do = int(rng.integers(0, min(dsts[d].numel() for _, d in segments) - unit))
            if any(taken[d][do : do + unit].any() for _, d in segments):
                continue
            for si, di in segments:
                taken[di][do : do + unit] = True
            units.append((so, do))
        if units and len({d for _, d in segments}) == len(segments):  # two segments on one destination would overlap
            groups.append(_group(unit, segments, units))
            for si, di in segments:
                for so, do in units:
                    want[di][do : do + unit] = srcs[si][so : so + unit]
        else:
            for si, di in segments:  # undo: this group is not copied
                for so, do in units:
                    taken[di][do : do + unit] = False
    unit_copy(srcs, dsts, groups)
    for w, d in zip(want, dsts):
        assert torch.equal(w, d)


def test_unit_copy_refuses_units_outside_its_tensors():
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    for group in (_group(8, [0, 0], [60, 0]), _group(4, [0, 0], [0, 30]), _group(1, [1, 0], [0, 0]),
                  _group(1, [0, 0], [0, -1]), _group(1, [0, 2], [0, 0]), _group(-2, [0, 0], [0, 0])):
        with pytest.raises(CopyUnitsError, match="outside|of 1|< 0|tensor 2"):
            unit_copy([a], [b], [group])
    with pytest.raises(CopyUnitsError, match="uint8"):
        check_units([a.view(torch.int32)], [b], [])
    with pytest.raises(CopyUnitsError, match=r"\[n, 2\]"):
        check_units([a], [b], [UnitGroup(1, np.zeros(3, dtype=np.int64), np.zeros((1, 2), dtype=np.int64))])
    unit_copy([a], [b], [_group(4, np.zeros((0, 2)), [0, 0])])  # nothing to copy is fine
    assert not b.any()


def _pools(heads_div: int = 1, blocks: int = 12, slots: int = 3):
    cfg = get_preset(PRESET)
    full = cache_spec_for(cfg, torch.float32, 16)
    return allocate_model_caches(dataclasses.replace(full, kda_num_heads=full.kda_num_heads // heads_div), blocks, slots)


def test_pull_pairs_are_kept_per_pool_set_and_rebuilt_when_a_pool_changes():
    layout = layout_for(get_preset(PRESET), torch.float32, 16, PRESET)
    ctx, gen = _pools(), _pools()
    cache: dict = {}
    pair = pull_pair(cache, layout, ctx, gen, layout.num_kda_heads)
    assert pull_pair(cache, layout, ctx, gen, layout.num_kda_heads) is pair
    layer = next(iter(gen.mla_kv))
    gen.mla_kv[layer] = gen.mla_kv[layer].clone()  # a pool put in another's place
    assert not pair.is_current()
    again = pull_pair(cache, layout, ctx, gen, layout.num_kda_heads)
    assert again is not pair
    assert gen.mla_kv[layer].data_ptr() in [t.data_ptr() for t in again.dsts]
    others = [_pools() for _ in range(MAX_PAIRS + 1)]
    for other in others:
        pull_pair(cache, layout, other, gen, layout.num_kda_heads)
    assert len(cache) == MAX_PAIRS  # bounded: the oldest go


def test_a_pull_pair_refuses_pools_that_do_not_fit_the_layout():
    layout = layout_for(get_preset(PRESET), torch.float32, 16, PRESET)
    with pytest.raises(ValueError, match="layout says"):
        PullPair(layout, _pools(), _pools(), layout.num_kda_heads // 2)  # full-head pools for a cp 2 rank
    gen = _pools()
    gen.kda_state[next(iter(gen.kda_state))] = torch.zeros(3, 2, 2)
    with pytest.raises(ValueError, match="layout says"):
        PullPair(layout, _pools(), gen, layout.num_kda_heads)
    gen = _pools()
    del gen.mla_kv[next(iter(gen.mla_kv))]
    with pytest.raises(ValueError, match="no cache tensor"):
        PullPair(layout, _pools(), gen, layout.num_kda_heads)
    pair = PullPair(layout, _pools(), _pools(2), layout.num_kda_heads // 2)
    with pytest.raises(ValueError, match="KDA heads"):
        pair.groups(ShardSpec(layout, 20), [0, 1], 0, [0, 1], 0)  # a cp 1 shard for a cp 2 rank's pools


def test_pools_are_not_exported_from_host_memory_or_to_another_host():
    cfg = get_preset(PRESET)
    caches = allocate_model_caches(cache_spec_for(cfg, torch.float32, 16), 4, 1)
    export = PoolExport(caches)
    reply = export.describe(pb.PoolsRequest(gen_rank=0, host_id=host_id()))
    assert not reply.supported and "cpu" in reply.reason
    assert not export.names(export.epoch)  # nothing handed out: a pull would be refused
    assert not PoolExport(caches, enabled=False).describe(pb.PoolsRequest(host_id=host_id())).supported


def test_pool_directory_never_asks_for_host_caches():
    directory = PoolDirectory(0, layout_for(get_preset(PRESET), torch.float32, 16, PRESET))
    assert directory.get("ctx:1", client=None, device=torch.device("cpu")) is None  # no call made



def test_prefetch_opens_no_channel_where_nothing_can_be_pulled(monkeypatch):
    """A gen rank on host memory (or with cuda_ipc off) dials no ctx at start: a channel opened
    before the ctx listens could leave the first request's RequestShard behind a pending
    connection attempt (the compose deployment's first request failed so)."""
    from helixserve.config_transceiver import TransceiverConfig
    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver.gen import receiver as receiver_module
    from helixserve.transceiver.gen.receiver import KVReceiver

    def no_client(*args, **kwargs):
        raise AssertionError("prefetch opened a control channel")

    monkeypatch.setattr(receiver_module, "ControlClient", no_client)
    layout = layout_for(get_preset(PRESET), torch.float32, 16, PRESET)
    rx = KVReceiver(TransceiverConfig(backend="fake", kv_transfer_timeout_ms=1000), layout)
    try:
        rx.prefetch([TransceiverEndpoint(host="127.0.0.1", port=1)], torch.device("cpu"))
        off = KVReceiver(TransceiverConfig(backend="fake", kv_transfer_timeout_ms=1000, cuda_ipc=False), layout)
        off.prefetch([TransceiverEndpoint(host="127.0.0.1", port=1)], torch.device("cuda", 0))
        off.close()
        assert rx.clients._clients == {} and rx.pools._asking == {}
    finally:
        rx.close()


@pytest.mark.parametrize("block_ids,slot,dst_ids,dst_slot", [
    ([0, 1, 99], 0, [0, 1, 2], 0), ([0, -1, 2], 0, [0, 1, 2], 0), ([0, 1], 0, [0, 1, 2], 0), ([0, 1, 2], 7, [0, 1, 2], 0),
    ([0, 1, 2], -2, [0, 1, 2], 0), ([0, 1, 2], None, [0, 1, 2], 0), ([0, 1, 2], 0, [0, 12, 2], 0),
    ([0, 1, 2], 0, [0, 1], 0), ([0, 1, 2], 0, [0, 1, 2], 3)])
def test_a_hostile_pull_shard_copies_nothing_outside_the_pools(block_ids, slot, dst_ids, dst_slot):
    """The receiver turns a ctx's PullShard or PullGrant (block table, slot) and its own handle
    into unit groups over the pools it opened; a block or slot outside either side's pools, a
    missing slot, or a table too short for the prompt raises before anything is launched
    (Inbound._start_pull then fails the request and cancels; a grant falls back to asking)."""
    layout = layout_for(get_preset(PRESET), torch.float32, 16, PRESET)
    pair = PullPair(layout, _pools(), _pools(), layout.num_kda_heads)
    spec = ShardSpec(layout, 16 * 2 + 1)  # 3 blocks
    with pytest.raises(ValueError, match="outside|needs logical block|needs a state slot|handle holds"):
        pair.groups(spec, block_ids, slot, dst_ids, dst_slot)
    assert pair.groups(spec, [0, 1, 2], 0, [0, 1, 2], 0)  # the same request, in range, is fine
    assert pair.groups(spec, [11, 0, 10], 2, [0, 11, 1], 2)  # the last block and slot of each pool too


def test_a_unit_copier_checks_its_segments_once_and_copies_like_the_reference():
    from helixserve.kernels.copy.units import UnitCopier, unit_copy_reference

    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randint(0, 256, (256,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    dsts = [torch.zeros(256, dtype=torch.uint8) for _ in range(2)]
    segments = np.asarray([[0, 1], [1, 0]], dtype=np.int64)
    copier = UnitCopier(srcs, dsts, [segments])
    groups = [UnitGroup(16, copier.segments[0], np.asarray([[0, 32], [100, 200]], dtype=np.int64))]
    want = [d.clone() for d in dsts]
    unit_copy_reference(srcs, want, groups)
    copier.copy(groups)
    assert all(torch.equal(w, d) for w, d in zip(want, dsts))
    for bad in (np.asarray([[0, 2]]), np.asarray([[-1, 0]]), np.zeros(2, dtype=np.int64)):
        with pytest.raises(CopyUnitsError, match="do not name"):
            UnitCopier(srcs, dsts, [bad])
    with pytest.raises(CopyUnitsError, match="uint8"):
        UnitCopier([srcs[0].view(torch.int16)], dsts, [segments])


def test_checked_caches_are_checked_again_when_a_pool_is_replaced():
    """A receiver checks its caches on every request; a pass is remembered per pool tensor, so
    a pool put in another's place (here misshapen) is checked again and refused."""
    from helixserve.transceiver import cache_check
    from helixserve.transceiver.cache_check import check_caches

    layout = layout_for(get_preset(PRESET), torch.float32, 16, PRESET)
    caches = _pools()
    check_caches(layout, caches, layout.num_kda_heads, remember=True)
    check_caches(layout, caches, layout.num_kda_heads, remember=True)  # remembered
    key = (id(layout), id(caches), layout.num_kda_heads)
    assert key in cache_check._CHECKED_CACHES
    layer = next(iter(caches.kda_state))
    caches.kda_state[layer] = torch.zeros(3, 1, 2, 2)
    # the replaced pool died: its pass is forgotten (a new tensor may reuse its id)
    assert key not in cache_check._CHECKED_CACHES
    with pytest.raises(ValueError, match="layout says"):
        check_caches(layout, caches, layout.num_kda_heads, remember=True)
    with pytest.raises(ValueError, match="layout says"):
        check_caches(layout, _pools(2), layout.num_kda_heads, remember=True)  # another cache set: checked anew


def test_a_remembered_cache_check_keeps_no_pool_alive():
    """The memo holds weak references: a receiver's dropped cache set (a restarted world's) is
    freed, not kept by the check it once passed."""
    import gc
    import weakref

    from helixserve.transceiver.cache_check import check_caches

    layout = layout_for(get_preset(PRESET), torch.float32, 16, PRESET)
    caches = _pools()
    pool = weakref.ref(next(iter(caches.mla_kv.values())))
    check_caches(layout, caches, layout.num_kda_heads, remember=True)
    del caches
    gc.collect()
    assert pool() is None


FAN_CASES = [(tp, cp) for tp in (1, 2, 4) for cp in (1, 2, 4)]


@pytest.mark.parametrize("tp, cp_size", FAN_CASES, ids=[f"tp{tp}-cp{cp}" for tp, cp in FAN_CASES])
@pytest.mark.parametrize("num_tokens", [1, fan_plan.TPB + 1, 9 * fan_plan.TPB + 2])
def test_a_pull_from_each_ctx_rank_leaves_the_gen_ranks_shard_of_the_single_process_cache(tp, cp_size, num_tokens):
    """Pulls out of a ctx world's pools (each rank's H/N heads and local blocks, opened apart):
    each gen rank copies, out of every rank holding part of its shard, that part with the unit
    groups a PullPair of that rank's pools gives; its pools then equal its shard of the
    single-process cache, and nothing else is written (the pools here are in host memory: the
    copier's reference path; CUDA IPC opens the same pools on a GPU)."""
    world = fan_plan.CtxWorld(num_tokens, tp)
    heads = fan_plan.H
    for cp_rank in range(cp_size):
        gen = fan_plan._pools(heads // cp_size, None)
        table = fan_plan._table(300 + cp_rank, num_local_blocks(num_tokens, fan_plan.TPB, cp_rank, cp_size))
        slot = 2
        pairs: dict = {}
        for src in sources(num_logical_blocks(num_tokens, fan_plan.TPB), heads, tp, cp_rank, cp_size):
            layout = world.layout.model_copy(update={"ctx_rank": src.ctx_rank})
            spec = ShardSpec(layout, num_tokens, cp_rank, cp_size, src.ctx_rank)
            caches, ctx_table, ctx_slot = world.ranks[src.ctx_rank]
            pair = pull_pair(pairs, layout, caches, gen, heads // cp_size)
            pair.copier.copy(pair.groups(spec, ctx_table, ctx_slot, table, slot))
        mine = list(range(cp_rank, len(world.full_table), cp_size))
        lo, hi = cp_rank * heads // cp_size, (cp_rank + 1) * heads // cp_size
        untouched = [b for b in range(fan_plan.NUM_BLOCKS) if b not in table]
        for layer, pool in gen.mla_kv.items():
            assert torch.equal(pool[table], world.full.mla_kv[layer][[world.full_table[b] for b in mine]])
            assert not pool[untouched].any(), "a block the shard does not own was written"
        for layer, pool in gen.kda_state.items():
            assert torch.equal(pool[slot], world.full.kda_state[layer][fan_plan.FULL_SLOT, lo:hi]), layer
            assert not pool[[0, 1]].any()
        for layer, pool in gen.conv_state.items():
            want = fan_plan._conv_heads(world.full.conv_state[layer][fan_plan.FULL_SLOT], heads, lo, hi)
            assert torch.equal(pool[slot], want), layer
            assert not pool[[0, 1]].any()


def test_a_pull_pair_of_a_ctx_rank_refuses_pools_of_another_world_size():
    world = fan_plan.CtxWorld(9, 2)
    caches, _, _ = world.ranks[0]
    with pytest.raises(ValueError, match=r"\(3, 2, 32, 32\), the layout says float32 \[\*, 1, 32, 32\]"):
        PullPair(world.layout.model_copy(update={"ctx_tp_size": 4}), caches, fan_plan._pools(fan_plan.H, None),
                 fan_plan.H)


def test_opened_pools_are_checked_at_the_heads_an_exporting_rank_holds():
    """A ctx rank of a tp N world exports ``H / N`` heads: the gen checks its pools at that count;
    a count no world size gives is refused naming it."""
    assert _exported_heads(fan_plan.CtxWorld(9, 2).ranks[1][0], fan_plan.LAYOUT) == fan_plan.H // 2
    assert _exported_heads(fan_plan._pools(fan_plan.H, None), fan_plan.LAYOUT) == fan_plan.H
    odd = fan_plan._pools(3, None)
    with pytest.raises(ValueError, match="3 heads is no ctx rank's share of 4"):
        _exported_heads(odd, fan_plan.LAYOUT)
