"""The ctx -> gen shard mapping: blocks and heads per CP rank, segment order and sizes, message
cuts (their invariants over random layouts: test_transceiver_message_plan.py), memory runs, the AUX payload and layout-descriptor checks (pure, no transport)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helixserve.cache_layout import cache_spec_for, head_slice
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.transceiver.base import PayloadKind
import helixserve.transceiver.segments as segments_module
from helixserve.transceiver.layout import (ALONE_BYTES, AUX_WORDS, ShardPlan, ShardSpec, decode_aux, encode_aux,
                                           layout_for, plan_messages, shard_segments, wire_tag)
from helixserve.transceiver.layout_match import LayoutMismatchError, check_layout, check_mapping
from helixserve.transceiver.segments import SMALL_SEGMENT_UNITS, SegmentMemory

CFG = get_preset("kimi-k3-tiny")  # layers 0..5: kda 0,1,2,4; mla 3,5; 4 KDA heads of 32
LAYOUT = layout_for(CFG, torch.float32, 4, "kimi-k3-tiny")


def test_layout_for_reads_the_model():
    assert LAYOUT.layer_kinds == ["kda", "kda", "kda", "mla", "kda", "mla"]
    assert (LAYOUT.num_kda_heads, LAYOUT.kda_head_dim, LAYOUT.conv_kernel_size) == (4, 32, 4)
    assert (LAYOUT.kv_lora_rank, LAYOUT.qk_rope_head_dim, LAYOUT.kv_dtype) == (32, 8, "float32")


@pytest.mark.parametrize("num_tokens, cp_size, cp_rank, blocks", [
    (23, 1, 0, [0, 1, 2, 3, 4, 5]), (23, 2, 0, [0, 2, 4]), (23, 2, 1, [1, 3, 5]), (23, 4, 3, [3]),
    (24, 4, 1, [1, 5]), (3, 2, 1, []), (4, 2, 0, [0]),
])
def test_mla_blocks_are_those_the_rank_owns(num_tokens, cp_size, cp_rank, blocks):
    assert ShardSpec(LAYOUT, num_tokens, cp_rank, cp_size).blocks == blocks


def test_kda_head_slices_partition_the_heads():
    assert [head_slice(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="cannot be split over cp_size=3"):
        head_slice(4, 0, 3)
    with pytest.raises(ValueError, match="cp_rank"):
        head_slice(4, 2, 2)


def test_segments_in_stream_order_with_shard_sizes():
    segments = shard_segments(ShardSpec(LAYOUT, 23, 1, 2))
    assert [(s.kind, s.layer_id) for s in segments] == [
        (PayloadKind.AUX, -1), *[(PayloadKind.KDA_STATE, i) for i in (0, 1, 2, 4)],
        *[(PayloadKind.CONV_STATE, i) for i in (0, 1, 2, 4)], (PayloadKind.KV_BLOCKS, 3), (PayloadKind.KV_BLOCKS, 5)]
    by_kind = {s.kind: s for s in segments}
    assert by_kind[PayloadKind.AUX].nbytes == AUX_WORDS * 8
    assert (by_kind[PayloadKind.KDA_STATE].unit_bytes, by_kind[PayloadKind.KDA_STATE].num_units) == (2 * 32 * 32 * 4, 1)
    assert (by_kind[PayloadKind.CONV_STATE].unit_bytes, by_kind[PayloadKind.CONV_STATE].num_units) == (2 * 32 * 3 * 4, 3)
    assert (by_kind[PayloadKind.KV_BLOCKS].unit_bytes, by_kind[PayloadKind.KV_BLOCKS].num_units) == (4 * 40 * 4, 3)


def test_messages_pack_whole_units_of_one_kind():
    segments = shard_segments(ShardSpec(LAYOUT, 23, 1, 2))  # 0 AUX, 1-4 states, 5-8 conv, 9-10 blocks
    messages = plan_messages(segments, message_bytes=5000)
    assert [m.index for m in messages] == list(range(len(messages)))
    assert all({segments[s].kind for s, _, _ in m.pieces} == {m.kind} for m in messages)
    conv = [m.pieces for m in messages if m.kind is PayloadKind.CONV_STATE]  # units of 768 B, 3 a layer
    assert conv == [((5, 0, 2304), (6, 0, 2304)), ((7, 0, 2304), (8, 0, 2304))]
    kv = [m.pieces for m in messages if m.kind is PayloadKind.KV_BLOCKS]  # 3 blocks of 640 B a layer
    assert kv == [((9, 0, 1920), (10, 0, 1920))]
    state = [m.pieces for m in messages if m.kind is PayloadKind.KDA_STATE]  # 8 KiB units: byte pieces
    assert state == [p for i in (1, 2, 3, 4) for p in (((i, 0, 5000),), ((i, 5000, 3192),))]
    units = [m.pieces for m in plan_messages(segments, 6000) if m.kind is PayloadKind.CONV_STATE]  # a layer split
    assert units == [((5, 0, 2304), (6, 0, 2304), (7, 0, 768)), ((7, 768, 1536), (8, 0, 2304))]
    whole = plan_messages(segments, 1 << 20)  # one message per kind
    assert [(m.kind, len(m.pieces)) for m in whole] == [
        (PayloadKind.AUX, 1), (PayloadKind.KDA_STATE, 4), (PayloadKind.CONV_STATE, 4), (PayloadKind.KV_BLOCKS, 2)]
    with pytest.raises(ValueError):
        plan_messages(segments, 0)


def test_a_large_segment_travels_alone():
    """A segment of `alone_bytes` or more starts and ends its own messages (sent in place where its
    memory is one run); smaller ones of its kind pack around it."""
    segments = shard_segments(ShardSpec(LAYOUT, 23, 0, 1))  # KV segments of 3840 B
    alone = plan_messages(segments, 1 << 20, alone_bytes=3840)
    assert [m.pieces for m in alone if m.kind is PayloadKind.KV_BLOCKS] == [((9, 0, 3840),), ((10, 0, 3840),)]
    assert [len(m.pieces) for m in alone if m.kind is PayloadKind.KDA_STATE] == [1, 1, 1, 1]  # 16 KiB each
    packed = plan_messages(segments, 1 << 20, alone_bytes=3841)
    assert [m.pieces for m in packed if m.kind is PayloadKind.KV_BLOCKS] == [((9, 0, 3840), (10, 0, 3840))]
    assert plan_messages(segments, 1 << 20) == plan_messages(segments, 1 << 20, alone_bytes=ALONE_BYTES)
    assert ALONE_BYTES == 1 << 20


def test_segment_memory_coalesces_adjacent_units_and_spans_cross_runs():
    pool = torch.arange(10 * 4, dtype=torch.int32).reshape(10, 4)  # 16-byte units
    memory = SegmentMemory.of(pool, [16 * b for b in (2, 3, 4, 7, 8)], 16)
    assert memory.runs == [(32, 48), (112, 32)]
    spans = memory.spans(40, 24)  # the second half of block 4, then block 7
    assert [s.numel() for s in spans] == [8, 16]
    assert torch.equal(torch.cat(spans).view(torch.int32), torch.tensor([18, 19, 28, 29, 30, 31]))
    with pytest.raises(ValueError, match="outside"):
        SegmentMemory.of(pool, [160], 16)


@pytest.mark.parametrize("seed", range(12))
def test_indexed_copies_move_the_bytes_the_runs_hold(seed):
    """Whole units over many runs are copied by one indexed copy: the same bytes as the run by run
    copy, from and into buffers at any alignment; a range of few runs or of part of a unit goes
    run by run."""
    gen = torch.Generator().manual_seed(seed)
    unit = [8, 24, 40, 6][seed % 4]  # 6: rows of int16 only
    count = 10 if seed < 6 else 40  # the few-unit and the numpy paths
    rows = torch.randperm(64, generator=gen)[:count].tolist()
    pool = torch.randint(0, 255, (64 * unit,), dtype=torch.uint8, generator=gen)
    memory = SegmentMemory.of(pool, [r * unit for r in rows], unit)
    assert memory.unit_rows is not None and len(memory.runs) > segments_module.FEW_RUNS
    total, targets = count * unit, []
    for offset, nbytes in ((0, total), (unit, total - 2 * unit), (3, unit), (0, unit)):
        for shift in (0, 1, 2):  # a staging buffer at an odd address copies uint8 rows
            buffer = torch.zeros(nbytes + shift, dtype=torch.uint8)[shift:]
            memory.copy_out(offset, nbytes, buffer)
            assert torch.equal(buffer, torch.cat(memory.spans(offset, nbytes)))
            target = SegmentMemory.of(torch.zeros_like(pool), [r * unit for r in rows], unit)
            target.copy_in(buffer, offset, nbytes)
            targets.append(target)
            assert torch.equal(torch.cat(target.spans(offset, nbytes)), buffer)
            assert int(target.flat.count_nonzero()) == int(buffer.count_nonzero())  # nothing else written
    assert memory._rows is not None and targets[0]._rows is not None  # the indexed copies ran


def test_a_message_of_one_run_goes_in_place_and_a_packed_one_is_staged():
    """`ShardPlan.in_place` is the cache's own view for a message in one run (no copy); a packed
    message (several pools) or blocks in several runs are staged, and `gather` / `scatter` move
    exactly the bytes of the message's pieces."""
    caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, 4), 16, 2)
    for pool in caches.tensors():
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(pool.numel())))
    spec = ShardSpec(LAYOUT, 23)
    plan = ShardPlan.for_sender(spec, caches, [4, 5, 6, 7, 8, 9], 1, [1], 1 << 20)  # blocks in one run
    by_kind = {m.kind: m for m in plan.messages}
    state = plan.in_place(by_kind[PayloadKind.KDA_STATE])
    assert state is None  # 4 layers' states packed: 4 pools
    kv = plan_messages(plan.segments, 1 << 20, alone_bytes=1)  # every segment alone
    alone = [m for m in kv if m.kind is PayloadKind.KV_BLOCKS]
    view = plan.in_place(alone[0])
    assert view is not None and view.data_ptr() == caches.mla_kv[3][4].data_ptr() and view.numel() == alone[0].nbytes
    fragmented = ShardPlan.for_sender(spec, caches, [4, 5, 9, 7, 8, 6], 1, [1], 1 << 20)
    assert fragmented.in_place(alone[0]) is None
    for message in plan.messages:
        out = torch.empty(message.nbytes, dtype=torch.uint8)
        plan.gather(message, out)
        want = [torch.cat(plan.memory[s].spans(o, n)) for s, o, n in message.pieces]
        assert torch.equal(out, torch.cat(want))
        receiver = ShardPlan.for_receiver(spec, allocate_model_caches(cache_spec_for(CFG, torch.float32, 4), 16, 2),
                                          [9, 3, 12, 0, 1, 2], 0, 1 << 20)
        receiver.scatter(out, message)
        got = torch.empty_like(out)
        receiver.gather(message, got)
        assert torch.equal(got, out)


