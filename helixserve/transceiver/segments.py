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
    """Where one segment's bytes live on one side: coalesced runs of a parent tensor's bytes."""

    flat: torch.Tensor  # uint8 view of the whole parent tensor
    runs: list[tuple[int, int]]  # (byte offset in flat, nbytes), in stream order
    starts: list[int] = field(default_factory=list)  # stream offset of each run

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
        return cls(flat, runs, starts)

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
        return cls(flat, [(o, n) for o, n in runs], starts if runs else [])

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
