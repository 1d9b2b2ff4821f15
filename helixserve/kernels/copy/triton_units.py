"""Triton path of :func:`helixserve.kernels.copy.units.unit_copy` (see there).

Two int64 tables go to the device. The **segment table**: each group's segment rows (both
tensors' word offsets from the two anchors, ``srcs[0]`` and ``dsts[0]``). The **request table**:
a request row (how many programs of work: one per (segment, unit, chunk)), a header row per
group (first program, segments, units, chunks per unit, unit words, chunk words, where its
segment rows start in the segment table and its unit rows in this one), then each group's unit
rows (word offsets in the tensors). One launch covers every group: program ``p`` of the grid
takes the work items ``p, p + grid, ...`` below the request row's count; for each it finds the
group by the headers' first programs, then its (segment, unit, chunk), adds the offsets and
copies that chunk. A grid of one program per item (what :func:`unit_copy` launches) runs each
once; a fixed grid (the CUDA graphs of `unit_graphs`) loops. :func:`unit_copy` packs both tables
into one upload; a caller that copies between the same tensors again and again (the pull: one
ctx's pools into ours) keeps a :class:`SegmentTable` on the device and sends only the request
table (:func:`copy_prepared`), through a captured graph where it can.

Addresses are offsets from the anchors (kernel arguments, which Triton knows to be 16-byte
aligned) and are hinted to be multiples of the vector, so the copy uses 16-byte loads and stores
when every offset and size is a multiple of 16 bytes (a pointer loaded from a table would get
8-byte ones: Triton cannot know its alignment). Otherwise it copies in the widest word (8, 4, 2
or 1 bytes) that every address and size allows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import triton
import triton.language as tl

from helixserve.host_copy import to_device

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from helixserve.kernels.copy.unit_group import UnitGroup

# builds the CUDA graphs of a table's copy: unit_graphs.UnitGraphs(rows, src, dst, num_groups), passed
# in by the caller (that module launches through this one)
GraphsFactory = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Any]

CHUNK_BYTES = 64 << 10  # a unit is cut into chunks of about this size, one program each
BLOCK_WORDS = 1024  # words per loop iteration of a program
NUM_WARPS = 4
HEADER = 8  # int64 columns of a group's header row
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _unit_copy_kernel(seg_ptr, table_ptr, src_anchor, dst_anchor, NUM_GROUPS: tl.constexpr, HEADER: tl.constexpr,
                      VEC: tl.constexpr, BLOCK: tl.constexpr):
    total = tl.load(table_ptr)  # the request row: how many (segment, unit, chunk) programs of work
    for pid in range(tl.program_id(0).to(tl.int64), total, tl.num_programs(0).to(tl.int64)):
        group = pid * 0
        for g in tl.static_range(1, NUM_GROUPS):
            group += (pid >= tl.load(table_ptr + (g + 1) * HEADER)).to(tl.int64)
        head = table_ptr + (group + 1) * HEADER
        local = pid - tl.load(head)
        num_units = tl.load(head + 2)
        chunks = tl.load(head + 3)
        unit_words = tl.load(head + 4)
        chunk_words = tl.load(head + 5)
        chunk = local % chunks
        rest = local // chunks
        segment = seg_ptr + tl.load(head + 6) + (rest // num_units) * 2
        unit = table_ptr + tl.load(head + 7) + (rest % num_units) * 2
        first = chunk * chunk_words
        src = tl.load(segment) + tl.load(unit) + first
        dst = tl.load(segment + 1) + tl.load(unit + 1) + first
        n = tl.minimum(chunk_words, unit_words - first)
        src = tl.multiple_of(src, VEC)
        dst = tl.multiple_of(dst, VEC)
        n = tl.multiple_of(n, VEC)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst_anchor + dst + offs, tl.load(src_anchor + src + offs, mask=mask), mask=mask)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def anchored_bases(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, int]:
    """(every source's byte offset from ``srcs[0]``, every destination's from ``dsts[0]``, the
    OR of those offsets and both anchors' addresses: what limits the word size)."""
    src_base = np.asarray([t.data_ptr() for t in srcs], dtype=np.int64)
    dst_base = np.asarray([t.data_ptr() for t in dsts], dtype=np.int64)
    bits = int(np.bitwise_or.reduce(np.concatenate([src_base, dst_base])))
    return src_base - src_base[0], dst_base - dst_base[0], bits


def _words(bits: int, groups: Sequence[UnitGroup]) -> tuple[int, int]:
    """(word bytes, vector words): the widest word (8, 4, 2, 1 bytes) dividing `bits` (the OR of
    the tensors' addresses) and every unit offset and size of `groups`; 16-byte vectors of int64
    words where all of those are multiples of 16."""
    for g in groups:
        if g.align:
            bits |= g.align
        elif g.units.size:
            bits |= int(np.bitwise_or.reduce(g.units.ravel()))
        bits |= g.unit_bytes
    word = next((w for w in (8, 4, 2) if bits % w == 0), 1)
    return word, 2 if bits % 16 == 0 else 1


def request_table(groups: Sequence[UnitGroup], seg_offsets: Sequence[int], word: int, vec: int,
                  chunk_bytes: int | None = None, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(request table, programs): the request row (the programs of work), the headers of
    `groups`, whose segment rows start at `seg_offsets` in the segment table, then their unit
    rows in words (units cut in chunks of about `chunk_bytes`, default CHUNK_BYTES). A group
    without bytes gets a header and no work. Written into the front of `out` when given (of at
    least `request_table_size` words; the result is a view of it)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    header = np.zeros((len(groups) + 1, HEADER), dtype=np.int64)
    table = np.empty(request_table_size(groups), dtype=np.int64) if out is None else out
    program, offset = 0, header.size
    for g, group in enumerate(groups, start=1):
        unit_words = group.unit_bytes // word
        units = group.units if unit_words else group.units[:0]
        chunks = max(1, _ceil_div(group.unit_bytes, chunk_bytes))
        chunk_words = max(_ceil_div(_ceil_div(unit_words, chunks), vec) * vec, vec)  # whole vectors
        chunks = max(_ceil_div(unit_words, chunk_words), 1)
        header[g] = (program, len(group.segments), max(len(units), 1), chunks, unit_words, chunk_words,
                     seg_offsets[g - 1], offset)
        np.floor_divide(units.ravel(), word, out=table[offset : offset + units.size])
        offset += units.size
        program += len(group.segments) * len(units) * chunks
    header[0, 0] = program
    table[: header.size] = header.ravel()
    return table[:offset], program


def request_table_size(groups: Sequence[UnitGroup]) -> int:
    """Words of `groups`' request table (at most: a group without unit words has no unit rows)."""
    return (len(groups) + 1) * HEADER + sum(g.units.size for g in groups)


def segment_rows(src_base: np.ndarray, dst_base: np.ndarray, segments: np.ndarray, word: int) -> np.ndarray:
    """A group's segment rows (both tensors' word offsets from the anchors), flat."""
    return (np.stack([src_base[segments[:, 0]], dst_base[segments[:, 1]]], axis=1) // word).ravel()


def pack(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], groups: Sequence[UnitGroup],
         chunk_bytes: int | None = None) -> tuple[np.ndarray, int, int, int]:
    """(one table: the segment rows, then the request table; programs, word bytes, vector words)
    for ``groups`` (each with bytes to copy); the request table starts after the segment rows."""
    src_base, dst_base, bits = anchored_bases(srcs, dsts)
    word, vec = _words(bits, groups)
    segs = [segment_rows(src_base, dst_base, g.segments, word) for g in groups]
    starts = np.cumsum([0, *(len(r) for r in segs)]).tolist()
    table, programs = request_table(groups, starts[:-1], word, vec, chunk_bytes)
    return np.concatenate([*segs, table]), programs, word, vec


def _upload(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(rows), device)  # one upload, no host sync


def _launch(seg: torch.Tensor, table: torch.Tensor, programs: int, word: int, vec: int, num_groups: int,
            src: torch.Tensor, dst: torch.Tensor) -> None:
    dtype = _WORD_DTYPES[word]
    _unit_copy_kernel[(programs,)](seg, table, src[:word].view(dtype), dst[:word].view(dtype), NUM_GROUPS=num_groups,
                                   HEADER=HEADER, VEC=vec, BLOCK=BLOCK_WORDS, num_warps=NUM_WARPS)


def unit_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], groups: Sequence[UnitGroup]) -> None:
    rows, programs, word, vec = pack(srcs, dsts, groups)
    both = _upload(rows, dsts[0].device)
    split = sum(g.segments.size for g in groups)  # the segment rows come first
    _launch(both, both[split:], programs, word, vec, len(groups), srcs[0], dsts[0])