def test_aux_payload_round_trip_and_malformed():
    assert decode_aux(encode_aux(23, [7, 9])) == (23, [7, 9])
    with pytest.raises(ValueError, match="malformed AUX"):
        decode_aux(torch.zeros(AUX_WORDS, dtype=torch.int64))
    with pytest.raises(ValueError):
        encode_aux(3, [])


def test_layout_mismatch_names_every_differing_field():
    other = LAYOUT.model_copy(update={"tokens_per_block": 16, "conv_dtype": "bfloat16"})
    with pytest.raises(LayoutMismatchError) as error:
        check_layout(LAYOUT, other, "gen", "ctx worker a:1")
    text = str(error.value)
    assert "(gen != ctx worker a:1)" in text and "tokens_per_block: 4 != 16" in text
    assert "conv_dtype: 'float32' != 'bfloat16'" in text
    check_layout(LAYOUT, LAYOUT.model_copy(), "gen", "ctx")
    with pytest.raises(LayoutMismatchError, match="ctx: num_kda_heads 4 cannot be split over ctx_tp_size=3"):
        check_layout(LAYOUT, LAYOUT.model_copy(update={"ctx_tp_size": 3}), "gen", "ctx")


def test_a_ctx_world_layout_is_accepted_where_its_heads_split():
    """A gen rank takes a ctx world's layout (its mapping is not what the caches hold); a ctx rank
    checks the mapping a gen rank asks it with: the world size and its own rank, both values named."""
    world = LAYOUT.model_copy(update={"ctx_tp_size": 2})
    check_layout(LAYOUT, world, "gen", "ctx")
    check_layout(world, world.model_copy(), "ctx", "gen rank 0", mapping=True)
    rank1 = LAYOUT.model_copy(update={"ctx_tp_size": 2, "ctx_rank": 1})
    with pytest.raises(LayoutMismatchError, match=r"\(ctx != gen rank 3\): ctx_rank: 1 != 0$"):
        check_layout(rank1, world, "ctx", "gen rank 3", mapping=True)
    with pytest.raises(LayoutMismatchError, match=r"ctx_tp_size: 2 != 4"):
        check_layout(world, LAYOUT.model_copy(update={"ctx_tp_size": 4}), "ctx", "gen rank 0", mapping=True)
    with pytest.raises(LayoutMismatchError, match="ctx: ctx_rank 2 outside ctx_tp_size=2"):
        check_layout(LAYOUT, LAYOUT.model_copy(update={"ctx_tp_size": 2, "ctx_rank": 2}), "gen", "ctx")
    with pytest.raises(LayoutMismatchError, match="gen rank 1: num_kda_heads 4 cannot be split over cp_size=8"):
        check_mapping(world, "gen rank 1", 1, 8)
    with pytest.raises(LayoutMismatchError, match="gen rank 5: cp_rank 5 outside cp_size=4"):
        check_mapping(world, "gen rank 5", 5, 4)
    check_mapping(world, "gen rank 3", 3, 4)


