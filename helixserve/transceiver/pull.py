"""A pulled shard: the receiver copies its bytes out of the ctx's opened pools (see `cuda_ipc`).

Both sides' memory maps come from the same layout code (`layout.ShardPlan`): the ctx's, built
here over its opened pools with its block table and slot from `PullShard`, and the receiver's
own. Each segment's bytes are in stream order on both sides, as runs that need not line up; the
piece table cuts both at every run boundary of either, so every piece is contiguous on both
sides, and one batched kernel copies them all (`kernels.copy.batched.batched_copy_trusted`: the
table is built from bounds-checked maps, see `shard_table`, so it is not checked again) on the
receiver's copy stream, which first waits for its compute stream (the destination blocks may
have been read by the previous owner's last step). An event tells the engine thread when it is
done; `wait` bounds how long a receiver that gives up waits for a copy already launched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from helixserve.kernels.copy.batched import batched_copy, batched_copy_trusted
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.layout import SegmentMemory, ShardPlan

WAIT_TICK_S = 0.0002  # internal: the bounded wait for a launched copy polls its event this often


def _distinct(flats: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """(the distinct tensors of `flats`, first seen first; each flat's index among them). Two
    flats are one tensor when they start at one address with one size."""
    keys = [(flat.data_ptr(), flat.numel()) for flat in flats]
    if len(set(keys)) == len(keys):  # a pulled shard: every segment in its own layer's pool
        return list(flats), list(range(len(keys)))
    first: dict[tuple[int, int], torch.Tensor] = {}
    for key, flat in zip(keys, flats):
        first.setdefault(key, flat)
    index = {key: i for i, key in enumerate(first)}
    return list(first.values()), [index[key] for key in keys]


def _pieces(s: SegmentMemory, d: SegmentMemory, total: int) -> np.ndarray:
    """``[n, 3]`` (source offset, destination offset, nbytes): the segment's stream bytes cut at
    every run boundary of either side."""
    if len(s.runs) == len(d.runs) and all(a[1] == b[1] for a, b in zip(s.runs, d.runs)):
        return np.asarray([(a[0], b[0], a[1]) for a, b in zip(s.runs, d.runs)], dtype=np.int64)  # runs line up
    s_starts, d_starts = np.asarray(s.starts, dtype=np.int64), np.asarray(d.starts, dtype=np.int64)
    s_offsets = np.asarray([offset for offset, _ in s.runs], dtype=np.int64)
    d_offsets = np.asarray([offset for offset, _ in d.runs], dtype=np.int64)
    cuts = np.union1d(s_starts, d_starts)
    si = np.searchsorted(s_starts, cuts, side="right") - 1
    di = np.searchsorted(d_starts, cuts, side="right") - 1
    return np.stack([s_offsets[si] + cuts - s_starts[si], d_offsets[di] + cuts - d_starts[di],
                     np.diff(np.append(cuts, total))], axis=1)


def piece_table(src: Sequence[SegmentMemory], dst: Sequence[SegmentMemory], segments: Sequence[int],
                sizes: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], np.ndarray]:
    """(sources, destinations, table) copying segments `segments` (each of `sizes[i]` bytes).

    Segments whose run lists are the same objects on both sides (every MLA layer of a request:
    one block table; every KDA layer: one slot and head slice; see `memory_map`) share their
    cut: it is computed once per request, and the table is those cuts stacked in one pass."""
    live = [(src[seg], dst[seg], total) for seg, total in zip(segments, sizes) if total and src[seg].runs]
    if not live:
        return [], [], np.zeros((0, 5), dtype=np.int64)
    cuts: dict[tuple[int, int, int], np.ndarray] = {}
    parts = []
    for s, d, total in live:
        key = (id(s.runs), id(d.runs), total)
        pieces = cuts.get(key)
        if pieces is None:
            pieces = cuts[key] = _pieces(s, d, total)
        parts.append(pieces)
    srcs, src_ids = _distinct([s.flat for s, _, _ in live])
    dsts, dst_ids = _distinct([d.flat for _, d, _ in live])
    counts = [len(pieces) for pieces in parts]
    body = np.concatenate(parts) if len(parts) > 1 else parts[0]
    table = np.empty((body.shape[0], 5), dtype=np.int64)
    table[:, 0] = np.repeat(np.asarray(src_ids, dtype=np.int64), counts)
    table[:, 1] = body[:, 0]
    table[:, 2] = np.repeat(np.asarray(dst_ids, dtype=np.int64), counts)
    table[:, 3] = body[:, 1]
    table[:, 4] = body[:, 2]
    return srcs, dsts, table


def shard_table(src_plan: ShardPlan, dst_plan: ShardPlan) -> tuple[list[torch.Tensor], list[torch.Tensor], np.ndarray]:
    """The piece table of a pulled shard (every segment but AUX, which travels in the reply).

    Both plans must be of one stream (the same segments): then every piece lies inside a run of
    each side's memory map, and every run inside its pool (the maps are bounds-checked where they
    are built), so the table can be copied without `check_table` (`batched_copy_trusted`)."""
    if src_plan.segments != dst_plan.segments:
        raise ValueError("the two plans of a pull cut different streams")
    segments, sizes = [], []
    for i, seg in enumerate(dst_plan.segments):
        if seg.kind is not PayloadKind.AUX:
            segments.append(i)
            sizes.append(seg.unit_bytes * seg.num_units)
    return piece_table(src_plan.memory, dst_plan.memory, segments, sizes)


class Pull:
    """One launched copy of a shard (engine thread)."""

    def __init__(self, src_plan: ShardPlan, dst_plan: ShardPlan, stream: torch.cuda.Stream) -> None:
        srcs, dsts, table = shard_table(src_plan, dst_plan)
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            batched_copy_trusted(srcs, dsts, table)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def is_done(self) -> bool:
        return self.event.query()

    def wait(self, timeout_s: float) -> bool:
        """Wait (bounded) for the copy to end; False if it did not within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while not self.event.query():
            if time.monotonic() >= end:
                return False
            time.sleep(WAIT_TICK_S)
        return True


def warm_up_copy(device: torch.device, stream: torch.cuda.Stream) -> None:
    """One tiny pull-shaped copy on `device` (compiles the batched copy kernel; synchronizes)."""
    src = torch.arange(4096, dtype=torch.int64, device=device).view(torch.uint8)
    dst = torch.zeros_like(src)
    with torch.cuda.stream(stream):
        batched_copy([src], [dst], np.asarray([[0, 0, 0, 0, src.numel()]], dtype=np.int64))
    stream.synchronize()
    if not torch.equal(src, dst):
        raise RuntimeError(f"the batched copy kernel is wrong on {device}")
