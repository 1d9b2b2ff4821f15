"""One launch that copies equal-sized units of many tensors, the addresses computed on the device.

A request's KV shard, pulled out of a ctx's pools (``transceiver.pull``), is a few groups of
equal-sized units repeated over layers: every MLA layer copies the same block ids (the ctx's
block ``src_blocks[i]`` to our ``dst_blocks[i]``), every KDA layer the same slot and head slice.
A :class:`UnitGroup` says exactly that: for every segment ``s`` (a (source tensor, destination
tensor) pair, one per layer) and every unit ``u``, bytes ``[units[u, 0], +unit_bytes)`` of
``srcs[segments[s, 0]]`` go to bytes ``[units[u, 1], +unit_bytes)`` of ``dsts[segments[s, 1]]``.
The host sends the segment and unit lists (a few hundred numbers for a 32k-token request) and
the device computes every address, so the host cuts no per-piece table and the cost of a launch
does not grow with the layer count.

Why our own: ``Tensor.copy_`` per unit costs a launch each (thousands per long request),
``torch._foreach_copy_`` needs a tensor object per unit, gathering into a bounce buffer doubles
the bytes, and CUDA's ``cudaMemcpyBatchAsync`` is not reachable from torch. The Triton path
(``triton_units``) copies in 16-byte vectors where every address and size allows it.

Every tensor is a contiguous 1-D uint8 (flat) view of one device; sources and destinations may
be mapped from another process (CUDA IPC). Units must not overlap in their destinations. The
check (:func:`check_units`) is O(segments + units) on the host and always runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from helixserve.kernels.copy.unit_group import UnitGroup
from helixserve.kernels.triton_common import has_triton, use_triton

if has_triton():
    from helixserve.kernels.copy import triton_units
    from helixserve.kernels.copy.unit_graphs import UnitGraphs


class CopyUnitsError(ValueError):
    """A unit group names a tensor that does not exist or bytes outside it."""


def _check_tensors(name: str, tensors: Sequence[torch.Tensor]) -> np.ndarray:
    for i, t in enumerate(tensors):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise CopyUnitsError(f"{name}[{i}] must be a contiguous 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
    return np.asarray([t.numel() for t in tensors], dtype=np.int64)


def check_units(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], groups: Sequence[UnitGroup]) -> None:
    """CopyUnitsError naming the first group whose segments or units fall outside the tensors."""
    sizes = {"source": _check_tensors("srcs", srcs), "destination": _check_tensors("dsts", dsts)}
    for g, group in enumerate(groups):
        if group.unit_bytes < 0:
            raise CopyUnitsError(f"group {g}: unit_bytes {group.unit_bytes} < 0")
        segments, units = group.segments, group.units
        if segments.ndim != 2 or segments.shape[1] != 2 or units.ndim != 2 or units.shape[1] != 2:
            raise CopyUnitsError(f"group {g}: segments {segments.shape} and units {units.shape} must be [n, 2]")
        if not len(segments) or not len(units) or not group.unit_bytes:
            continue
        for side, (name, size) in enumerate(sizes.items()):
            index = segments[:, side]
            if index.min() < 0 or index.max() >= len(size):
                raise CopyUnitsError(f"group {g}: a segment names {name} tensor {int(index.max())} "
                                     f"(or {int(index.min())}) of {len(size)}")
            low, high = int(units[:, side].min()), int(units[:, side].max()) + group.unit_bytes
            room = int(size[index].min())
            if low < 0 or high > room:
                raise CopyUnitsError(f"group {g}: {name} unit bytes [{low}, {high}) outside a {room}-byte tensor")


def unit_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], groups: Sequence[UnitGroup]) -> None:
    """Copy every unit of every group (see the module docstring); checked first, on the host.
    The GPU path runs on the current stream without a host sync: the caller records an event."""
    check_units(srcs, dsts, groups)
    groups = [g for g in groups if g.nbytes]
    if not groups:
        return
    devices = {t.device for t in (*srcs, *dsts)}
    if len(devices) != 1:
        raise CopyUnitsError(f"unit_copy needs tensors of one device, got {sorted(map(str, devices))}")
    if use_triton(dsts[0]):
        triton_units.unit_copy(srcs, dsts, groups)
        return
    unit_copy_reference(srcs, dsts, groups)


class UnitCopier:
    """Copies between fixed tensors whose groups always use the same ``segments`` arrays (one
    per group, given here; a pull: one ctx's pools into ours, per layer): the tensors and the
    segment indices are checked once, and on the GPU the segment rows stay on the device, so a
    copy sends only its units. :meth:`copy` does not check the units: the caller keeps them
    inside the tensors (`transceiver.pull` range-checks every block id and slot). With `graphs`,
    GPU copies replay CUDA graphs of the launch where they can (`unit_graphs`: the first GPU copy
    captures them)."""

    def __init__(self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], segments: Sequence[np.ndarray],
                 graphs: bool = False) -> None:
        sizes = (_check_tensors("srcs", srcs), _check_tensors("dsts", dsts))
        for seg in segments:
            if seg.ndim != 2 or seg.shape[1] != 2 or (len(seg) and (
                    seg.min() < 0 or seg[:, 0].max() >= len(sizes[0]) or seg[:, 1].max() >= len(sizes[1]))):
                raise CopyUnitsError(f"segments {seg.tolist()} do not name {len(srcs)} sources and {len(dsts)} destinations")
        self.srcs, self.dsts, self.segments = list(srcs), list(dsts), list(segments)
        self._segment_ids = {id(s) for s in self.segments}
        self.graphs = graphs
        self._table = None  # triton_units.SegmentTable, built on the first GPU copy

    def copy(self, groups: Sequence[UnitGroup], stream: torch.cuda.Stream | None = None) -> None:
        """Copy `groups` (each ``segments`` one of this copier's arrays) on the current stream
        (`stream`: the current stream, when the caller has it at hand)."""
        groups = [g for g in groups if g.nbytes]
        if not groups:
            return
        if use_triton(self.dsts[0]) and all(id(g.segments) in self._segment_ids for g in groups):
            if self._table is None:
                self._table = triton_units.SegmentTable(self.srcs, self.dsts, self.segments,
                                                        UnitGraphs if self.graphs else None)
            if triton_units.copy_prepared(self._table, groups, stream):
                return
        unit_copy(self.srcs, self.dsts, groups)


def unit_copy_reference(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], groups: Sequence[UnitGroup]) -> None:
    """Unit by unit with ``Tensor.copy_`` (the reference; unchecked)."""
    for group in groups:
        n = group.unit_bytes
        for si, di in group.segments.tolist():
            for so, do in group.units.tolist():
                dsts[di][do : do + n].copy_(srcs[si][so : so + n])