def test_wire_tags_carry_base_and_index():
    assert wire_tag(3, 5) == (3 << 20) | 5
    with pytest.raises(ValueError):
        wire_tag(1 << 44, 0)
    with pytest.raises(ValueError):
        wire_tag(0, 1 << 20)


@pytest.mark.parametrize("seed", range(20))
def test_small_segments_map_like_the_numpy_path(seed, monkeypatch):
    """Segments of few units (states, AUX) take a plain-Python path: same runs, starts and spans
    as the numpy path for any offsets, and the same refusal of an out-of-range unit."""
    gen = torch.Generator().manual_seed(seed)
    unit = int(torch.randint(1, 9, (), generator=gen))
    parent = torch.arange(256, dtype=torch.uint8)
    count = int(torch.randint(1, SMALL_SEGMENT_UNITS + 1, (), generator=gen))
    slots = torch.randperm(256 // unit, generator=gen)[:count].tolist()
    offsets = [s * unit for s in (sorted(slots) if seed % 2 else slots)]  # odd seeds: adjacent runs
    bad = [*offsets[:-1], 256 - unit + 1]
    few = SegmentMemory.of(parent, offsets, unit)
    with pytest.raises(ValueError, match="outside"):
        SegmentMemory.of(parent, bad, unit)
    monkeypatch.setattr(segments_module, "SMALL_SEGMENT_UNITS", -1)  # every segment through numpy
    many = SegmentMemory.of(parent, offsets, unit)
    with pytest.raises(ValueError, match="outside"):
        SegmentMemory.of(parent, bad, unit)
    assert few.runs == many.runs and few.starts == many.starts
    total = count * unit
    for start, size in ((0, total), (total // 3, total - total // 3), (total - 1, 1)):
        assert [s.tolist() for s in few.spans(start, size)] == [s.tolist() for s in many.spans(start, size)]


def test_every_mla_layer_maps_the_blocks_once_and_reads_its_own_pool():
    """The block runs are computed once per request and shared by the MLA layers (same pool
    shape); each layer's spans still read that layer's pool, byte-exact, fragmented blocks too."""
    from helixserve.cache_layout import cache_spec_for
    from helixserve.kvcache.pools import allocate_model_caches
    from helixserve.transceiver.layout import ShardPlan

    caches = allocate_model_caches(cache_spec_for(CFG, torch.float32, 4), 16, 2)
    for layer, pool in caches.mla_kv.items():
        pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(pool.shape) + 1000 * layer)
    blocks = [9, 10, 2, 3, 4, 15]  # runs 9-10, 2-4, 15
    plan = ShardPlan.for_sender(ShardSpec(LAYOUT, 23), caches, blocks, 0, [1], 1 << 20)
    kv = [(seg, mem) for seg, mem in zip(plan.segments, plan.memory) if seg.kind is PayloadKind.KV_BLOCKS]
    assert [seg.layer_id for seg, _ in kv] == [3, 5]
    assert kv[0][1].runs is kv[1][1].runs and len(kv[0][1].runs) == 3
    for seg, mem in kv:
        got = torch.cat(mem.spans(0, seg.nbytes)).view(torch.float32)
        assert torch.equal(got, caches.mla_kv[seg.layer_id][blocks].reshape(-1))
    caches.mla_kv[5] = caches.mla_kv[5].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, strided
    with pytest.raises(ValueError, match="must be contiguous"):
        ShardPlan.for_sender(ShardSpec(LAYOUT, 23), caches, blocks, 0, [1], 1 << 20).prepare()


def test_one_kv_layout_builder():
    """Every cache layout a worker announces comes from ``layout_for``: no other module of
    helixserve constructs a KVLayout."""
    root = Path(__file__).resolve().parents[2] / "helixserve"
    builders = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                      if "KVLayout(" in p.read_text() and not p.is_relative_to(root / "protocol"))
    assert builders == ["transceiver/layout.py"], builders
