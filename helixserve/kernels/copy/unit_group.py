"""A group of equal copy units (a leaf of ``kernels.copy``: the unit copy, its Triton launch and
its graphs all read it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class UnitGroup:
    """Units of ``unit_bytes`` each: ``segments`` int64 ``[S, 2]`` (source index, destination
    index), ``units`` int64 ``[U, 2]`` (source byte offset, destination byte offset). ``align``:
    a number that every unit offset has at least as many trailing zero bits as (a stride the
    offsets are multiples of, or their OR), so the GPU path picks its word size without reading
    the units; 0: not known, the units are read."""

    unit_bytes: int
    segments: np.ndarray
    units: np.ndarray
    align: int = 0

    @property
    def nbytes(self) -> int:
        return self.unit_bytes * len(self.segments) * len(self.units)
