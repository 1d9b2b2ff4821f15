"""Triton path of :func:`helixserve.kernels.copy.units.unit_copy` (see there).

The host packs one int64 table: a header row per group (first program, segments, units, chunks
per unit, unit words, chunk words, where its segment and unit rows start), then each group's
segment rows (both tensors' word offsets from the two anchors, ``srcs[0]`` and ``dsts[0]``) and
unit rows (word offsets in the tensors). It is uploaded once and one launch covers every group:
program ``p`` finds its group by the header's first programs, then its (segment, unit, chunk),
adds the offsets and copies that chunk.

Addresses are offsets from the anchors (kernel arguments, which Triton knows to be 16-byte
aligned) and are hinted to be multiples of the vector, so the copy uses 16-byte loads and stores
when every offset and size is a multiple of 16 bytes (a pointer loaded from a table would get
8-byte ones: Triton cannot know its alignment). Otherwise it copies in the widest word (8, 4, 2
or 1 bytes) that every address and size allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # (units imports this module)
    from helixserve.kernels.copy.units import UnitGroup

CHUNK_BYTES = 64 << 10  # a unit is cut into chunks of about this size, one program each
BLOCK_WORDS = 1024  # words per loop iteration of a program
NUM_WARPS = 4
HEADER = 8  # int64 columns of a group's header row
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _unit_copy_kernel(table_ptr, src_anchor, dst_anchor, NUM_GROUPS: tl.constexpr, HEADER: tl.constexpr,
                      VEC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    group = pid * 0
    for g in tl.static_range(1, NUM_GROUPS):
        group += (pid >= tl.load(table_ptr + g * HEADER)).to(tl.int64)
    head = table_ptr + group * HEADER
    local = pid - tl.load(head)
    num_units = tl.load(head + 2)
    chunks = tl.load(head + 3)
    unit_words = tl.load(head + 4)
    chunk_words = tl.load(head + 5)
    chunk = local % chunks
    rest = local // chunks
    segment = table_ptr + tl.load(head + 6) + (rest // num_units) * 2
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


def word_bytes(values: Sequence[int] | np.ndarray) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every value."""
    bits = int(np.bitwise_or.reduce(np.asarray(values, dtype=np.int64).ravel())) if len(values) else 0
    for word in (8, 4, 2):
        if bits % word == 0:
            return word
    return 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pack(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], groups: Sequence[UnitGroup],
         chunk_bytes: int = CHUNK_BYTES) -> tuple[np.ndarray, int, int, int]:
    """(table, programs, word bytes, vector words) for ``groups`` (each with bytes to copy)."""
    src_base = np.asarray([t.data_ptr() for t in srcs], dtype=np.int64)
    dst_base = np.asarray([t.data_ptr() for t in dsts], dtype=np.int64)
    src_base -= src_base[0]
    dst_base -= dst_base[0]
    values = np.concatenate([src_base, dst_base, [srcs[0].data_ptr(), dsts[0].data_ptr()],
                             *(g.units.ravel() for g in groups), [g.unit_bytes for g in groups]])
    bits = int(np.bitwise_or.reduce(values))
    word = word_bytes([bits])
    vec = 2 if bits % 16 == 0 else 1  # 16-byte vectors of int64 words
    header = np.zeros((len(groups), HEADER), dtype=np.int64)
    rows, program, offset = [], 0, header.size
    for g, group in enumerate(groups):
        unit_words = group.unit_bytes // word
        chunks = max(1, _ceil_div(group.unit_bytes, chunk_bytes))
        chunk_words = _ceil_div(_ceil_div(unit_words, chunks), vec) * vec  # whole vectors
        chunks = _ceil_div(unit_words, chunk_words)
        seg = np.stack([src_base[group.segments[:, 0]], dst_base[group.segments[:, 1]]], axis=1) // word
        header[g] = (program, len(group.segments), len(group.units), chunks, unit_words, chunk_words,
                     offset, offset + seg.size)
        rows += [seg.ravel(), (group.units // word).ravel()]
        offset += seg.size + group.units.size
        program += len(group.segments) * len(group.units) * chunks
    return np.concatenate([header.ravel(), *rows]), program, word, vec


def unit_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], groups: Sequence[UnitGroup]) -> None:
    table, programs, word, vec = pack(srcs, dsts, groups)
    device = dsts[0].device
    rows = torch.from_numpy(table)
    if device.type == "cuda":  # one upload, no host sync (the caching host allocator keeps it alive)
        rows = rows.pin_memory().to(device, non_blocking=True)
    dtype = _WORD_DTYPES[word]
    src_anchor, dst_anchor = srcs[0][:word].view(dtype), dsts[0][:word].view(dtype)
    _unit_copy_kernel[(programs,)](rows, src_anchor, dst_anchor, NUM_GROUPS=len(groups), HEADER=HEADER, VEC=vec,
                                   BLOCK=BLOCK_WORDS, num_warps=NUM_WARPS)
