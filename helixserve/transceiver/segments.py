"""The types a shard's stream is made of, below :mod:`.layout` (the shard mapping and the message
plan) and :mod:`.memory_map` (each side's memory map), which both build on them: a receiver's
share of a request (:class:`ShardSpec`), a segment of equal units (:class:`Segment`), a message
of segments' bytes (:class:`Message`) and where a segment's bytes live on one side
(:class:`SegmentMemory`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from helixserve.cache_layout import head_slice
from helixserve.kvcache.helix import local_logical_blocks, num_logical_blocks
from helixserve.protocol.disagg import KVLayout
from helixserve.transceiver import fan
from helixserve.transceiver.base import PayloadKind
from helixserve.transceiver.fan import Source

SMALL_SEGMENT_UNITS = 16  # segments of at most this many units are mapped without numpy
FEW_RUNS = 4  # bytes over at most this many runs are copied run by run, not by an indexed copy


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """One receiver's share of one request from one ctx rank.

    The gen rank ``(cp_rank, cp_size)`` needs the MLA blocks ``b % cp_size == cp_rank`` and the KDA
    heads ``[cp_rank*H/cp_size, ..)``; ctx rank `ctx_rank` of the layout's ctx world
    (``layout.ctx_tp_size`` ranks, :mod:`.fan`) holds the blocks ``b % ctx_tp_size == ctx_rank`` and
    its own head slice. The spec is what both hold: at ``ctx_tp_size`` 1 the whole shard.
    """

    layout: KVLayout
    num_tokens: int
    cp_rank: int = 0
    cp_size: int = 1
    ctx_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"a shard needs >= 1 prompt token, got {self.num_tokens}")
        head_slice(self.layout.num_kda_heads, self.cp_rank, self.cp_size)  # validates
        if not 0 <= self.ctx_rank < self.layout.ctx_tp_size:
            raise ValueError(f"ctx_rank {self.ctx_rank} outside ctx_tp_size={self.layout.ctx_tp_size}")

    @property
    def source(self) -> Source:
        return fan.source(num_logical_blocks(self.num_tokens, self.layout.tokens_per_block), self.layout.num_kda_heads,
                          self.ctx_rank, self.layout.ctx_tp_size, self.cp_rank, self.cp_size)

    @property
    def blocks(self) -> list[int]:
        """Global logical MLA blocks of this shard, ascending."""
        if self.layout.ctx_tp_size == 1:
            return local_logical_blocks(self.num_tokens, self.layout.tokens_per_block, self.cp_rank, self.cp_size)
        return list(self.source.blocks)

    @property
    def takes_draft(self) -> bool:
        """Whether the shard holds the drafter's prompt cache (``layout.draft``): the CP group's
        leader takes it, from a ctx of one rank (the only kind that runs a drafter)."""
        return self.layout.draft is not None and self.cp_rank == 0 and self.layout.ctx_tp_size == 1

    @property
    def block_step(self) -> int:
        """Global blocks between two of this shard's (its local indices step by this / side size)."""
        return math.lcm(self.cp_size, self.layout.ctx_tp_size)

    @property
    def heads(self) -> tuple[int, int]:
        """Global KDA heads of this shard, ``[lo, hi)`` (``(0, 0)``: none from this ctx rank)."""
        if self.layout.ctx_tp_size == 1:
            return head_slice(self.layout.num_kda_heads, self.cp_rank, self.cp_size)
        return self.source.heads

    @property
    def num_heads(self) -> int:
        """KDA heads of this shard (the gen rank's ``num_local_heads`` at ``ctx_tp_size`` 1)."""
        lo, hi = self.heads
        return hi - lo

    @property
    def num_local_heads(self) -> int:
        """The gen rank's KDA heads (its pools')."""
        return self.layout.num_kda_heads // self.cp_size

    @property
    def num_ctx_heads(self) -> int:
        """The ctx rank's KDA heads (its pools')."""
        return self.layout.num_kda_heads // self.layout.ctx_tp_size

    @property
    def ctx_head0(self) -> int:
        """The shard's first head in the ctx rank's pools."""
        return self.heads[0] - self.ctx_rank * self.num_ctx_heads if self.num_heads else 0

    @property
    def gen_head0(self) -> int:
        """The shard's first head in the gen rank's pools."""
        return self.heads[0] - self.cp_rank * self.num_local_heads if self.num_heads else 0


