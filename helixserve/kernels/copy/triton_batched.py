"""Triton path of :func:`helixserve.kernels.copy.batched.batched_copy` (see there)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

CHUNK_BYTES = 64 << 10  # one program copies at most this many bytes
BLOCK_WORDS = 1024  # words per loop iteration of a program
NUM_WARPS = 4
_WORD_DTYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _batched_copy_kernel(chunks_ptr, NUM_WORDS: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr):
    row = chunks_ptr + tl.program_id(0).to(tl.int64) * 3
    src_addr = tl.load(row)
    dst_addr = tl.load(row + 1)
    nwords = tl.load(row + 2)
    if WORD == 8:
        src = src_addr.to(tl.pointer_type(tl.int64))
        dst = dst_addr.to(tl.pointer_type(tl.int64))
    elif WORD == 4:
        src = src_addr.to(tl.pointer_type(tl.int32))
        dst = dst_addr.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        src = src_addr.to(tl.pointer_type(tl.int16))
        dst = dst_addr.to(tl.pointer_type(tl.int16))
    else:
        src = src_addr.to(tl.pointer_type(tl.int8))
        dst = dst_addr.to(tl.pointer_type(tl.int8))
    for start in range(0, NUM_WORDS, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < nwords
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def word_bytes(addresses: np.ndarray, nbytes: np.ndarray) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every address and length."""
    bits = np.bitwise_or.reduce(np.concatenate([addresses.ravel(), nbytes.ravel()]).astype(np.int64))
    for word in (8, 4, 2):
        if int(bits) % word == 0:
            return word
    return 1


def chunk_table(src_addr: np.ndarray, dst_addr: np.ndarray, nbytes: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Rows ``(src_addr, dst_addr, nbytes)`` of at most ``chunk_bytes`` each, covering every piece."""
    keep = nbytes > 0
    src_addr, dst_addr, nbytes = src_addr[keep], dst_addr[keep], nbytes[keep]
    counts = (nbytes + chunk_bytes - 1) // chunk_bytes
    piece = np.repeat(np.arange(nbytes.size), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(piece.size) - first) * chunk_bytes
    size = np.minimum(nbytes[piece] - offset, chunk_bytes)
    return np.stack([src_addr[piece] + offset, dst_addr[piece] + offset, size], axis=1)


def batched_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: np.ndarray) -> None:
    device = dsts[0].device
    src_base = np.asarray([t.data_ptr() for t in srcs], dtype=np.int64)
    dst_base = np.asarray([t.data_ptr() for t in dsts], dtype=np.int64)
    src_addr = src_base[table[:, 0]] + table[:, 1]
    dst_addr = dst_base[table[:, 2]] + table[:, 3]
    nbytes = table[:, 4]
    word = word_bytes(np.concatenate([src_addr, dst_addr]), nbytes)
    chunks = chunk_table(src_addr, dst_addr, nbytes, CHUNK_BYTES)
    if chunks.size == 0:
        return
    chunks[:, 2] //= word
    rows = torch.from_numpy(np.ascontiguousarray(chunks))
    if device.type == "cuda":  # one upload, no host sync (the caching host allocator keeps it alive)
        rows = rows.pin_memory().to(device, non_blocking=True)
    num_words = CHUNK_BYTES // word
    _batched_copy_kernel[(chunks.shape[0],)](rows, NUM_WORDS=num_words, WORD=word,
                                             BLOCK=min(BLOCK_WORDS, num_words), num_warps=NUM_WARPS)
