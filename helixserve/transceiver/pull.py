"""A pulled shard: the receiver copies its bytes out of the ctx's opened pools (see `cuda_ipc`).

Both sides' memory maps come from the same layout code (`layout.ShardPlan`): the ctx's, built
here over its opened pools with its block table and slot from `PullShard`, and the receiver's
own. Each segment's bytes are in stream order on both sides, as runs that need not line up; the
piece table cuts both at every run boundary of either, so every piece is contiguous on both
sides, and one batched kernel copies them all (`kernels.copy.batched.batched_copy`) on the
receiver's copy stream, which first waits for its compute stream (the destination blocks may
have been read by the previous owner's last step). An event tells the engine thread when it is
done; `wait` bounds how long a receiver that gives up waits for a copy already launched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from helixserve.kernels.copy.batched import batched_copy
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.layout import SegmentMemory, ShardPlan

WAIT_TICK_S = 0.0002  # internal: the bounded wait for a launched copy polls its event this often


class _Tensors:
    """Distinct flat tensors, each with an index."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[tuple[int, int], int] = {}

    def index(self, flat: torch.Tensor) -> int:
        key = (flat.data_ptr(), flat.numel())
        if key not in self._index:
            self._index[key] = len(self.tensors)
            self.tensors.append(flat)
        return self._index[key]


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
    one block table, pools of one shape) share their cut: it is computed once per request."""
    srcs, dsts = _Tensors(), _Tensors()
    cuts: dict[tuple[int, int, int], np.ndarray] = {}
    rows = []
    for seg, total in zip(segments, sizes):
        s, d = src[seg], dst[seg]
        if total == 0 or not s.runs:
            continue
        key = (id(s.runs), id(d.runs), total)
        if key not in cuts:
            cuts[key] = _pieces(s, d, total)
        pieces = cuts[key]
        piece = np.empty((pieces.shape[0], 5), dtype=np.int64)
        piece[:, 0] = srcs.index(s.flat)
        piece[:, [1, 3, 4]] = pieces
        piece[:, 2] = dsts.index(d.flat)
        rows.append(piece)
    table = np.concatenate(rows) if rows else np.zeros((0, 5), dtype=np.int64)
    return srcs.tensors, dsts.tensors, table


class Pull:
    """One launched copy of a shard (engine thread)."""

    def __init__(self, src_plan: ShardPlan, dst_plan: ShardPlan, stream: torch.cuda.Stream) -> None:
        segments = [i for i, seg in enumerate(dst_plan.segments) if seg.kind is not PayloadKind.AUX]
        sizes = [dst_plan.segments[i].nbytes for i in segments]
        srcs, dsts, table = piece_table(src_plan.memory, dst_plan.memory, segments, sizes)
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            batched_copy(srcs, dsts, table)
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