@dataclass(frozen=True, slots=True)
class Segment:
    kind: PayloadKind
    layer_id: int  # -1 for AUX
    unit_bytes: int
    num_units: int

    @property
    def nbytes(self) -> int:
        return self.unit_bytes * self.num_units


@dataclass(frozen=True, slots=True)
class Message:
    """Pieces of consecutive segments of one payload kind, back to back; travels with tag index
    `index`. A piece ``(segment, offset, nbytes)`` is bytes ``[offset, offset + nbytes)`` of
    segment `segment`; `nbytes` is their total."""

    index: int
    kind: PayloadKind
    pieces: tuple[tuple[int, int, int], ...]
    nbytes: int


@dataclass(slots=True)
class SegmentMemory:
    """Where one segment's bytes live on one side: coalesced runs of a parent tensor's bytes.

    When every unit is a row of the parent (``unit_rows``: its row in ``flat`` viewed as rows of
    ``unit_bytes``), a copy of whole units over many runs is one indexed copy (:meth:`copy_out`,
    :meth:`copy_in`), not a copy per run."""

    flat: torch.Tensor  # uint8 view of the whole parent tensor
    runs: list[tuple[int, int]]  # (byte offset in flat, nbytes), in stream order
    starts: list[int] = field(default_factory=list)  # stream offset of each run
    unit_bytes: int = 0
    unit_rows: np.ndarray | None = field(default=None, compare=False, repr=False)  # int64 [num_units]; None: not rows
    _rows: torch.Tensor | None = field(default=None, compare=False, repr=False)  # unit_rows on flat's device, on first use

    @classmethod
    def of(cls, parent: torch.Tensor, unit_offsets: Sequence[int], unit_bytes: int) -> SegmentMemory:
        """Units at byte `unit_offsets` of `parent` (in stream order), adjacent ones coalesced."""
        if not parent.is_contiguous():
            raise ValueError(f"cache tensor {tuple(parent.shape)} must be contiguous")
        flat = parent.reshape(-1).view(torch.uint8)
        if len(unit_offsets) <= SMALL_SEGMENT_UNITS:  # AUX, KDA and conv states: plain Python is faster
            return cls._of_few(flat, [int(o) for o in unit_offsets], unit_bytes)
        offsets = np.asarray(unit_offsets, dtype=np.int64)
        if offsets.size == 0:
            return cls(flat, [], [])
        bad = offsets[(offsets < 0) | (offsets > flat.numel() - unit_bytes)]
        if bad.size:
            raise ValueError(f"unit at byte {int(bad[0])} (+{unit_bytes}) outside a {flat.numel()}-byte tensor")
        first = np.concatenate([[0], np.flatnonzero(np.diff(offsets) != unit_bytes) + 1])
        sizes = np.diff(np.concatenate([first, [offsets.size]])) * unit_bytes
        runs = list(zip(offsets[first].tolist(), sizes.tolist()))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        is_rows = flat.numel() % unit_bytes == 0 and not (offsets % unit_bytes).any()
        return cls(flat, runs, starts, unit_bytes, offsets // unit_bytes if is_rows else None)

    @classmethod
    def _of_few(cls, flat: torch.Tensor, offsets: list[int], unit_bytes: int) -> SegmentMemory:
        runs: list[list[int]] = []
        for offset in offsets:
            if not 0 <= offset <= flat.numel() - unit_bytes:
                raise ValueError(f"unit at byte {offset} (+{unit_bytes}) outside a {flat.numel()}-byte tensor")
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1][1] += unit_bytes
            else:
                runs.append([offset, unit_bytes])
        starts = [0]
        for _, size in runs[:-1]:
            starts.append(starts[-1] + size)
        is_rows = len(runs) > FEW_RUNS and flat.numel() % unit_bytes == 0 and all(o % unit_bytes == 0 for o in offsets)
        rows = np.asarray(offsets, dtype=np.int64) // unit_bytes if is_rows else None
        return cls(flat, [(o, n) for o, n in runs], starts if runs else [], unit_bytes, rows)

    def spans(self, offset: int, nbytes: int) -> list[torch.Tensor]:
        """Views of stream bytes ``[offset, offset + nbytes)``, in order."""
        out, end = [], offset + nbytes
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while offset < end:
            run_offset, run_bytes = self.runs[i]
            skip = offset - self.starts[i]
            take = min(run_bytes - skip, end - offset)
            out.append(self.flat[run_offset + skip : run_offset + skip + take])
            offset += take
            i += 1
        return out

    def num_runs(self, offset: int, nbytes: int) -> int:
        """How many runs stream bytes ``[offset, offset + nbytes)`` touch."""
        return bisect.bisect_right(self.starts, offset + nbytes - 1) - bisect.bisect_right(self.starts, offset) + 1

    def copy_out(self, offset: int, nbytes: int, out: torch.Tensor) -> None:
        """Copy stream bytes ``[offset, offset + nbytes)`` into `out` (uint8, `nbytes`)."""
        rows = self._unit_rows(offset, nbytes)
        if rows is None:
            gather(self.spans(offset, nbytes), out)
        else:
            torch.index_select(self.flat.view(-1, self.unit_bytes), 0, rows, out=out.view(-1, self.unit_bytes))

    def copy_in(self, src: torch.Tensor, offset: int, nbytes: int) -> None:
        """Copy `src` (uint8, `nbytes`) into stream bytes ``[offset, offset + nbytes)``."""
        rows = self._unit_rows(offset, nbytes)
        if rows is None:
            scatter(src, self.spans(offset, nbytes))
        else:
            width = _widest(self.flat, src, self.unit_bytes)
            row = self.unit_bytes // width.itemsize
            self.flat.view(width).view(-1, row).index_copy_(0, rows, src.view(width).view(-1, row))

    def _unit_rows(self, offset: int, nbytes: int) -> torch.Tensor | None:
        """The rows of the units of ``[offset, offset + nbytes)``, or None: copy run by run (few
        runs, units that are not rows, or bytes that are not whole units)."""
        unit = self.unit_bytes
        if self.unit_rows is None or offset % unit or nbytes % unit or self.num_runs(offset, nbytes) <= FEW_RUNS:
            return None
        if self._rows is None:
            self._rows = torch.from_numpy(self.unit_rows).to(self.flat.device)
        return self._rows[offset // unit : (offset + nbytes) // unit]


def _widest(a: torch.Tensor, b: torch.Tensor, row_bytes: int) -> torch.dtype:
    """The widest integer type both uint8 tensors can be viewed as, rows of `row_bytes` kept whole
    (an indexed copy of uint8 rows runs element by element: several times slower)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and all(t.storage_offset() % size == 0 and t.data_ptr() % size == 0 for t in (a, b)):
            return dtype
    return torch.uint8


def gather(spans: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy `spans` back to back into `out` (uint8, exactly their total size)."""
    if len(spans) == 1:
        out.copy_(spans[0])
    else:
        torch.cat(list(spans), out=out)


def scatter(src: torch.Tensor, spans: Sequence[torch.Tensor]) -> None:
    """Copy `src` (uint8) back into `spans`, in order."""
    offset = 0
    for span in spans:
        span.copy_(src[offset : offset + span.numel()])
        offset += span.numel()
