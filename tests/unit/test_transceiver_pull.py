"""The pulled-shard pieces that run without a GPU: the piece table between two memory maps, the
batched copy's reference and checks, and the ctx's DescribePools answers where it cannot export.
(The pull itself needs CUDA IPC: tests/integration/test_transceiver_cuda.py, GPU-marked.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.kernels.copy.batched import CopyTableError, batched_copy, check_table
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.models.presets import get_preset
from helixserve.protocol import transfer_pb2 as pb
from helixserve.transceiver.cuda_ipc import PoolDirectory, PoolExport, host_id
from helixserve.transceiver.layout import SegmentMemory, ShardPlan, ShardSpec, gather, layout_for
from helixserve.transceiver.pull import piece_table

PRESET = "kimi-k3-tiny"


def _memory(rng: np.random.Generator, unit: int, num_units: int, capacity: int) -> SegmentMemory:
    parent = torch.zeros(capacity * unit, dtype=torch.uint8)
    offsets = rng.permutation(capacity)[:num_units] * unit
    offsets[: num_units // 2].sort()  # some adjacent units, coalesced into runs
    return SegmentMemory.of(parent, offsets.tolist(), unit)


@pytest.mark.parametrize("seed", range(6))
def test_piece_table_copies_every_stream_byte_to_its_place(seed):
    """Runs that do not line up on the two sides (different fragmentation, a unit split at
    different places) still copy stream byte i of each segment to stream byte i."""
    rng = np.random.default_rng(seed)
    unit, num_units = int(rng.integers(1, 9)) * 8, int(rng.integers(1, 40))
    src = [_memory(rng, unit, num_units, 64), _memory(rng, 24, 3, 5)]
    dst = [_memory(rng, unit, num_units, 80), _memory(rng, 24, 3, 7)]
    for m in src:
        m.flat.copy_(torch.randint(0, 256, m.flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    sizes = [unit * num_units, 72]
    srcs, dsts, table = piece_table(src, dst, [0, 1], sizes)
    batched_copy(srcs, dsts, table)
    for s, d, n in zip(src, dst, sizes):
        want, got = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        gather(s.spans(0, n), want)
        gather(d.spans(0, n), got)
        assert torch.equal(got, want)
    assert table[:, 4].sum() == sum(sizes)
    # every piece is one run on both sides: no more pieces than the two sides' run boundaries
    assert len(table) <= sum(len(s.runs) + len(d.runs) for s, d in zip(src, dst))


def test_piece_table_of_a_real_shard_matches_the_tagged_stream_bytes():
    """ctx plan (full heads, fragmented blocks) -> a cp 2 rank's plan: the piece table moves the
    same bytes a tagged stream would (its messages gathered on one side, scattered on the other)."""
    cfg = get_preset(PRESET)
    layout = layout_for(cfg, torch.float32, 16, PRESET)
    spec = ShardSpec(layout, 16 * 5 + 3, cp_rank=1, cp_size=2)
    ctx = allocate_model_caches(cache_spec_for(cfg, torch.float32, 16), 12, 3)
    for pools in (ctx.mla_kv, ctx.kda_state, ctx.conv_state):
        for pool in pools.values():
            pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(pool.numel())))
    full = cache_spec_for(cfg, torch.float32, 16)
    gen = allocate_model_caches(dataclasses.replace(full, kda_num_heads=full.kda_num_heads // 2), 12, 3)
    theirs = ShardPlan.for_sender(spec, ctx, [9, 2, 3, 7, 0, 11], 2, [5], 1 << 20)
    ours = ShardPlan.for_receiver(spec, gen, [4, 1, 8], 1, 1 << 20)
    segments = [i for i, s in enumerate(ours.segments) if s.kind.name != "AUX"]
    srcs, dsts, table = piece_table(theirs.memory, ours.memory, segments, [ours.segments[i].nbytes for i in segments])
    batched_copy(srcs, dsts, table)
    for message in ours.messages:
        if message.kind.name == "AUX":
            continue
        want, got = torch.empty(message.nbytes, dtype=torch.uint8), torch.empty(message.nbytes, dtype=torch.uint8)
        gather(theirs.spans(message), want)
        gather(ours.spans(message), got)
        assert torch.equal(got, want), message


def test_batched_copy_refuses_pieces_outside_its_tensors():
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    for row in ([0, 60, 0, 0, 8], [0, 0, 0, 30, 4], [1, 0, 0, 0, 1], [0, 0, 0, -1, 1], [0, 0, 0, 0, -2]):
        with pytest.raises(CopyTableError, match="outside"):
            batched_copy([a], [b], np.asarray([row]))
    with pytest.raises(CopyTableError, match="uint8"):
        check_table([a.view(torch.int32)], [b], np.zeros((0, 5)))
    batched_copy([a], [b], np.zeros((0, 5)))  # nothing to copy is fine


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
    from helixserve.protocol.disagg import TransceiverEndpoint
    from helixserve.transceiver import receiver as receiver_module
    from helixserve.transceiver.config import TransceiverConfig
    from helixserve.transceiver.receiver import KVReceiver

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


@pytest.mark.parametrize("block_ids,slot", [([0, 1, 99], 0), ([0, -1, 2], 0), ([0, 1], 0), ([0, 1, 2], 7),
                                            ([0, 1, 2], -2)])
def test_a_hostile_pull_shard_maps_nothing_outside_the_pools(block_ids, slot):
    """The receiver maps a ctx's PullShard (block table, slot) onto the pools it opened with the
    layout code; a block or slot outside them, or a table too short for the prompt, raises
    before any copy is built (Inbound._start_pull then fails the request and cancels)."""
    cfg = get_preset(PRESET)
    layout = layout_for(cfg, torch.float32, 16, PRESET)
    ctx = allocate_model_caches(cache_spec_for(cfg, torch.float32, 16), 12, 3)
    spec = ShardSpec(layout, 16 * 2 + 1)  # 3 blocks
    with pytest.raises(ValueError, match="outside|needs logical block"):
        ShardPlan.for_sender(spec, ctx, block_ids, slot, [5], 1 << 20).memory  # noqa: B018
