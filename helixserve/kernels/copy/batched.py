"""One launch that copies many byte ranges between tensors of one device.

``batched_copy(srcs, dsts, table)``: ``table`` is an int64 array ``[n, 5]`` of pieces
``(src_index, src_offset, dst_index, dst_offset, nbytes)``: bytes ``[src_offset, +nbytes)`` of
``srcs[src_index]`` go to bytes ``[dst_offset, +nbytes)`` of ``dsts[dst_index]``; every tensor is
a contiguous uint8 (flat) view. Pieces must not overlap in their destinations (each destination
byte is written once); sources and destinations may be in different processes' memory mapped
into this one (CUDA IPC).

Why our own: the transfer moves a request's KV as a few thousand runs scattered over per-layer
pools (an MLA block run per layer, head slices of each KDA layer's state and conv sections).
``Tensor.copy_`` per run costs a launch each (~5 µs: 20 ms for a fragmented 32k-token request),
``torch._foreach_copy_`` needs a tensor object per run and splits into launches of ~100 tensors,
and gathering into a bounce buffer first doubles the bytes moved. CUDA's ``cudaMemcpyBatchAsync``
is not reachable from torch. Here the host cuts pieces into chunks of at most ``CHUNK_BYTES``
(numpy, one row per chunk), uploads the table once, and one Triton program copies one chunk, in
the widest word (8, 4, 2 or 1 bytes) that every address and length allows.

The reference (CPU, and any device without Triton) copies piece by piece with ``Tensor.copy_``.
The GPU path runs on the current stream, without a host sync; the caller records an event.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from helixserve.kernels.triton_common import has_triton, use_triton

if has_triton():
    from helixserve.kernels.copy import triton_batched

TABLE_COLUMNS = 5


class CopyTableError(ValueError):
    """A piece names a tensor that does not exist or bytes outside it."""


def check_table(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: np.ndarray) -> np.ndarray:
    """``table`` as int64 ``[n, 5]``; CopyTableError naming the first bad piece."""
    table = np.asarray(table, dtype=np.int64).reshape(-1, TABLE_COLUMNS)
    for name, tensors in (("srcs", srcs), ("dsts", dsts)):
        for i, t in enumerate(tensors):
            if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
                raise CopyTableError(f"{name}[{i}] must be a contiguous 1-D uint8 tensor, got {t.dtype} "
                                     f"{tuple(t.shape)}")
    if table.size == 0:
        return table
    si, so, di, do, n = table.T
    src_sizes = np.asarray([t.numel() for t in srcs], dtype=np.int64)
    dst_sizes = np.asarray([t.numel() for t in dsts], dtype=np.int64)
    bad = (si < 0) | (si >= len(srcs)) | (di < 0) | (di >= len(dsts)) | (n < 0) | (so < 0) | (do < 0)
    if not bad.any():
        bad = (so + n > src_sizes[si]) | (do + n > dst_sizes[di])
    if bad.any():
        row = table[int(np.flatnonzero(bad)[0])].tolist()
        raise CopyTableError(f"copy piece (src {row[0]} @ {row[1]}, dst {row[2]} @ {row[3]}, {row[4]} bytes) "
                             f"is outside the {len(srcs)} source / {len(dsts)} destination tensors")
    return table


def batched_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: np.ndarray) -> None:
    """Copy every piece of ``table`` (see the module docstring). Checked first (host only)."""
    table = check_table(srcs, dsts, table)
    if table.size == 0:
        return
    devices = {t.device for t in (*srcs, *dsts)}
    if len(devices) != 1:
        raise CopyTableError(f"batched_copy needs tensors of one device, got {sorted(map(str, devices))}")
    if use_triton(dsts[0]):
        triton_batched.batched_copy(srcs, dsts, table)
        return
    batched_copy_reference(srcs, dsts, table)


def batched_copy_trusted(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: np.ndarray) -> None:
    """:func:`batched_copy` without :func:`check_table`, for a caller that built ``table`` (int64
    ``[n, 5]``) from memory it already bounds-checked, over flat uint8 tensors of one device (the
    pulled shard: ``transceiver.pull.shard_table``). A wrong table here reads or writes outside
    the tensors: anything else goes through :func:`batched_copy`."""
    if not len(table):
        return
    if srcs[0].device != dsts[0].device:
        raise CopyTableError(f"batched_copy needs tensors of one device, got {srcs[0].device} and {dsts[0].device}")
    if use_triton(dsts[0]):
        triton_batched.batched_copy(srcs, dsts, table)
        return
    batched_copy_reference(srcs, dsts, table)


def batched_copy_reference(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: np.ndarray) -> None:
    """Piece by piece (the reference; unchecked)."""
    for si, so, di, do, n in np.asarray(table, dtype=np.int64).reshape(-1, TABLE_COLUMNS).tolist():
        if n:
            dsts[di][do : do + n].copy_(srcs[si][so : so + n])