class SegmentTable:
    """The segment rows of fixed groups of segments between fixed tensors, on their device in
    8-byte words (:func:`copy_prepared` sends only each request's units); with `graphs` (the
    `unit_graphs.UnitGraphs` class, passed in), also the CUDA graphs that launch their copy."""

    def __init__(self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor],
                 segments: Sequence[np.ndarray], graphs: GraphsFactory | None = None) -> None:
        self.srcs, self.dsts, self.segments = srcs, dsts, list(segments)
        src_base, dst_base, self.bits = anchored_bases(srcs, dsts)
        rows = [segment_rows(src_base, dst_base, s, 8) for s in segments]
        self.starts = np.cumsum([0, *(len(r) for r in rows)]).tolist()[:-1]
        self.offsets = dict(zip(map(id, segments), self.starts))
        self.rows = _upload(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64), dsts[0].device)
        self.graphs = None
        if graphs is not None and self.segments and self.bits % 16 == 0:
            try:
                self.graphs = graphs(self.rows, srcs[0], dsts[0], len(self.segments))
            except Exception:  # noqa: BLE001 (every copy launches directly instead)
                logger.warning("unit copy graphs could not be captured on %s; launching directly",
                               dsts[0].device, exc_info=True)

    def every_group(self, groups: Sequence[UnitGroup]) -> list[UnitGroup]:
        """`groups` (at most one per segments array of this table) placed at their segments'
        places, a group without units at the others."""
        by_segments = {id(g.segments): g for g in groups}
        return [by_segments.get(id(s)) or type(groups[0])(0, s, s[:0]) for s in self.segments]


def copy_prepared(table: SegmentTable, groups: Sequence[UnitGroup], stream: torch.cuda.Stream | None = None) -> bool:
    """Copy `groups` (at least one), whose ``segments`` are arrays `table` was built over
    (unchecked: the caller checked every unit against the tensors), through a graph of `table`
    where one is free and fits (`stream`: the current stream, when the caller has it); False
    (nothing launched) when some unit needs words narrower than 8 bytes (copy those with
    :func:`unit_copy`)."""
    word, vec = _words(table.bits, groups)
    if word != 8:
        return False
    ids = [id(g.segments) for g in groups]
    if table.graphs is not None and vec == 2 and len(set(ids)) == len(ids) and all(i in table.offsets for i in ids):
        every = table.every_group(groups)
        slot = table.graphs.free_slot(request_table_size(every))
        if slot is not None:
            rows, _ = request_table(every, table.starts, word, vec, out=slot.view)
            table.graphs.replay_slot(slot, rows.size, stream)
            return True
    rows, programs = request_table(groups, [table.offsets[id(g.segments)] for g in groups], word, vec)
    _launch(table.rows, _upload(rows, table.dsts[0].device), programs, word, vec, len(groups), table.srcs[0],
            table.dsts[0])
    return True
