"""Rows of a per-slot state pool, read and written in place when the slots are consecutive."""

from __future__ import annotations

import torch

from helixserve.kernels._host import host_list


def slot_rows(pool: torch.Tensor, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``pool[slot_ids]``: a view when the slots are consecutive (update it in place), else a copy
    plus the int64 ids to ``index_copy_`` it back with."""
    ids = host_list(slot_ids)
    first = ids[0] if ids else 0
    if ids == list(range(first, first + len(ids))):
        return pool[first:first + len(ids)], None
    index = slot_ids.to(pool.device, torch.int64)
    return pool.index_select(0, index), index
